// The pipeline engine (parallel/pipeline/pipeline_engine.h) against the single-process model on
// the same micro-batches and initial weights, under mpirun (MPI on CPU tensors): every schedule
// (gpipe, 1f1b, interleaved, zb) at pp = world for vit_cls and bev with the ViT backbone; and, on
// 4 and 8 ranks, dp x pp with DDP and ZeRO-1/2 and dp x tp x pp. fp32, TF32 off.
//
// Tolerances (tests/TOLERANCES.md, "pipeline parallel"):
// - pp alone: exact. Each stage runs the same units in the same order on the same tensors; the
//   gradient that crosses a stage boundary is the one autograd would have passed there, and every
//   schedule runs each stage's backwards in micro-batch order, so the accumulation order of every
//   parameter gradient is the single process's. Each backward's gradient G reaches the parameters
//   as the gradient of <p, G> (exactly G) or of an empty slice (exact zeros).
// - with dp: the single process averages the per-sample gradients of the whole micro-batch in
//   one sum, DDP averages the dp halves' means: both are within gamma_n sum|g_i| of the exact mean
//   (n <= 4 samples), so they differ by at most 2 gamma_4 max|g| per step: with SGD (lr 0.05,
//   momentum 0.9: at most 1 / (1 - 0.9) = 10 x the update) over 2 steps, parameters agree within
//   2 * 10 * lr * 2 gamma_4 |g|max <= 1e-6 for |g| <= 1; we allow 1e-5 (1 + |p|). ZeRO-2 sums the
//   micro-batches' reduce-scattered gradients in another order: the same bound.
// - with tp: tests/parallel/tensor_parallel_test.cpp's GEMM-order bound (kGrad there), times the
//   same SGD factor.
#include "parallel/pipeline/pipeline_engine.h"

#include "models/model.h"
#include "optim/grad_utils.h"
#include "optim/optimizer.h"
#include "parallel/build_engine.h"
#include "parallel/comm/factory.h"
#include "parallel/comm/topology.h"
#include "parallel/comm/world.h"
#include "parallel/tensor/tensor_parallel.h"
#include "tests/common/no_tf32.h"
#include "tests/common/tolerance.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

using namespace parallax;
namespace comm = parallax::parallel::comm;
namespace par = parallax::parallel;
namespace pl = parallax::parallel::pipeline;
namespace tensor = parallax::parallel::tensor;
namespace tol = parallax::testing;

