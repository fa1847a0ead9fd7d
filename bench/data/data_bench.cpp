// Data layer benchmarks; one JSON line per configuration on stdout.
//
//   data_bench datagen --out DIR [--scenes N] [--threads T] [--cameras 6 --height 128 --width 224]
//       generates N train scenes (no val) and reports scenes/s and bytes written;
//   data_bench loader --data DIR [--split train] [--workers 1,2] [--batch-size 4] [--batches 40]
//                     [--augment 1] [--repeats 3]
//       times the loader (read + decode + augment + collate) per worker count after a warm-up and
//       reports the median over repeats of scenes/s.
//   data_bench jpeg --out DIR [--scenes 4] [--cameras 6 --height 900 --width 1600] [--quality 95]
//                   [--scales 1,2,4,8] [--repeats 3]
//       renders N scenes, encodes every camera as JPEG (the shards' codec) into DIR/cam_*.jpg (for
//       bench/data/jpeg_decode.py to decode the same files with Pillow), then times decoding them
//       on one thread at each DCT scale: scenes/s per core (median over repeats) and bytes per
//       scene; then the loader's per-camera path to a model input of --fit HxW (default 256x704):
//       decode (at full size, and at the DCT scale the loader picks) + one resample to HxW, with
//       and without the training augmentation (resize 0.94-1.12 folded into the resample, crop,
//       photometric jitter), as data::DataLoader runs it (data/augment.h).
#include "core/log.h"
#include "core/strings.h"
#include "core/timer.h"
#include "data/datagen.h"
#include "data/dataset.h"
#include "data/hdf5_util.h"
#include "data/jpeg.h"
#include "data/loader.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

using namespace parallax;

