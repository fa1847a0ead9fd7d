#include "data/datagen.h"

#include "core/error.h"
#include "core/log.h"
#include "core/progress.h"
#include "core/rng.h"
#include "core/strings.h"
#include "data/jpeg.h"
#include "data/ordered_pool.h"
#include "data/random.h"
#include "data/render.h"
#include "data/sequence_gen.h"
#include "data/shard.h"

#include <ATen/ops/empty.h>
#include <fmt/format.h>

#include <filesystem>
#include <map>
#include <regex>
#include <thread>

namespace fs = std::filesystem;

namespace parallax::data {
namespace {

void check_options(const DatagenOptions& o) {
  auto bad = [](const std::string& what) { throw UsageError("datagen: " + what); };
  if (o.out.empty()) bad("--out DIR is required");
  if (o.train_scenes < 1) bad(fmt::format("--scenes must be >= 1, got {}", o.train_scenes));
  if (o.val_scenes < 0) bad(fmt::format("--val-scenes must be >= 0, got {}", o.val_scenes));
  if (o.gen.cameras < 1 || o.gen.cameras > 16)
    bad(fmt::format("--cameras must be in 1..16, got {}", o.gen.cameras));
  if (o.gen.height < 8 || o.gen.height > 4096 || o.gen.width < 8 || o.gen.width > 4096) {
    bad(fmt::format("--height and --width must be in 8..4096, got {} x {}", o.gen.height,
                    o.gen.width));
  }
  if (o.gen.sequence_length < 1)
    bad(fmt::format("--sequence-length must be >= 1, got {}", o.gen.sequence_length));
  if (o.gen.frame_interval_us < 1) {
    bad(fmt::format("--frame-interval must be at least 1 microsecond, got {} us",
                    o.gen.frame_interval_us));
  }
  if (o.shard_scenes < 1) bad(fmt::format("--shard-scenes must be >= 1, got {}", o.shard_scenes));
  if (o.threads < 0) bad(fmt::format("--threads must be >= 0, got {}", o.threads));
  if (o.compression < 0 || o.compression > 9)
    bad(fmt::format("--compression must be in 0..9, got {}", o.compression));
  const auto& g = o.gen.bev;
  if (!(g.resolution > 0) || !(g.x_max > g.x_min) || !(g.y_max > g.y_min))
    bad("the BEV grid is empty");
  if (o.image_codec != "raw" && o.image_codec != "jpeg")
    bad(fmt::format("--image-codec must be raw or jpeg, got '{}'", o.image_codec));
  if (o.image_codec == "jpeg" && (o.jpeg_quality < 1 || o.jpeg_quality > 100))
    bad(fmt::format("--quality must be in 1..100, got {}", o.jpeg_quality));
  if (o.image_codec == "jpeg" && !jpeg_available())
    bad("--image-codec jpeg: this build has no JPEG codec (libjpeg-turbo was not found when it was "
        "built; install libturbojpeg0-dev and rebuild)");
}

// Removes what a previous generation left in `dir` (its dataset.json first, so the folder is never
// a valid dataset while being rewritten).
void clear_previous(const std::string& dir) {
  std::error_code ec;
  fs::remove(fs::path(dir) / "dataset.json", ec);
  const std::regex shard_re(R"((train|val)_\d{5}\.h5(\.tmp)?)");
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (std::regex_match(e.path().filename().string(), shard_re)) fs::remove(e.path(), ec);
  }
}

}  // namespace

uint64_t split_seed(uint64_t seed, const std::string& split) {
  uint64_t id = 1469598103934665603ULL;  // FNV-1a of the name, so any split name has its own seed
  for (char c : split) id = (id ^ static_cast<unsigned char>(c)) * 1099511628211ULL;
  if (split == "train") id = 0;
  if (split == "val") id = 1;
  return core::derive_seed(seed, id, static_cast<uint64_t>(SeedStream::kSplit));
}

namespace {

// Renders and labels g.layout into g.record (and the buffers).
void render_scene(const GeneratorOptions& opts, GeneratedScene& g, int64_t index,
                  bool with_buffers) {
  const int64_t N = opts.cameras, H = opts.height, W = opts.width;
  SceneRecord& r = g.record;
  r.index = index;
  r.images = at::empty({N, H, W, 3}, at::kByte);
  r.intrinsics = at::empty({N, 3, 3}, at::kFloat);
  r.cam_to_ego = at::empty({N, 4, 4}, at::kFloat);
  if (with_buffers) {
    g.instance = at::empty({N, H, W}, at::kInt);
    g.depth = at::empty({N, H, W}, at::kFloat);
  }
  for (int64_t k = 0; k < N; ++k) {
    const auto& cam = g.layout.cameras[static_cast<size_t>(k)];
    render_camera_into(g.layout, static_cast<int>(k), opts.samples_per_pixel,
                       r.images.data_ptr<uint8_t>() + k * H * W * 3,
                       with_buffers ? g.instance.data_ptr<int32_t>() + k * H * W : nullptr,
                       with_buffers ? g.depth.data_ptr<float>() + k * H * W : nullptr);
    // Small tensors: element-wise copies (no LibTorch kernels, so no intra-op threads here).
    const at::Tensor K = geom::intrinsics_tensor(cam.K), T = geom::pose_tensor(cam.cam_to_ego);
    std::copy_n(K.data_ptr<float>(), 9, r.intrinsics.data_ptr<float>() + k * 9);
    std::copy_n(T.data_ptr<float>(), 16, r.cam_to_ego.data_ptr<float>() + k * 16);
  }
  r.bev_semantics = bev_labels(g.layout, opts.bev);
  r.boxes = box_labels(g.layout);
}

}  // namespace

