// The pipeline bubble measured on CPU ranks (mpirun, one thread per rank) or on one GPU per rank
// (--device cuda), per schedule, against the formula: an mlp of S equal layers (width W, S = pp x
// virtual stages, one unit per stage) is trained by the pipeline engine on m micro-batches of R
// rows; per step, each rank's bubble is (step wall time - its compute time) / its compute time (the
// engine times its F, B and W passes).
// Reported (medians over the timed steps): bubble_mean_rank, the mean over ranks, and
// bubble_bottleneck, the same for the rank with the most compute (the critical path; the formula's
// quantity). The stages are not equal: the first computes no input gradient (its input is the
// data), so its backward is about F where the others' is 2 F, and it waits more. The formula
// assumes B = 2 F everywhere and free communication; bubble_plan is the plan simulated that way.
// step_ms: the median wall time of the forward-backward (what the schedules compete on: zb's W
// re-walks the stage's graph, so its compute is larger than the others').
//
// bubble_ideal: the definition bench/pipeline/torch_pp_bubble.py shares, and the one that means
// something on a GPU, where the engine's compute clock is host time around queued kernels (so
// bubble_mean_rank and bubble_bottleneck are not the GPU's): fb_ms is the median time of one
// forward + backward of a middle stage (Linear + GELU, input gradient included) on one
// micro-batch, device-synchronised, the max over ranks; ideal_ms = m v fb_ms; bubble_ideal =
// (step_ms - ideal_ms) / ideal_ms.
//
// --device cuda: the world on NCCL, the model and data on this rank's GPU (World::device()), fp32
// with TF32 off; the step's clock is read after a device synchronisation. Needs a build with NCCL.
// Usage: mpirun -np P pp_bubble [--micro M] [--width W] [--rows R] [--steps N]
//        [--schedules gpipe,1f1b,interleaved,zb] [--virtual V] [--device cpu|cuda]
#include "comm/factory.h"
#include "comm/world.h"
#include "core/error.h"
#include "core/log.h"
#include "core/tensor_dict.h"
#include "core/timer.h"
#include "models/mlp.h"
#include "optim/optimizer.h"
#include "optim/param_groups.h"
#include "parallel/build_engine.h"
#include "parallel/pipeline/pipeline_engine.h"
#include "parallel/pipeline/schedule_check.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#ifdef PARALLAX_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#endif

using namespace parallax;
namespace par = parallax::parallel;
namespace pl = parallax::parallel::pipeline;