namespace {

constexpr double kGamma4 = 4 * 6e-8;
constexpr double kDpTol = 1e-5;
constexpr double kTpTol = 10 * 0.05 * 2 * (2 * 4 * 2 * 2 * 2.3e-5);  // SGD factor x lr x steps x kGrad

std::vector<optim::ParamGroup> groups_of(torch::nn::Module& m) {
  optim::NamedParams named;
  for (const auto& it : m.named_parameters()) named.emplace_back(it.key(), it.value());
  return optim::make_param_groups(named, 0.0);
}

par::OptimizerFactory sgd() {
  return [](std::vector<optim::ParamGroup> g) {
    return std::make_unique<optim::Sgd>(std::move(g), 0.9, false, true);
  };
}

models::ModelConfig vit_cls_config() {
  models::ModelConfig cfg;
  cfg.name = "vit_cls";
  cfg.size = "tiny";
  cfg.num_classes = 8;
  return cfg;
}

models::ModelConfig bev_vit_config() {
  models::ModelConfig cfg;
  cfg.name = "bev";
  cfg.size = "tiny";
  cfg.backbone = "vit";
  return cfg;
}

// This rank's slice of `full` for a tp-split parameter (tensor_parallel_test.cpp's local_part).
at::Tensor local_part(const at::Tensor& full, const tensor::ParamLayout& layout,
                      const at::Tensor& local) {
  std::vector<at::Tensor> parts;
  for (const auto& box : tensor::split_boxes(local, layout)) {
    at::Tensor p = full;
    for (int64_t d = 0; d < box.local.dim(); ++d)
      p = p.narrow(d, box.offsets[static_cast<std::size_t>(d)], box.local.size(d));
    parts.push_back(p);
  }
  return at::cat(parts, layout.dim);
}

struct Case {
  models::ModelConfig model;
  int dp = 1, tp = 1;
  std::string schedule = "1f1b";
  int virtual_stages = 1;
  int zero = 0;
  int micro = 4;
  int64_t rows = 1;  // samples per micro-batch per dp rank
  int steps = 2;
};

// Trains `c` for c.steps SGD steps as a pipeline (pp = world / (dp tp)) and as one process on the
// same micro-batches; compares every step's loss and every parameter after the last step.
void compare(const comm::CommPtr& world, const comm::CommPtr& self, const Case& c) {
  const int n = world->size();
  comm::Topology topo(world, comm::resolve_layout(n, c.dp, c.tp, n / (c.dp * c.tp)));
  ASSERT_GE(topo.layout().pp, 2) << "the case needs a pipeline";
  const int dp = topo.layout().dp;
  tensor::TpPtr group;
  if (c.tp > 1) group = std::make_shared<tensor::TpGroup>(topo.tp(), false);

  at::manual_seed(7);
  auto dense = models::build_model(c.model, core::SceneSpec{});
  at::manual_seed(7);
  auto split = group ? models::build_model(c.model, core::SceneSpec{}, group)
                     : models::build_model(c.model, core::SceneSpec{});
  const auto layouts = tensor::param_layouts(*split);
  std::vector<core::TensorDict> whole, mine;
  for (int i = 0; i < c.micro; ++i) {
    at::manual_seed(100 + i);
    whole.push_back(dense->example_batch(c.rows * dp));
    core::TensorDict part;
    for (const auto& [k, v] : whole.back()) part[k] = v.narrow(0, topo.coord().dp * c.rows, c.rows);
    mine.push_back(part);
  }

  const std::vector<models::Unit> units = split->units();
  par::Plan plan;
  plan.layout = topo.layout();
  plan.zero_stage = c.zero;
  par::ddp::DdpOptions o;
  o.mode = par::ddp::BucketMode::kFlat;
  par::TensorParallelInfo info{topo.tp(), {}};
  for (const auto& [name, l] : layouts) info.sharded.insert(name);
  pl::PipelineOptions po;
  po.schedule = c.schedule;
  po.virtual_stages = c.virtual_stages;
  pl::PipelineEngine engine(split, units, std::vector<double>(units.size(), 1.0), topo.pp(),
                              c.micro, po, [&]() -> std::unique_ptr<par::Engine> {
                                return par::build_engine(plan, split, groups_of(*split), sgd(),
                                                         topo.dp(), o, units, info);
                              });
  par::Plan one;
  auto reference = par::build_engine(one, dense, groups_of(*dense), sgd(), self, o);

  std::vector<core::TensorDict> side(mine);
  for (auto& b : side) b.erase("images");
  par::StageFns fns;
  at::Tensor pipe_loss;
  fns.begin = [&](int i) { return split->chain_begin(mine[i]); };
  fns.run = [&](int i, int first, int last, const std::vector<at::Tensor>& in) {
    return split->run_chain(first, last, first == 0 ? mine[i] : side[i], in);
  };
  fns.finish = [&](int i, const std::vector<at::Tensor>& out) {
    at::Tensor l = split->loss(side[i], split->chain_end(side[i], out)).total / c.micro;
    pipe_loss = pipe_loss.defined() ? pipe_loss + l.detach() : l.detach();
    return l;
  };
  const double lr = 0.05;
  const bool last_stage = topo.coord().pp == topo.layout().pp - 1;
  for (int step = 0; step < c.steps; ++step) {
    pipe_loss = at::Tensor();
    engine.forward_backward_stages(c.micro, fns, false);
    at::Tensor ref_loss;
    reference->forward_backward(
        c.micro,
        [&](int i) {
          at::Tensor l = dense->loss(whole[i], dense->forward(whole[i])).total / c.micro;
          ref_loss = ref_loss.defined() ? ref_loss + l.detach() : l.detach();
          return l;
        },
        false);
    // The loss exists on the last stage only.
    EXPECT_EQ(pipe_loss.defined(), last_stage);
    if (last_stage) {
      at::Tensor l = pipe_loss.reshape({1}).clone();
      if (dp > 1) topo.dp()->all_reduce(l, comm::ReduceOp::kAvg);
      if (dp == 1 && c.tp == 1) {
        EXPECT_TRUE(at::equal(l, ref_loss.reshape({1}))) << "step " << step << ": " << l.item<double>()
                                                        << " vs " << ref_loss.item<double>();
      } else {
        EXPECT_TRUE(tol::within(l, ref_loss.reshape({1}), 1e-5 * (1 + ref_loss.abs().item<double>())))
            << "step " << step;
      }
    }
    // The global gradient norm spans every stage (each parameter counted once).
    const at::Tensor norm = optim::clip_grad_norm(engine.grads(), 0);
    const at::Tensor ref_norm = optim::clip_grad_norm(reference->grads(), 0);
    EXPECT_TRUE(tol::within(norm, ref_norm, 1e-5 * ref_norm.item<double>()))
        << "grad norm " << norm.item<double>() << " vs " << ref_norm.item<double>();
    engine.step(lr);
    reference->step(lr);
    engine.zero_grad();
    reference->zero_grad();
  }
  par::FullParams full(engine);  // every stage's parameters on every rank
  const auto ref = dense->named_parameters();
  for (const auto& it : split->named_parameters()) {
    const auto lay = layouts.find(it.key());
    const at::Tensor want =
        lay == layouts.end() ? ref[it.key()] : local_part(ref[it.key()], lay->second, it.value());
    ASSERT_EQ(it.value().sizes(), want.sizes()) << it.key();
    if (dp == 1 && c.tp == 1) {
      EXPECT_TRUE(at::equal(it.value(), want)) << it.key() << " after " << c.steps << " steps";
    } else {
      const double t = (c.tp > 1 ? kTpTol : kDpTol) * (1 + want.abs().max().item<double>());
      EXPECT_TRUE(tol::within(it.value(), want, t)) << it.key();
    }
  }
  (void)kGamma4;
}

class PipelineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    comm::CommOptions o;
    o.timeout_s = 120;
    world_ = comm::make_world_communicator("mpi", o);
    self_ = world_->split(world_->rank(), 0, "self");
  }
  parallax::testing::NoTf32 no_tf32_;
  comm::CommPtr world_, self_;
};

}  // namespace