GeneratedScene generate_scene(const GeneratorOptions& opts, uint64_t split_seed_value,
                              int64_t index, bool with_buffers) {
  GeneratedScene g;
  if (opts.sequence_length <= 1) {
    g.layout = make_layout(opts, scene_seed(split_seed_value, index));
    render_scene(opts, g, index, with_buffers);
    return g;
  }
  // Frame f of sequence s: the sequence's world (a pure function of its seed, so every frame's
  // job rebuilds the same one on whatever thread), moved to t_f.
  const int64_t L = opts.sequence_length, s = index / L, f = index % L;
  const double horizon_s = static_cast<double>((L - 1) * opts.frame_interval_us) * 1e-6;
  const SequenceWorld world = make_sequence_world(opts, scene_seed(split_seed_value, s), horizon_s);
  const int64_t t_us = f * opts.frame_interval_us;
  SequenceFrame frame = sequence_frame(opts, world, static_cast<double>(t_us) * 1e-6);
  g.layout = std::move(frame.layout);
  render_scene(opts, g, index, with_buffers);
  SceneRecord& r = g.record;
  r.velocities = frame.velocities;
  r.ego_to_global = frame.ego_to_global;
  r.instance_ids = at::empty({static_cast<int64_t>(frame.instance_ids.size())}, at::kLong);
  std::copy(frame.instance_ids.begin(), frame.instance_ids.end(),
            r.instance_ids.data_ptr<int64_t>());
  r.sequence = s;
  r.frame = f;
  r.prev_index = f > 0 ? index - 1 : -1;
  r.timestamp_us = t_us;
  return g;
}

DatagenSummary generate_dataset(const DatagenOptions& o) {
  check_options(o);
  std::error_code ec;
  fs::create_directories(o.out, ec);
  if (ec) throw_error<IoError>("cannot create dataset folder '{}': {}", o.out, ec.message());
  if (fs::exists(fs::path(o.out) / "dataset.json") && !o.overwrite) {
    throw_error<UsageError>("datagen: '{}' already holds a dataset; pass --overwrite to replace it",
                            o.out);
  }
  clear_previous(o.out);

  const int threads = o.threads > 0
                          ? o.threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  DatasetInfo info;
  info.dir = o.out;
  info.generator = fmt::format("parallax datagen 0.1.0 (seed {})", o.seed);
  info.cameras = o.gen.cameras;
  info.image_height = o.gen.height;
  info.image_width = o.gen.width;
  info.image_codec = o.image_codec;
  info.jpeg_quality = o.image_codec == "jpeg" ? o.jpeg_quality : 0;
  info.bev = o.gen.bev;
  info.sequence_length = o.gen.sequence_length;
  info.frame_interval =
      o.gen.sequence_length > 1 ? static_cast<double>(o.gen.frame_interval_us) * 1e-6 : 0.0;

  struct Job {
    std::string split;
    uint64_t seed;
    int64_t index;
  };
  std::vector<Job> jobs;
  for (const auto& [split, n] :
       {std::pair<std::string, int64_t>{"train", o.train_scenes}, {"val", o.val_scenes}}) {
    if (n == 0) continue;
    const uint64_t s = split_seed(o.seed, split);
    SplitInfo si;
    si.scenes = n;
    for (int64_t shard = 0; shard * o.shard_scenes < n; ++shard)
      si.shards.push_back(fmt::format("{}_{:05d}.h5", split, shard));
    info.splits[split] = si;
    for (int64_t i = 0; i < n; ++i) jobs.push_back({split, s, i});
  }
  const auto total = static_cast<int64_t>(jobs.size());
  core::log::info(
      "datagen: {} train + {} val scenes, {} cameras of {} x {}, BEV {} x {} cells, {} threads -> "
      "{}",
      o.train_scenes, o.val_scenes, o.gen.cameras, o.gen.height, o.gen.width, o.gen.bev.x_cells(),
      o.gen.bev.y_cells(), threads, o.out);

  core::Progress progress("datagen scene", total, o.progress_interval_s);
  DatagenSummary summary;
  {
    OrderedPool<GeneratedScene> gen(total, threads, [&](int64_t j) {
      const Job& job = jobs[static_cast<size_t>(j)];
      return generate_scene(o.gen, job.seed, job.index);
    });
    std::unique_ptr<ShardWriter> writer;
    std::string writer_split;
    int64_t writer_shard = -1;
    for (int64_t j = 0; j < total; ++j) {
      const Job& job = jobs[static_cast<size_t>(j)];
      GeneratedScene scene = gen.take(j);
      const int64_t shard = job.index / o.shard_scenes;
      if (!writer || writer_split != job.split || writer_shard != shard) {
        if (writer) writer->close();
        const std::string name = info.splits.at(job.split).shards.at(static_cast<size_t>(shard));
        writer = std::make_unique<ShardWriter>(join_path(o.out, name), o.compression,
                                               static_cast<int>(info.jpeg_quality));
        writer_split = job.split;
        writer_shard = shard;
      }
      writer->write(scene.record);
      progress.update(j + 1, job.split);
    }
    if (writer) writer->close();
  }
  write_dataset_json(o.out, info);
  for (const auto& [split, si] : info.splits) {
    for (const auto& s : si.shards)
      summary.bytes += static_cast<int64_t>(fs::file_size(fs::path(o.out) / s, ec));
  }
  summary.seconds = progress.elapsed_s();
  progress.finish(fmt::format("{} on disk", core::human_bytes(static_cast<double>(summary.bytes))));
  summary.info = info;
  return summary;
}

}  // namespace parallax::data