namespace {

std::map<std::string, std::string> parse(int argc, char** argv) {
  std::map<std::string, std::string> m;
  for (int i = 2; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    if (k.rfind("--", 0) != 0) throw std::runtime_error("expected --key value, got " + k);
    m[k.substr(2)] = argv[i + 1];
  }
  return m;
}

std::string get(const std::map<std::string, std::string>& m, const std::string& k,
                const std::string& d) {
  const auto it = m.find(k);
  return it == m.end() ? d : it->second;
}

int bench_datagen(const std::map<std::string, std::string>& a) {
  data::DatagenOptions o;
  o.out = get(a, "out", "");
  if (o.out.empty()) throw std::runtime_error("datagen: --out DIR is required");
  o.train_scenes = std::stoll(get(a, "scenes", "40"));
  o.val_scenes = 0;
  o.threads = std::stoi(get(a, "threads", "2"));
  o.gen.cameras = std::stoi(get(a, "cameras", "6"));
  o.gen.height = std::stoi(get(a, "height", "128"));
  o.gen.width = std::stoi(get(a, "width", "224"));
  o.gen.samples_per_pixel = std::stoi(get(a, "samples-per-pixel", "4"));
  o.compression = std::stoi(get(a, "compression", "1"));
  o.overwrite = true;
  o.progress_interval_s = 1e9;
  const auto s = data::generate_dataset(o);
  std::printf(
      "{\"bench\": \"datagen\", \"scenes\": %lld, \"threads\": %d, \"cameras\": %d, \"height\": "
      "%d, "
      "\"width\": %d, \"samples_per_pixel\": %d, \"compression\": %d, \"seconds\": %.3f, "
      "\"scenes_per_s\": %.3f, \"bytes_per_scene\": %lld, \"hardware_threads\": %u}\n",
      static_cast<long long>(o.train_scenes), o.threads, o.gen.cameras, o.gen.height, o.gen.width,
      o.gen.samples_per_pixel, o.compression, s.seconds, o.train_scenes / s.seconds,
      static_cast<long long>(s.bytes / o.train_scenes), std::thread::hardware_concurrency());
  return 0;
}

int bench_loader(const std::map<std::string, std::string>& a) {
  const std::string dir = get(a, "data", "");
  if (dir.empty()) throw std::runtime_error("loader: --data DIR is required");
  const auto ds = data::Dataset::open(dir, get(a, "split", "train"));
  const int64_t batch = std::stoll(get(a, "batch-size", "4"));
  const int batches = std::stoi(get(a, "batches", "40"));
  const int repeats = std::stoi(get(a, "repeats", "3"));
  const bool augment = get(a, "augment", "1") == "1";
  for (const auto& w : core::split(get(a, "workers", "1,2"), ',')) {
    const int workers = std::stoi(w);
    std::vector<double> rates;
    for (int r = 0; r < repeats; ++r) {
      data::LoaderOptions o;
      o.batch_size = batch;
      o.num_workers = workers;
      o.prefetch = 4;
      o.augment = augment;
      o.seed = static_cast<uint64_t>(r);
      data::DataLoader loader(ds, o);
      for (int i = 0; i < 3; ++i) loader.next();  // warm-up: workers started, caches warm
      core::Stopwatch sw;
      for (int i = 0; i < batches; ++i) loader.next();
      rates.push_back(static_cast<double>(batches * batch) / sw.elapsed_s());
    }
    std::sort(rates.begin(), rates.end());
    std::printf(
        "{\"bench\": \"loader\", \"workers\": %d, \"batch_size\": %lld, \"batches\": %d, "
        "\"augment\": %s, "
        "\"repeats\": %d, \"scenes_per_s_median\": %.2f, \"scenes_per_s_min\": %.2f, "
        "\"scenes_per_s_max\": %.2f, \"cameras\": %lld, \"height\": %lld, \"width\": %lld, "
        "\"hdf5_threadsafe\": %s, \"hardware_threads\": %u}\n",
        workers, static_cast<long long>(batch), batches, augment ? "true" : "false", repeats,
        rates[rates.size() / 2], rates.front(), rates.back(),
        static_cast<long long>(ds->info().cameras), static_cast<long long>(ds->info().image_height),
        static_cast<long long>(ds->info().image_width),
        data::h5::library_threadsafe() ? "true" : "false", std::thread::hardware_concurrency());
    std::fflush(stdout);
  }
  return 0;
}

int bench_jpeg(const std::map<std::string, std::string>& a) {
  const std::string out = get(a, "out", "");
  if (out.empty()) throw std::runtime_error("jpeg: --out DIR is required");
  std::filesystem::create_directories(out);
  data::GeneratorOptions g;
  g.cameras = std::stoi(get(a, "cameras", "6"));
  g.height = std::stoi(get(a, "height", "900"));
  g.width = std::stoi(get(a, "width", "1600"));
  g.samples_per_pixel = 1;
  const int scenes = std::stoi(get(a, "scenes", "4"));
  const int quality = std::stoi(get(a, "quality", "95"));
  const int repeats = std::stoi(get(a, "repeats", "3"));
  std::vector<std::vector<uint8_t>> files;
  for (int i = 0; i < scenes; ++i) {
    const auto rec = data::generate_scene(g, 11, i).record;
    for (int64_t c = 0; c < rec.images.size(0); ++c) {
      files.push_back(data::encode_jpeg(rec.images[c], quality, "bench"));
      std::ofstream(fmt::format("{}/cam_{:03d}_{}.jpg", out, i, c), std::ios::binary)
          .write(reinterpret_cast<const char*>(files.back().data()),
                 static_cast<std::streamsize>(files.back().size()));
    }
  }
  std::size_t bytes = 0;
  for (const auto& f : files) bytes += f.size();
  for (const auto& sc : core::split(get(a, "scales", "1,2,4,8"), ',')) {
    const int scale = std::stoi(sc);
    std::vector<double> rates;
    int64_t h = 0, w = 0;
    for (int r = 0; r < repeats; ++r) {
      core::Stopwatch sw;
      for (const auto& f : files) {
        const at::Tensor img = data::decode_jpeg(f.data(), f.size(), scale, "bench");
        h = img.size(0);
        w = img.size(1);
      }
      rates.push_back(scenes / sw.elapsed_s());
    }
    std::sort(rates.begin(), rates.end());
    std::printf(
        "{\"bench\": \"jpeg_decode\", \"impl\": \"libjpeg-turbo\", \"scale\": %d, \"cameras\": "
        "%d, \"height\": %d, \"width\": %d, \"decoded\": [%lld, %lld], \"quality\": %d, "
        "\"scenes\": %d, \"bytes_per_scene\": %zu, \"scenes_per_s_per_core\": %.2f}\n",
        scale, g.cameras, g.height, g.width, static_cast<long long>(h), static_cast<long long>(w),
        quality, scenes, bytes / static_cast<std::size_t>(scenes), rates[rates.size() / 2]);
    std::fflush(stdout);
  }
  // The loader's path per camera: decode, then one resample to the model's input (+ augmentation).
  const auto fit = core::split(get(a, "fit", "256x704"), 'x');
  const int64_t fh = std::stoll(fit.at(0)), fw = std::stoll(fit.at(1));
  int dct = 1;
  for (int k : {8, 4, 2}) {
    if ((g.height + k - 1) / k >= fh && (g.width + k - 1) / k >= fw) {
      dct = k;
      break;
    }
  }
  data::AugmentOptions aug;
  for (const int scale : {1, dct}) {
    for (const bool augment : {false, true}) {
      std::vector<double> rates;
      at::Tensor out = at::empty({fh, fw, 3}, at::kByte);
      for (int r = 0; r < repeats; ++r) {
        core::Stopwatch sw;
        for (size_t f = 0; f < files.size(); ++f) {
          const at::Tensor img =
              data::decode_jpeg(files[f].data(), files[f].size(), scale, "bench");
          const double sx = static_cast<double>(fw) * scale / g.width;
          const double sy = static_cast<double>(fh) * scale / g.height;
          data::CameraAugment ca;
          if (augment) {
            ca = data::draw_augment(aug, 1, fh, fw, 5, r, static_cast<int64_t>(f)).cameras[0];
          }
          data::resample(img.data_ptr<uint8_t>(), img.size(0), img.size(1), out.data_ptr<uint8_t>(),
                         fh, fw, ca.scale * sx, ca.scale * sy, ca.ox, ca.oy);
          if (augment) data::photometric(out.data_ptr<uint8_t>(), fh, fw, ca);
        }
        rates.push_back(scenes / sw.elapsed_s());
      }
      std::sort(rates.begin(), rates.end());
      std::printf(
          "{\"bench\": \"jpeg_to_input\", \"impl\": \"libjpeg-turbo + data::resample\", "
          "\"dct_scale\": %d, \"augment\": %s, \"from\": [%d, %d], \"to\": [%lld, %lld], "
          "\"cameras\": %d, \"scenes_per_s_per_core\": %.2f}\n",
          scale, augment ? "true" : "false", g.height, g.width, static_cast<long long>(fh),
          static_cast<long long>(fw), g.cameras, rates[rates.size() / 2]);
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "datagen") return bench_datagen(parse(argc, argv));
    if (mode == "loader") return bench_loader(parse(argc, argv));
    if (mode == "jpeg") return bench_jpeg(parse(argc, argv));
    std::fprintf(
        stderr, "usage: data_bench datagen|loader|jpeg [--key value ...] (see the file comment)\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "data_bench: error: %s\n", e.what());
    return 1;
  }
}