TEST_F(PipelineTest, VitClsEverySchedule) {
  if (world_->size() > 4) GTEST_SKIP() << "pp = world needs at most 4 ranks (4 units)";
  for (const char* s : {"gpipe", "1f1b", "zb"}) {
    SCOPED_TRACE(s);
    Case c{vit_cls_config()};
    c.schedule = s;
    compare(world_, self_, c);
  }
  if (world_->size() == 2) {
    SCOPED_TRACE("interleaved x2");
    Case c{vit_cls_config()};
    c.schedule = "interleaved";
    c.virtual_stages = 2;
    compare(world_, self_, c);
  }
}

TEST_F(PipelineTest, FewerMicroBatchesThanStagesRun) {
  if (world_->size() > 4) GTEST_SKIP();
  Case c{vit_cls_config()};
  c.micro = 1;  // one micro-batch over pp stages: all bubble, but it runs and is exact
  compare(world_, self_, c);
}

TEST_F(PipelineTest, BevWithVitBackboneEverySchedule) {
  if (world_->size() > 4) GTEST_SKIP();
  for (const char* s : {"1f1b", "gpipe", "zb"}) {
    SCOPED_TRACE(s);
    Case c{bev_vit_config()};
    c.schedule = s;
    c.steps = 2;
    compare(world_, self_, c);
  }
  SCOPED_TRACE("interleaved x2");
  Case c{bev_vit_config()};
  c.schedule = "interleaved";
  c.virtual_stages = 2;
  c.micro = world_->size() * 2;
  compare(world_, self_, c);
}

TEST_F(PipelineTest, DataParallelTimesPipelineWithDdpAndZero12) {
  if (world_->size() != 4) GTEST_SKIP() << "dp 2 x pp 2 runs on 4 ranks";
  for (int zero : {0, 1, 2}) {
    SCOPED_TRACE(zero);
    Case c{vit_cls_config()};
    c.dp = 2;
    c.zero = zero;
    compare(world_, self_, c);
  }
  // ZeRO-2 under zb (the W passes are the micro-steps) and interleaved (two chunks per rank).
  for (const char* s : {"zb", "interleaved"}) {
    SCOPED_TRACE(s);
    Case c{vit_cls_config()};
    c.dp = 2;
    c.zero = 2;
    c.schedule = s;
    if (std::string(s) == "interleaved") c.virtual_stages = 2;
    compare(world_, self_, c);
  }
}

TEST_F(PipelineTest, DataTensorPipeline3D) {
  if (world_->size() != 8) GTEST_SKIP() << "dp 2 x tp 2 x pp 2 runs on 8 ranks";
  Case c{vit_cls_config()};
  c.dp = 2;
  c.tp = 2;
  c.steps = 2;
  compare(world_, self_, c);
}
