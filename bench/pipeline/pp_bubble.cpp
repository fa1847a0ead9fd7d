// The pipeline bubble measured on CPU ranks (mpirun, one thread per rank), per schedule, against
// the formula: an mlp of S equal layers (width W, S = pp x virtual stages, one unit per stage) is
// trained by the pipeline engine on m micro-batches of R rows; per step, each rank's bubble is
// (step wall time - its compute time) / its compute time (the engine times its F, B and W passes).
// Reported (medians over the timed steps): bubble_mean_rank, the mean over ranks, and
// bubble_bottleneck, the same for the rank with the most compute (the critical path; the formula's
// quantity). The stages are not equal: the first computes no input gradient (its input is the
// data), so its backward is about F where the others' is 2 F, and it waits more. The formula
// assumes B = 2 F everywhere and free communication; bubble_plan is the plan simulated that way.
// step_ms: the median wall time of the forward-backward (what the schedules compete on: zb's W
// re-walks the stage's graph, so its compute is larger than the others').
// Usage: mpirun -np P pp_bubble [--micro M] [--width W] [--rows R] [--steps N]
//        [--schedules gpipe,1f1b,interleaved,zb] [--virtual V]
#include "core/log.h"
#include "core/timer.h"
#include "models/mlp.h"
#include "optim/optimizer.h"
#include "optim/param_groups.h"
#include "parallel/build_engine.h"
#include "parallel/comm/factory.h"
#include "parallel/comm/world.h"
#include "parallel/pipeline/pipeline_engine.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <string>

using namespace parallax;
namespace par = parallax::parallel;
namespace pl = parallax::parallel::pipeline;

int main(int argc, char** argv) {
  int micro = 8, steps = 8, virt = 2;
  int64_t width = 1024, rows = 64;
  std::string schedules = "gpipe,1f1b,interleaved,zb";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--micro")) micro = std::stoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--width")) width = std::stoll(argv[i + 1]);
    if (!std::strcmp(argv[i], "--rows")) rows = std::stoll(argv[i + 1]);
    if (!std::strcmp(argv[i], "--steps")) steps = std::stoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--schedules")) schedules = argv[i + 1];
    if (!std::strcmp(argv[i], "--virtual")) virt = std::stoi(argv[i + 1]);
  }
  at::set_num_threads(1);
  par::comm::World world;
  core::log::set_level(core::log::Level::kWarn);
  auto comm = par::comm::make_world_communicator("mpi", par::comm::CommOptions{});
  auto self = comm->split(comm->rank(), 0, "self");
  const int p = comm->size();
  std::stringstream list(schedules);
  std::string kind;
  while (std::getline(list, kind, ',')) {
    const int v = kind == "interleaved" ? virt : 1;
    const int stages = p * v;
    at::manual_seed(1);
    auto model = std::make_shared<models::MlpModel>(width, width, width, stages - 1);
    const std::vector<models::Unit> units = model->units();
    pl::PipelineOptions po;
    po.schedule = kind;
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
    for (int i = 0; i < micro; ++i) batches.push_back(model->example_batch(rows));
    par::StageFns fns;
    fns.begin = [&](int i) { return model->chain_begin(batches[i]); };
    fns.run = [&](int i, int first, int last, const std::vector<at::Tensor>& in) {
      return model->run_chain(first, last, batches[i], in);
    };
    fns.finish = [&](int i, const std::vector<at::Tensor>& out) {
      return model->loss(batches[i], model->chain_end(batches[i], out)).total / micro;
    };
    std::vector<double> bubbles, bottleneck, walls;
    for (int step = 0; step < steps + 2; ++step) {
      comm->barrier();
      core::Stopwatch clock;
      engine.forward_backward_stages(micro, fns, false);
      comm->barrier();
      const double wall = clock.elapsed_ms();
      engine.step(0.0);
      engine.zero_grad();
      at::Tensor b = at::full({1}, (wall - engine.last_compute_ms()) / engine.last_compute_ms(),
                              at::kDouble);
      comm->all_reduce(b, par::comm::ReduceOp::kAvg);
      at::Tensor c = at::full({1}, engine.last_compute_ms(), at::kDouble);
      comm->all_reduce(c, par::comm::ReduceOp::kMax);
      if (step >= 2) {
        bubbles.push_back(b.item<double>());
        bottleneck.push_back((wall - c.item<double>()) / c.item<double>());
        walls.push_back(wall);
      }
    }
    std::sort(bubbles.begin(), bubbles.end());
    std::sort(bottleneck.begin(), bottleneck.end());
    std::sort(walls.begin(), walls.end());
    if (comm->rank() == 0) {
      fmt::print(
          "{{\"schedule\": \"{}\", \"pp\": {}, \"virtual_stages\": {}, \"micro_batches\": {}, "
          "\"width\": {}, \"rows\": {}, \"bubble_mean_rank\": {:.4f}, \"bubble_bottleneck\": {:.4f}, "
          "\"bubble_formula\": {:.4f}, \"bubble_plan\": {:.4f}, \"step_ms\": {:.2f}}}\n",
          kind, p, v, micro, width, rows, bubbles[bubbles.size() / 2],
          bottleneck[bottleneck.size() / 2],
          pl::formula_bubble(engine.schedule()), pl::simulate(engine.schedule()).bubble(),
          walls[walls.size() / 2]);
    }
  }
  return 0;
}
