// Bytes per rank of parameters, gradients and optimizer state under ZeRO stages 0, 1, 2 and 3
// (parallel/memory.h, EngineMemory), for a model of the zoo, on CPU ranks (mpirun) or one GPU per
// rank (--backend nccl). One optimizer step per stage (the gradients exist after a backward), then
// one JSON line per stage from rank 0, with the formula's prediction beside the count:
//   stage 0 (DDP)   16 Psi                       (4 params + 4 grads + 8 AdamW moments, fp32)
//   stage 1         4 P + 4 P + 4 P / N + 8 Psi_r (P: padded bucket elements; Psi_r: this rank's)
//   stage 2         4 P + 4 P / N + 8 Psi_r      (transient gradient buckets: only the shard stays)
//   stage 3         4 P / N + 4 P / N + 8 Psi_r  (parameters sharded too, every unit freed)
// With one rank every stage holds 16 Psi (the flat gradient buckets are the shards).
// Usage: mpirun -np N zero_memory [--model vit_cls] [--size b16] [--backend mpi|gloo|nccl]
#include "comm/factory.h"
#include "comm/world.h"
#include "core/log.h"
#include "models/model.h"
#include "models/perception_model.h"
#include "optim/optimizer.h"
#include "optim/param_groups.h"
#include "parallel/build_engine.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cstring>
#include <string>

using namespace parallax;

int main(int argc, char** argv) {
  std::string model_name = "vit_cls", size = "b16", backend = "mpi";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--model")) model_name = argv[i + 1];
    if (!std::strcmp(argv[i], "--size")) size = argv[i + 1];
    if (!std::strcmp(argv[i], "--backend")) backend = argv[i + 1];
  }
  comm::World world;
  core::log::set_level(core::log::Level::kWarn);
  auto comm = comm::make_world_communicator(backend, comm::CommOptions{});
  const c10::Device device = backend == "nccl" ? *world.device() : c10::Device(c10::kCPU);
  models::ModelConfig mc;
  mc.name = model_name;
  mc.size = size;
  const core::SceneSpec scene = models::benchmark_scene("tiny");
  for (int stage : {0, 1, 2, 3}) {
    at::manual_seed(1);
    auto model = models::build_model(mc, scene);
    model->to(device);
    optim::NamedParams named;
    for (const auto& it : model->named_parameters()) named.emplace_back(it.key(), it.value());
    const double psi = static_cast<double>(model->parameter_count());  // before ZeRO-3 shards it
    parallel::Plan plan;
    plan.layout.dp = comm->size();
    plan.zero_stage = stage;
    parallel::ddp::DdpOptions o;
    o.mode = parallel::ddp::BucketMode::kFlat;
    auto engine = parallel::build_engine(
        plan, model, optim::make_param_groups(named, 0.05),
        [](std::vector<optim::ParamGroup> g) {
          return std::make_unique<optim::AdamW>(std::move(g), 0.9, 0.999, 1e-8, true);
        },
        comm, o, model->units());
    model->set_unit_hooks(engine->unit_hooks());
    at::manual_seed(2);
    core::TensorDict batch = model->example_batch(1);
    for (auto& [k, v] : batch) v = v.to(device);
    engine->forward_backward(
        1,
        [&](int) {
          const auto pred = model->forward(batch);
          return model->loss(batch, pred).total;
        },
        true);
    engine->update(1e-4);
    const parallel::EngineMemory m = engine->memory();
    model->set_unit_hooks(nullptr);
    const int n = comm->size();
    const double formula = stage == 0 || n == 1 ? 16.0
                           : stage == 1         ? 8.0 + 12.0 / n
                           : stage == 2         ? 4.0 + 12.0 / n
                                                : 16.0 / n;
    if (world.rank() == 0) {
      std::printf("%s\n", fmt::format("{{\"model\": \"{}/{}\", \"ranks\": {}, \"stage\": {}, "
                                      "\"params_gb\": {:.4f}, \"grads_gb\": {:.4f}, "
                                      "\"optimizer_gb\": {:.4f}, \"total_gb\": {:.4f}, "
                                      "\"bytes_per_param\": {:.3f}, \"formula_bytes_per_param\": "
                                      "{:.3f}}}",
                                      model_name, size, n, stage, m.params / 1e9, m.grads / 1e9,
                                      m.optimizer / 1e9, m.total() / 1e9, m.total() / psi, formula)
                              .c_str());
      std::fflush(stdout);
    }
  }
  return 0;
}
