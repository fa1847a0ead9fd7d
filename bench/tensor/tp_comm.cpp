// Bytes each rank sends per training step under tensor parallelism, by layer type, measured (the
// TpGroup's counters over one forward and backward) against the formula, for vit_cls (or bev with
// the ViT backbone) on CPU ranks (mpirun) or one GPU per rank (--backend nccl). One JSON line per
// (sequence_parallel, layer type) from rank 0.
//
// Formula, per step, n = tp, L blocks, R = B T token rows (Rp: R padded to a multiple of n),
// D the width, 4 bytes per element, ring costs (all-reduce 2 (n-1)/n M; all-gather and
// reduce-scatter (n-1)/n M):
//   column (qkv, fc1; 2 L layers)  no SP: backward all-reduce of dX [R, D]      2 (n-1)/n 4 R D
//   each
//                                  SP:    forward all-gather + backward reduce-scatter of [Rp, D]
//                                         2 (n-1)/n 4 Rp D each
//   row (proj, fc2; 2 L layers)    no SP: forward all-reduce of Y [R, D]         2 (n-1)/n 4 R D
//   each
//                                  SP:    forward reduce-scatter + backward all-gather of [Rp, D]
//                                         2 (n-1)/n 4 Rp D each
//                                  + vit_cls's head: backward all-reduce of [B, D]
//   other                          vit_cls's gathered logits [B, C]; SP: entering the region
//                                  (backward all-gather of [Rp, D]), leaving it (forward all-gather
//                                  of [Rp, D]) and the all-reduce of the sequence-parallel
//                                  parameters' gradients (LayerNorm weights and biases: 2 L + 1
//                                  norms x 2 D; row biases: 2 L x D).
// Sequence parallelism sends the same bytes as tensor parallelism alone in the blocks (an
// all-reduce is a reduce-scatter plus an all-gather) and saves activation memory, not traffic.
// Usage: mpirun -np N tp_comm [--model vit_cls|bev] [--size b16|tiny] [--batch B] [--backend
// mpi|nccl]
#include "comm/factory.h"
#include "comm/world.h"
#include "core/log.h"
#include "models/model.h"
#include "models/perception_model.h"
#include "models/vit.h"
#include "parallel/tensor/tensor_parallel.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cstring>
#include <string>

using namespace parallax;
namespace tensor = parallax::parallel::tensor;

int main(int argc, char** argv) {
  std::string model_name = "vit_cls", size = "b16", backend = "mpi";
  int64_t batch = 2;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--model")) model_name = argv[i + 1];
    if (!std::strcmp(argv[i], "--size")) size = argv[i + 1];
    if (!std::strcmp(argv[i], "--backend")) backend = argv[i + 1];
    if (!std::strcmp(argv[i], "--batch")) batch = std::stoll(argv[i + 1]);
  }
  comm::World world;
  core::log::set_level(core::log::Level::kWarn);
  auto comm = comm::make_world_communicator(backend, comm::CommOptions{});
  const c10::Device device = backend == "nccl" ? *world.device() : c10::Device(c10::kCPU);
  const int n = comm->size();
  models::ModelConfig mc;
  mc.name = model_name;
  mc.size = size;
  mc.backbone = "vit";
  const core::SceneSpec scene = models::benchmark_scene("tiny");
  for (const bool sp : {false, true}) {
    auto group = std::make_shared<tensor::TpGroup>(comm, sp);
    at::manual_seed(1);
    auto model = models::build_model(mc, scene, group);
    model->to(device);
    tensor::install_sequence_parallel_hooks(group);
    at::manual_seed(2);
    core::TensorDict b = core::to_device(model->example_batch(batch), device);
    group->traffic() = {};
    model->loss(b, model->forward(b)).total.backward();
    const auto measured = group->traffic();

    // The formula from the model's shape.
    int64_t L = 0, D = 0, T = 0, images = batch, classes = 0;
    if (model_name == "vit_cls") {
      auto probe = models::build_model(mc, scene);  // the single-process shapes
      for (const auto& it : probe->named_parameters()) {
        if (it.key() == "vit.pos_embed") {
          T = it.value().size(1);
          D = it.value().size(2);
        }
        if (it.key() == "head.weight") classes = it.value().size(0);
        if (it.key().find(".attn.qkv.weight") != std::string::npos) ++L;
      }
    } else {
      auto* m = dynamic_cast<models::PerceptionModel*>(model.get());
      const auto& e = m->spec().encoder;
      L = e.vit.depth;
      D = e.vit.dim;
      T = (e.image_h / e.vit.patch) * (e.image_w / e.vit.patch);
      images = batch * m->spec().scene.num_cameras;
    }
    const int64_t R = images * T, Rp = tensor::padded_rows(R, n);
    const auto ring = [n](int64_t bytes, int factor) { return factor * bytes * (n - 1) / n; };
    const int64_t rows = sp ? Rp : R;
    int64_t column = 2 * L * ring(4 * rows * D, 2);
    const int64_t row = 2 * L * ring(4 * rows * D, 2);
    int64_t other = 0;
    if (classes > 0) {
      column += ring(4 * batch * D, 2);       // the head is column-parallel: f's backward
      other += ring(4 * batch * classes, 1);  // and its gathered output
    }
    if (sp) {
      other += 2 * ring(4 * Rp * D, 1);                                    // enter, leave
      other += (2 * L + 1) * 2 * ring(4 * D, 2) + 2 * L * ring(4 * D, 2);  // LayerNorms, row biases
    }
    if (comm->rank() == 0) {
      const std::pair<const char*, std::pair<int64_t, int64_t>> rows_out[] = {
          {"column", {measured.column_bytes, column}},
          {"row", {measured.row_bytes, row}},
          {"other", {measured.other_bytes, other}}};
      for (const auto& [layer, v] : rows_out) {
        std::printf(
            "{\"model\": \"%s/%s\", \"tp\": %d, \"batch\": %lld, \"sequence_parallel\": %s, "
            "\"layer\": \"%s\", "
            "\"measured_bytes\": %lld, \"formula_bytes\": %lld, \"match\": %s}\n",
            model_name.c_str(), size.c_str(), n, static_cast<long long>(batch),
            sp ? "true" : "false", layer, static_cast<long long>(v.first),
            static_cast<long long>(v.second), v.first == v.second ? "true" : "false");
      }
    }
  }
  return 0;
}
