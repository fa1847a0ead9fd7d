// models_report: the parameter / FLOP table of every model of the zoo (docs/models.md), computed
// analytically (nothing is allocated, so 3b is fine); with --time the single-thread CPU
// forward+backward time per sample of bev/tiny; with --bench the forward+backward throughput of one
// model on a device (a quick check, not the benchmark driver of bench/).
//
//   models_report                 # markdown tables
//   models_report --time [iters]  # also time bev/tiny (both backbones) on one CPU thread
//   models_report --bench vit_cls/b16 --device cuda --batch 64 --dtype bf16 [--iters 20]
//   models_report --bench bev/base/vit --device cuda --batch 2 --dtype bf16 [--profile]
#include "models/model.h"
#include "models/perception_model.h"

#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

using namespace parallax;
using namespace parallax::models;

namespace {

std::string scene_text(const core::SceneSpec& s) {
  return fmt::format("{} x {}x{}, BEV {}x{} @ {} m", s.num_cameras, s.image_height, s.image_width,
                     s.bev_x_cells(), s.bev_y_cells(), s.bev_resolution);
}

void print_row(const std::string& label, const std::string& scene,
               const std::vector<ModuleCost>& costs) {
  double p = 0, f = 0;
  std::string parts;
  for (const auto& c : costs) {
    p += static_cast<double>(c.params);
    f += c.flops;
    parts += fmt::format("{}{} {:.2f}M / {:.2f}G", parts.empty() ? "" : "; ", c.name,
                         c.params / 1e6, c.flops / 1e9);
  }
  std::printf("| %s | %s | %.3f M | %.2f | %s |\n", label.c_str(), scene.c_str(), p / 1e6, f / 1e9,
              parts.c_str());
}

struct Timing {
  double wall_s, cpu_s;  // per sample, median over iterations
};

// Wall and process CPU time per sample of forward + loss + backward (the CPU time is what the
// step costs when other processes compete for the cores).
Timing time_tiny(const std::string& backbone, int iters, int64_t batch_size) {
  ModelConfig cfg;
  cfg.name = "bev";
  cfg.size = "tiny";
  cfg.backbone = backbone;
  auto model = build_model(cfg, core::SceneSpec{});
  const auto batch = model->example_batch(batch_size);
  std::vector<double> wall, cpu;
  for (int i = 0; i < iters + 2; ++i) {
    model->zero_grad();
    const auto t0 = std::chrono::steady_clock::now();
    const std::clock_t c0 = std::clock();
    auto loss = model->loss(batch, model->forward(batch));
    loss.total.backward();
    const double c = static_cast<double>(std::clock() - c0) / CLOCKS_PER_SEC;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (i >= 2) {
      wall.push_back(s / static_cast<double>(batch_size));
      cpu.push_back(c / static_cast<double>(batch_size));
    }
  }
  std::sort(wall.begin(), wall.end());
  std::sort(cpu.begin(), cpu.end());
  return {wall[wall.size() / 2], cpu[cpu.size() / 2]};
}

struct BenchArgs {
  std::string model;  // name/size[/backbone]
  std::string device = "cpu", dtype = "fp32";
  int64_t batch = 8;
  int iters = 20;
  bool profile = false;  // print the ops/kernels with the most time over 3 extra steps
};

// Total time per op / kernel name over `fn`, largest first (device kernels when on CUDA).
void print_profile(const std::function<void()>& fn, bool cuda) {
  namespace prof = torch::autograd::profiler;
  using torch::profiler::impl::ActivityType;
  const torch::profiler::impl::ProfilerConfig cfg(torch::profiler::impl::ProfilerState::KINETO);
  std::set<ActivityType> acts{ActivityType::CPU};
  if (cuda) acts.insert(ActivityType::CUDA);
  prof::prepareProfiler(cfg, acts);
  prof::enableProfiler(cfg, acts);
  fn();
  auto result = prof::disableProfiler();
  std::map<std::string, std::pair<double, int>> total;
  for (const auto& e : result->events()) {
    if (cuda != (e.deviceType() == c10::DeviceType::CUDA)) continue;
    auto& t = total[e.name().substr(0, 110)];
    t.first += static_cast<double>(e.durationNs()) / 1e6;
    t.second += 1;
  }
  std::vector<std::pair<double, std::string>> rows;
  for (const auto& [name, t] : total) rows.emplace_back(t.first, name);
  std::sort(rows.rbegin(), rows.rend());
  for (std::size_t i = 0; i < std::min<std::size_t>(30, rows.size()); ++i) {
    std::printf("%10.2f ms %6d  %s\n", rows[i].first, total[rows[i].second].second,
                rows[i].second.c_str());
  }
}

// Forward + loss + backward of one model; prints one JSON line.
int bench(const BenchArgs& a) {
  ModelConfig cfg;
  const auto p1 = a.model.find('/');
  if (p1 == std::string::npos) {
    std::fprintf(stderr, "--bench expects name/size[/backbone], got '%s'\n", a.model.c_str());
    return 2;
  }
  cfg.name = a.model.substr(0, p1);
  const auto p2 = a.model.find('/', p1 + 1);
  cfg.size = a.model.substr(p1 + 1, p2 == std::string::npos ? std::string::npos : p2 - p1 - 1);
  if (p2 != std::string::npos) cfg.backbone = a.model.substr(p2 + 1);
  const core::SceneSpec scene = cfg.name == "bev" ? benchmark_scene(cfg.size) : core::SceneSpec{};
  const c10::Device device(a.device);
  const bool cuda = device.is_cuda();
  auto model = build_model(cfg, scene);
  model->to(device);
  const auto batch = core::to_device(model->example_batch(a.batch), device);
  const bool bf16 = a.dtype == "bf16";
  auto sync = [&] {
    if (cuda) torch::cuda::synchronize();
  };
  auto step = [&] {
    for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
    // Autocast around forward and loss only, its weight cache cleared every step (as
    // torch.autocast does on leaving the context).
    if (bf16) {
      at::autocast::set_autocast_dtype(device.type(), at::kBFloat16);
      at::autocast::set_autocast_enabled(device.type(), true);
    }
    auto loss = model->loss(batch, model->forward(batch));
    if (bf16) {
      at::autocast::set_autocast_enabled(device.type(), false);
      at::autocast::clear_cache();
    }
    loss.total.backward();
  };
  std::vector<double> ms;
  for (int i = 0; i < a.iters + 5; ++i) {
    sync();
    const auto t0 = std::chrono::steady_clock::now();
    step();
    sync();
    if (i >= 5)
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  if (a.profile) {
    print_profile(
        [&] {
          for (int i = 0; i < 3; ++i) step();
          sync();
        },
        cuda);
  }
  std::sort(ms.begin(), ms.end());
  const double med = ms[ms.size() / 2];
  const double flops = 3.0 * model->forward_flops_per_sample() * static_cast<double>(a.batch);
  std::printf(
      "{\"model\": \"%s\", \"device\": \"%s\", \"dtype\": \"%s\", \"batch\": %ld, \"params\": %ld, "
      "\"fwd_gflops_per_sample\": %.3f, \"step_ms_median\": %.3f, \"samples_per_s\": %.2f, "
      "\"tflops\": %.2f}\n",
      a.model.c_str(), a.device.c_str(), a.dtype.c_str(), static_cast<long>(a.batch),
      static_cast<long>(model->parameter_count()), model->forward_flops_per_sample() / 1e9, med,
      1000.0 * static_cast<double>(a.batch) / med, flops / (med * 1e-3) / 1e12);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 0;
  BenchArgs b;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc && argv[i + 1][0] != '-';
    if (arg == "--time")
      iters = has_value ? std::max(1, std::atoi(argv[++i])) : 5;
    else if (arg == "--bench" && has_value)
      b.model = argv[++i];
    else if (arg == "--device" && has_value)
      b.device = argv[++i];
    else if (arg == "--dtype" && has_value)
      b.dtype = argv[++i];
    else if (arg == "--batch" && has_value)
      b.batch = std::atoll(argv[++i]);
    else if (arg == "--profile")
      b.profile = true;
    else if (arg == "--iters" && has_value)
      b.iters = std::max(1, std::atoi(argv[++i]));
    else {
      std::fprintf(stderr, "models_report: unknown or incomplete argument '%s'\n", arg.c_str());
      return 2;
    }
  }
  if (!b.model.empty()) return bench(b);
  std::printf(
      "| model | scene | params | GFLOPs / sample (fwd) | components (params / GFLOPs) |\n");
  std::printf("| --- | --- | --- | --- | --- |\n");
  ModelConfig vit;
  vit.name = "vit_cls";
  vit.size = "b16";
  print_row("vit_cls/b16", "1 x 224x224", analytic_cost(vit, core::SceneSpec{}));
  for (const char* size : {"tiny", "small", "base", "large", "3b"}) {
    for (const char* backbone : {"vit", "conv"}) {
      ModelConfig cfg;
      cfg.name = "bev";
      cfg.size = size;
      cfg.backbone = backbone;
      const core::SceneSpec scene = benchmark_scene(size);
      print_row(fmt::format("bev/{} ({})", size, backbone), scene_text(scene),
                analytic_cost(cfg, scene));
      if (std::string(size) != "tiny") {
        print_row(fmt::format("bev/{} ({})", size, backbone), scene_text(core::SceneSpec{}),
                  analytic_cost(cfg, core::SceneSpec{}));
      }
    }
  }
  // The ResNet trunks do not scale with the size: tiny and base (BEVDet's 256 x 704 input).
  for (const auto& [size, backbone] : std::vector<std::pair<const char*, const char*>>{
           {"tiny", "resnet50"}, {"base", "resnet50"}, {"base", "resnet101"}}) {
    ModelConfig cfg;
    cfg.name = "bev";
    cfg.size = size;
    cfg.backbone = backbone;
    const core::SceneSpec scene = benchmark_scene(size);
    print_row(fmt::format("bev/{} ({})", size, backbone), scene_text(scene),
              analytic_cost(cfg, scene));
  }
  if (iters > 0) {
    at::set_num_threads(1);
    std::printf(
        "\nbev/tiny forward+backward on 1 CPU thread (median of %d, batch 2, default scene):\n",
        iters);
    for (const char* backbone : {"conv", "vit"}) {
      const Timing t = time_tiny(backbone, iters, 2);
      std::printf("  backbone %-4s: %.3f s wall, %.3f s CPU per sample\n", backbone, t.wall_s,
                  t.cpu_s);
    }
  }
  return 0;
}