namespace {

// Waits until the work queued on `device` is done, so a host clock read next covers it. Nothing to
// wait for on the CPU, where ops run synchronously.
void sync_device(const c10::Device& device) {
#ifdef PARALLAX_WITH_CUDA
  if (device.is_cuda()) {
    c10::cuda::CUDAGuard guard(device);
    c10::cuda::device_synchronize();
  }
#endif
}

// Median ms of one forward + backward of a middle stage (Linear + GELU, with its input's gradient)
// on one micro-batch of `rows` rows: the unit of the ideal step (torch_pp_bubble.py measures the
// same). Draws from the generator: call it after the model and the batches.
double stage_fb_ms(int64_t width, int64_t rows, const c10::Device& device) {
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
  at::Tensor w = (at::randn({width, width}, opts) / std::sqrt(static_cast<double>(width)));
  w.requires_grad_(true);
  at::Tensor b = at::zeros({width}, opts).requires_grad_(true);
  at::Tensor x = at::randn({rows, width}, opts).requires_grad_(true);
  const at::Tensor g = at::randn({rows, width}, opts);
  constexpr int kWarmup = 3, kReps = 20;
  std::vector<double> ms;
  for (int i = 0; i < kWarmup + kReps; ++i) {
    sync_device(device);
    core::Stopwatch clock;
    at::gelu(at::linear(x, w, b)).backward(g);
    sync_device(device);
    if (i >= kWarmup) ms.push_back(clock.elapsed_ms());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

int run(int argc, char** argv) {
  int micro = 8, steps = 8, virt = 2;
  int64_t width = 1024, rows = 64;
  std::string schedules = "gpipe,1f1b,interleaved,zb", device_name = "cpu";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--micro")) micro = std::stoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--width")) width = std::stoll(argv[i + 1]);
    if (!std::strcmp(argv[i], "--rows")) rows = std::stoll(argv[i + 1]);
    if (!std::strcmp(argv[i], "--steps")) steps = std::stoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--schedules")) schedules = argv[i + 1];
    if (!std::strcmp(argv[i], "--virtual")) virt = std::stoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--device")) device_name = argv[i + 1];
  }
  PARALLAX_CHECK(device_name == "cpu" || device_name == "cuda", UsageError,
                 "--device {} (cpu or cuda)", device_name);
  const bool cuda = device_name == "cuda";
#ifndef PARALLAX_WITH_CUDA
  PARALLAX_CHECK(!cuda, UsageError, "--device cuda needs a build with NCCL (PARALLAX_WITH_NCCL)");
#endif
  at::set_num_threads(1);
  parallax::comm::World world;
  core::log::set_level(core::log::Level::kWarn);
  PARALLAX_CHECK(!cuda || world.device().has_value(), UsageError,
                 "--device cuda on rank {}, which sees no GPU", world.rank());
  const c10::Device device = cuda ? *world.device() : c10::Device(c10::kCPU);
  if (cuda) {
    // fp32 as on the CPU (LibTorch's default; said here so a changed default cannot move it).
    at::globalContext().setAllowTF32CuBLAS(false);
    at::globalContext().setAllowTF32CuDNN(false);
  }
  auto comm =
      parallax::comm::make_world_communicator(cuda ? "nccl" : "mpi", parallax::comm::CommOptions{});
  auto self = comm->split(comm->rank(), 0, "self");
  const auto scalar = [&](double value) {
    return at::full({1}, value, at::TensorOptions().dtype(at::kDouble).device(device));
  };
  const int p = comm->size();
  std::stringstream list(schedules);
  std::string kind;
  while (std::getline(list, kind, ',')) {
    const int v = kind == "interleaved" ? virt : 1;
    const int stages = p * v;
    at::manual_seed(1);
    auto model = std::make_shared<models::MlpModel>(width, width, width, stages - 1);
    if (cuda) model->to(device);  // before the engine freezes and releases the foreign stages
    const std::vector<models::Unit> units = model->units();
    pl::PipelineOptions po;
    po.schedule = parallel::pipeline::parse_schedule_kind(kind);
    po.virtual_stages = v;
    par::Plan plan;
    par::ddp::DdpOptions o;
    pl::PipelineEngine engine(model, units, std::vector<double>(units.size(), 1.0), comm, micro, po,
                              [&]() -> std::unique_ptr<par::Engine> {
                                optim::NamedParams named;
                                for (const auto& it : model->named_parameters())
                                  named.emplace_back(it.key(), it.value());
                                return par::build_engine(
                                    plan, model, optim::make_param_groups(named, 0.0),
                                    [](std::vector<optim::ParamGroup> g) {
                                      return std::make_unique<optim::Sgd>(std::move(g), 0.9, false,
                                                                          true);
                                    },
                                    self, o);
                              });
    std::vector<core::TensorDict> batches;
    for (int i = 0; i < micro; ++i) {
      batches.push_back(model->example_batch(rows));
      if (cuda) batches.back() = core::to_device(batches.back(), device, /*non_blocking=*/false);
    }
    parallax::parallel::pipeline::StageFns fns;
    fns.begin = [&](int i) { return model->chain_begin(batches[i]); };
    fns.run = [&](int i, int first, int last, const std::vector<at::Tensor>& in) {
      return model->run_chain(first, last, batches[i], in);
    };
    fns.finish = [&](int i, const std::vector<at::Tensor>& out) {
      return model->loss(batches[i], model->chain_end(batches[i], out)).total / micro;
    };
    at::Tensor fb = scalar(stage_fb_ms(width, rows, device));
    comm->all_reduce(fb, parallax::comm::ReduceOp::kMax);
    const double fb_ms = fb.item<double>();
    std::vector<double> bubbles, bottleneck, walls;
    for (int step = 0; step < steps + 2; ++step) {
      sync_device(device);
      comm->barrier();
      core::Stopwatch clock;
      engine.forward_backward_stages(fns, false);
      sync_device(device);
      comm->barrier();
      sync_device(device);
      const double wall = clock.elapsed_ms();
      engine.update(0.0);
      engine.zero_grad();
      at::Tensor b = scalar((wall - engine.last_compute_ms()) / engine.last_compute_ms());
      comm->all_reduce(b, parallax::comm::ReduceOp::kAvg);
      at::Tensor c = scalar(engine.last_compute_ms());
      comm->all_reduce(c, parallax::comm::ReduceOp::kMax);
      if (step >= 2) {
        bubbles.push_back(b.item<double>());
        bottleneck.push_back((wall - c.item<double>()) / c.item<double>());
        walls.push_back(wall);
      }
    }
    const double step_ms = median(walls);
    const double ideal_ms = micro * v * fb_ms;
    if (comm->rank() == 0) {
      fmt::print(
          "{{\"schedule\": \"{}\", \"pp\": {}, \"virtual_stages\": {}, \"micro_batches\": {}, "
          "\"width\": {}, \"rows\": {}, \"bubble_mean_rank\": {:.4f}, "
          "\"bubble_bottleneck\": {:.4f}, \"bubble_formula\": {:.4f}, \"bubble_plan\": {:.4f}, "
          "\"step_ms\": {:.2f}, \"device\": \"{}\", \"fb_ms\": {:.4f}, \"ideal_ms\": {:.2f}, "
          "\"bubble_ideal\": {:.4f}, \"impl\": \"parallax\"}}\n",
          kind, p, v, micro, width, rows, median(bubbles), median(bottleneck),
          pl::formula_bubble(engine.schedule()), pl::simulate(engine.schedule()).bubble(), step_ms,
          device_name, fb_ms, ideal_ms, (step_ms - ideal_ms) / ideal_ms);
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pp_bubble: error: %s\n", e.what());
    return 1;
  }
}
