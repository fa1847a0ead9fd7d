// Megatron tensor parallelism and sequence parallelism (parallel/tensor/tensor_parallel.h) against
// the single-process model on the same data and initial weights, under mpirun with 2 and 4 ranks
// (MPI on CPU tensors): the layers, the fused-qkv split, vit_cls and bev (ViT backbone) with and
// without sequence parallelism, dp x tp with DDP and ZeRO-2, and the sequence-parallel LayerNorm
// gradients. fp32, TF32 off.
//
// Tolerances (tests/TOLERANCES.md, "tensor parallel"). The split model computes the same sums as
// the single-process one, except that (a) a row-parallel layer sums its K inputs as tp partial
// sums of K/tp terms added by the all-reduce (or reduce-scatter), and (b) the gradient of a
// column-parallel layer's input is the sum of tp partial products. Each such dot product is within
// gamma_K * sum |a_i b_i| of the exact one in either order, so the two differ by at most
// 2 gamma_K S, S = sum |a_i b_i| <= |a| |b| (K <= 384 here: gamma_384 = 2.3e-5). The forward of a
// block adds up 4 such GEMMs and the LayerNorms normalise the activations to O(1), so the
// outputs (logits of magnitude ~1) agree within a few 1e-5 absolute; we allow 4 GEMMs x 2 blocks x
// 2 gamma_384 x scale, scale = 1 + |ref|. Gradients go through the same GEMMs twice (backward):
// bound 2x that, relative to the largest gradient of the tensor. Trajectories are compared under
// SGD with momentum beta = 0.9 only (tests/TOLERANCES.md, "Equivalence tests"; AdamW's normalised
// update turns a rounding difference in a near-zero gradient into a full step): a step's gradient
// difference enters that step's update and the later ones with weights lr beta^k, lr / (1 - beta)
// = 10 lr in all, so the parameters after T steps differ by at most sum_t 10 lr kGrad max|g_t| per
// element, g_t the tensor's gradient at step t -- to first order: the curvature's feedback of the
// parameters' difference into later gradients (lr H dx, below dx for a stable step) is left out,
// and the observed differences are below 5e-2 of the bound (printed as "tolerance:" lines).
#include "parallel/tensor/tensor_parallel.h"

#include "comm/factory.h"
#include "comm/topology.h"
#include "comm/world.h"
#include "models/model.h"
#include "models/perception_model.h"
#include "models/vit.h"
#include "optim/grad_utils.h"
#include "optim/optimizer.h"
#include "parallel/build_engine.h"
#include "tests/common/model_parallel.h"
#include "tests/common/no_tf32.h"
#include "tests/common/tolerance.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>

using namespace parallax;
namespace comm = parallax::comm;
namespace par = parallax::parallel;
namespace tensor = parallax::parallel::tensor;
namespace tol = parallax::testing;

namespace {

using parallax::testing::bev_vit_config;
using parallax::testing::groups_of;
using parallax::testing::local_part;
using parallax::testing::sgd;
using parallax::testing::vit_cls_config;

std::string test_backend() {
  const char* b = std::getenv("PARALLAX_TEST_BACKEND");
  return b && *b ? b : "mpi";
}

c10::Device test_device() {
  return test_backend() == "nccl" ? *comm::World::current().device() : c10::Device(c10::kCPU);
}

constexpr double kGamma = 2.3e-5;                // gamma_384 in fp32 (the widest K of these models)
constexpr double kForward = 4 * 2 * 2 * kGamma;  // 4 GEMMs per block, 2 blocks, 2 orders
constexpr double kGrad = 2 * kForward;

// What the split model's tensor `name` should hold: `full` sliced by its layout, or whole.
at::Tensor expected(const std::map<std::string, tensor::ParamLayout>& layouts,
                    const std::string& name, const at::Tensor& full, const at::Tensor& local) {
  const auto it = layouts.find(name);
  return it == layouts.end() ? full : local_part(full, it->second, local);
}

class TensorParallelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    comm::CommOptions o;
    o.timeout_s = 120;
    world_ = comm::make_world_communicator(test_backend(), o);
    rank_ = world_->rank();
    n_ = world_->size();
    self_ = world_->split(rank_, 0, "self");
  }

  // The topology of dp x tp over the world.
  std::unique_ptr<comm::Topology> topology(int tp) const {
    return std::make_unique<comm::Topology>(world_, comm::resolve_layout(n_, 0, tp, 1));
  }

  parallax::testing::NoTf32 no_tf32_;
  comm::CommPtr world_, self_;
  int rank_ = 0, n_ = 1;
};

// Which test cases this world size runs: tp = world (np2: tp 2; np4: tp 4).
int tp_of_world(int n) {
  return n;
}

// One run of `cfg` for `steps` SGD steps on a fixed batch of `rows` samples per dp rank: the
// split model (tp = world / dp, with or without sequence parallelism, DDP or ZeRO over dp) and the
// single-process model on the whole batch, compared after the first backward (loss, gradients)
// and after the last step (parameters).
void compare_with_single_process(const comm::CommPtr& world, const comm::CommPtr& self,
                                 const models::ModelConfig& cfg, int tp, bool sp, int zero,
                                 int64_t rows, int steps) {
  const int n = world->size();
  comm::Topology topo(world, comm::resolve_layout(n, 0, tp, 1));
  const int dp = topo.layout().dp;
  auto group = std::make_shared<tensor::TpGroup>(topo.tp(), sp);

  at::manual_seed(7);
  auto dense = models::build_model(cfg, core::SceneSpec{});
  at::manual_seed(7);
  auto split = models::build_model(cfg, core::SceneSpec{}, group);
  const auto layouts = tensor::param_layouts(*split);
  ASSERT_FALSE(layouts.empty());
  dense->to(test_device());
  split->to(test_device());
  // The split layers hold exactly their slices of the single-process initial weights.
  const auto dense_params = dense->named_parameters();
  for (const auto& it : split->named_parameters()) {
    ASSERT_TRUE(
        at::equal(it.value(), expected(layouts, it.key(), dense_params[it.key()], it.value())))
        << it.key();
  }

  at::manual_seed(99);
  const core::TensorDict batch = core::to_device(dense->example_batch(rows * dp), test_device());
  core::TensorDict mine;
  for (const auto& [k, v] : batch) mine[k] = v.narrow(0, topo.coord().dp * rows, rows);

  par::Plan plan;
  plan.layout = topo.layout();
  plan.zero_stage = zero;
  plan.sequence_parallel = sp;
  par::ddp::DdpOptions o;
  o.mode = par::ddp::BucketMode::kFlat;
  par::TensorParallelInfo info{topo.tp(), {}};
  info.layouts = layouts;
  tensor::install_sequence_parallel_hooks(group);
  auto split_engine =
      par::build_engine(plan, split, groups_of(*split), sgd(), topo.dp(), o, split->units(), info);
  split->set_unit_hooks(split_engine->unit_hooks());  // ZeRO-3 gathers and frees per unit
  par::Plan one;
  auto dense_engine = par::build_engine(one, dense, groups_of(*dense), sgd(), self, o);

  const double lr = 0.05;
  std::map<std::string, double> moved;  // the parameters' bound after the steps so far (above)
  for (int step = 0; step < steps; ++step) {
    at::Tensor loss_split, loss_dense;
    split_engine->forward_backward(
        1,
        [&](int) {
          loss_split = split->loss(mine, split->forward(mine)).total;
          return loss_split;
        },
        false);
    dense_engine->forward_backward(
        1,
        [&](int) {
          loss_dense = dense->loss(batch, dense->forward(batch)).total;
          return loss_dense;
        },
        false);
    if (step == 0) {
      // The mean loss over the dp ranks' halves is the whole batch's mean.
      at::Tensor l = loss_split.detach().reshape({1}).clone();
      if (dp > 1) topo.dp()->all_reduce(l, comm::ReduceOp::kAvg);
      EXPECT_TRUE(tol::within(l, loss_dense.detach().reshape({1}),
                              kForward * (1 + loss_dense.abs().item<double>())))
          << "loss";
      // Gradients (ZeRO reduces only into shards: compare through the global norm instead).
      const auto dense_grads = dense->named_parameters();
      if (zero == 0) {
        for (const auto& it : split->named_parameters()) {
          const at::Tensor want =
              expected(layouts, it.key(), dense_grads[it.key()].grad(), it.value().grad());
          const double scale = want.abs().max().item<double>() + 1e-6;
          EXPECT_TRUE(tol::within(it.value().grad(), want, kGrad * scale)) << it.key();
        }
      }
      // Global-norm clipping counts every element once (tp-sharded summed, replicated once).
      const at::Tensor norm_split = optim::clip_grad_norm(split_engine->grads(), 0);
      const at::Tensor norm_dense = optim::clip_grad_norm(dense_engine->grads(), 0);
      EXPECT_TRUE(tol::within(norm_split, norm_dense, kGrad * norm_dense.item<double>()))
          << "grad norm";
    }
    for (const auto& it : dense->named_parameters()) {
      if (it.value().grad().defined())
        moved[it.key()] += 10 * lr * kGrad * (it.value().grad().abs().max().item<double>() + 1e-6);
    }
    split_engine->update(lr);
    dense_engine->update(lr);
    split_engine->zero_grad();
    dense_engine->zero_grad();
  }
  par::FullParams whole(*split_engine);  // ZeRO-3: the parameters are shards between units
  double worst = 0;
  for (const auto& it : split->named_parameters()) {
    const at::Tensor want = expected(layouts, it.key(), dense_params[it.key()], it.value());
    EXPECT_TRUE(tol::within(it.value(), want, moved[it.key()]))
        << it.key() << " after " << steps << " steps";
    worst = std::max(worst, (it.value() - want).abs().max().item<double>() / moved[it.key()]);
  }
  if (world->rank() == 0)
    std::printf("tolerance: tp %d sp %d zero %d: parameters after %d SGD steps, worst ratio %.3g\n",
                tp, sp ? 1 : 0, zero, steps, worst);
}

}  // namespace

TEST_F(TensorParallelTest, FusedQkvSplitsEachPartNotTheRows) {
  // W [3 D, in] packs q, k, v (each [H, hd] along the output). Rank r must hold the rows of its
  // own heads in each part; a contiguous split of the packed rows would not.
  const int64_t heads = 4 * n_, hd = 3, d = heads * hd, in = 5;
  const at::Tensor w = at::arange(3 * d * in, at::kFloat).view({3 * d, in});
  const at::Tensor mine = tensor::column_slice(w, 3, rank_, n_);
  const at::Tensor per_head = w.view({3, heads, hd, in});
  const int64_t local = heads / n_;
  const at::Tensor want = per_head.narrow(1, rank_ * local, local).reshape({3 * local * hd, in});
  EXPECT_TRUE(at::equal(mine, want));
  const at::Tensor contiguous = w.narrow(0, rank_ * 3 * d / n_, 3 * d / n_);
  if (n_ > 1)
    EXPECT_FALSE(at::equal(contiguous, want))
        << "a contiguous split would give this rank other heads";
  // The boxes of the global tensor this piece is, one per part.
  const tensor::ParamLayout l{0, 3, rank_, n_};
  const auto boxes = tensor::split_boxes(mine, l);
  ASSERT_EQ(boxes.size(), 3u);
  for (int64_t k = 0; k < 3; ++k) {
    EXPECT_EQ(boxes[k].offsets[0], k * d + rank_ * local * hd);
    EXPECT_TRUE(at::equal(boxes[k].local, w.narrow(0, boxes[k].offsets[0], local * hd)));
  }
  // And the whole tensor back from every rank's piece.
  EXPECT_TRUE(at::equal(tensor::gather_split(mine.to(test_device()), l, *world_).cpu(), w));
}

TEST_F(TensorParallelTest, ContiguousQkvSplitChangesTheModel) {
  if (n_ == 1) GTEST_SKIP() << "one rank: the contiguous split is the whole tensor";
  // The model-level consequence: a tp model whose qkv rows were split contiguously computes
  // another function than the single-process model (the per-part split matches it: next tests).
  auto group = std::make_shared<tensor::TpGroup>(world_, false);
  at::manual_seed(3);
  auto dense = models::build_model(vit_cls_config(), core::SceneSpec{});
  at::manual_seed(3);
  auto split = models::build_model(vit_cls_config(), core::SceneSpec{}, group);
  dense->to(test_device());
  split->to(test_device());
  at::manual_seed(4);
  const core::TensorDict batch = core::to_device(dense->example_batch(2), test_device());
  const at::Tensor want = dense->forward(batch).at("logits");
  const at::Tensor right = split->forward(batch).at("logits");
  EXPECT_TRUE(tol::within(right, want, kForward * (1 + want.abs().max().item<double>())));
  const auto dense_params = dense->named_parameters();
  {
    at::NoGradGuard no_grad;
    for (auto& it : split->named_parameters()) {
      if (it.key().find("qkv.weight") == std::string::npos) continue;
      const at::Tensor& w = dense_params[it.key()];
      const int64_t rows = w.size(0) / n_;
      it.value().copy_(w.narrow(0, rank_ * rows, rows));
    }
  }
  const at::Tensor wrong = split->forward(batch).at("logits");
  EXPECT_GT((wrong - want).abs().max().item<double>(), 100 * kForward);
}

TEST_F(TensorParallelTest, ColumnThenRowMatchesDenseWithAndWithoutSequenceParallel) {
  for (const bool sp : {false, true}) {
    auto group = std::make_shared<tensor::TpGroup>(world_, sp);
    const tensor::LinearSpec s1{12, 8 * n_, true, tensor::LinearRole::kColumn, "fc1"};
    const tensor::LinearSpec s2{8 * n_, 12, true, tensor::LinearRole::kRow, "fc2"};
    at::manual_seed(5);
    const at::Tensor w1 = at::randn({s1.out_features, s1.in_features}) * 0.02;
    const at::Tensor w2 = at::randn({s2.out_features, s2.in_features}) * 0.02;
    at::manual_seed(5);
    tensor::ColumnParallelLinear fc1(s1, group);
    tensor::RowParallelLinear fc2(s2, group);
    {
      at::NoGradGuard no_grad;
      fc1->bias.uniform_(-1, 1);  // the same on every rank (same generator state)
      fc2->bias.uniform_(-1, 1);
    }
    fc1->to(test_device());
    fc2->to(test_device());
    tensor::install_sequence_parallel_hooks(group);
    at::manual_seed(6);
    // 7 samples x 5 tokens: 35 rows, not a multiple of tp (pad rows in the SP path).
    const at::Tensor x = at::randn({7, 5, 12}).to(test_device()).requires_grad_(true);
    // Dense reference with the full biases gathered from the ranks.
    at::Tensor full_b1 = tensor::gather_split(fc1->bias, {0, 1, rank_, n_}, *world_);
    const at::Tensor xd = x.detach().clone().requires_grad_(true);
    const at::Tensor w1d = w1.to(test_device()).requires_grad_(true);
    const at::Tensor w2d = w2.to(test_device()).requires_grad_(true);
    const at::Tensor b1d = full_b1.clone().requires_grad_(true);
    const at::Tensor b2d = fc2->bias.detach().clone().requires_grad_(true);
    const at::Tensor yd = at::linear(at::gelu(at::linear(xd, w1d, b1d)), w2d, b2d);
    (yd * yd).sum().backward();

    at::Tensor y;
    if (sp) {
      const at::Tensor shard = tensor::scatter_to_sequence(x, group);
      y = tensor::gather_from_sequence(fc2->forward(at::gelu(fc1->forward(shard))), 35, group)
              .view({7, 5, 12});
    } else {
      y = fc2->forward(at::gelu(fc1->forward(x)));
    }
    (y * y).sum().backward();
    const double s = 1 + yd.abs().max().item<double>();
    EXPECT_TRUE(tol::within(y, yd, kForward * s)) << "sp " << sp;
    EXPECT_TRUE(
        tol::within(x.grad(), xd.grad(), kGrad * (1 + xd.grad().abs().max().item<double>())))
        << "sp " << sp;
    const tensor::ParamLayout col{0, 1, rank_, n_}, row{1, 1, rank_, n_};
    const double g =
        kGrad * (1 + w1d.grad().abs().max().item<double>() + w2d.grad().abs().max().item<double>());
    EXPECT_TRUE(tol::within(fc1->weight.grad(), local_part(w1d.grad(), col, fc1->weight), g));
    EXPECT_TRUE(tol::within(fc1->bias.grad(), local_part(b1d.grad(), col, fc1->bias), g));
    EXPECT_TRUE(tol::within(fc2->weight.grad(), local_part(w2d.grad(), row, fc2->weight), g));
    // The row bias is replicated: under sequence parallelism its gradient is a partial sum over
    // this rank's rows until the hook all-reduces it.
    EXPECT_TRUE(tol::within(fc2->bias.grad(), b2d.grad(), g)) << "sp " << sp;
  }
}

TEST_F(TensorParallelTest, SequenceParallelLayerNormGradientsAreIdenticalOnEveryTpRank) {
  // Megatron-LM#1446: the final LayerNorm's gradient differed across tp ranks. With the hooks the
  // replicated parameters' gradients are the same bits everywhere; without them they are not.
  for (const bool hooks : {true, false}) {
    auto group = std::make_shared<tensor::TpGroup>(world_, true);
    at::manual_seed(3);
    auto split = models::build_model(vit_cls_config(), core::SceneSpec{}, group);
    split->to(test_device());
    if (hooks) tensor::install_sequence_parallel_hooks(group);
    at::manual_seed(4);
    const core::TensorDict batch = core::to_device(split->example_batch(3), test_device());
    split->loss(batch, split->forward(batch)).total.backward();
    int checked = 0, differing = 0;
    for (const auto& it : split->named_parameters()) {
      if (it.key().find("norm") == std::string::npos) continue;
      const at::Tensor g = it.value().grad().contiguous();
      at::Tensor all = at::empty({n_ * g.numel()}, g.options());
      world_->all_gather(g.view({-1}), all);
      const at::Tensor per_rank = all.view({n_, -1});
      bool same = true;
      for (int r = 1; r < n_; ++r) same = same && at::equal(per_rank[r], per_rank[0]);
      ++checked;
      differing += same ? 0 : 1;
      if (hooks) EXPECT_TRUE(same) << it.key() << " differs across tp ranks";
    }
    EXPECT_GE(checked, 10);  // 2 blocks x 2 LayerNorms x (weight, bias) + the final one
    if (!hooks && n_ > 1)
      EXPECT_EQ(differing, checked) << "without the all-reduce every LayerNorm gradient is partial";
  }
}

TEST_F(TensorParallelTest, VitClsMatchesSingleProcess) {
  compare_with_single_process(world_, self_, vit_cls_config(), tp_of_world(n_), false, 0, 2, 3);
}

TEST_F(TensorParallelTest, VitClsWithSequenceParallelMatchesSingleProcess) {
  compare_with_single_process(world_, self_, vit_cls_config(), tp_of_world(n_), true, 0, 3, 3);
}

TEST_F(TensorParallelTest, BevWithVitBackboneMatchesSingleProcess) {
  // The whole model's outputs and loss terms, and the gradients of the (split) ViT backbone. The
  // bev model's own gradients are not compared through its loss: its ReLUs after GroupNorm have
  // kinks, and a pre-activation within the forward's 1e-6 difference of 0 flips an element's
  // gradient (measured: 0.1-0.8% of a tensor's largest gradient in the BEV encoder), which no
  // rounding bound covers. The backbone's gradients are taken through a smooth loss of its output
  // (the sum of squares of the feature map); the replicated BEV layers are the single-process code.
  for (const bool sp : {false, true}) {
    auto group = std::make_shared<tensor::TpGroup>(world_, sp);
    at::manual_seed(7);
    auto dense = std::dynamic_pointer_cast<models::PerceptionModel>(
        models::build_model(bev_vit_config(), core::SceneSpec{}));
    at::manual_seed(7);
    auto split = std::dynamic_pointer_cast<models::PerceptionModel>(
        models::build_model(bev_vit_config(), core::SceneSpec{}, group));
    ASSERT_TRUE(dense && split);
    dense->to(test_device());
    split->to(test_device());
    tensor::install_sequence_parallel_hooks(group);
    const auto layouts = tensor::param_layouts(*split);
    at::manual_seed(99);
    const core::TensorDict batch = core::to_device(dense->example_batch(2), test_device());
    {
      at::NoGradGuard no_grad;
      const core::TensorDict pd = dense->forward(batch), ps = split->forward(batch);
      for (const auto& [k, v] : pd) {
        EXPECT_TRUE(tol::within(ps.at(k), v, kForward * (1 + v.abs().max().item<double>())))
            << k << " sp " << sp;
      }
      const auto ld = dense->loss(batch, pd), ls = split->loss(batch, ps);
      for (const auto& [k, v] : ld.terms)
        EXPECT_TRUE(tol::within(ls.terms.at(k), v, kForward * (1 + v.abs().item<double>()))) << k;
    }
    const at::Tensor& raw = batch.at("images");  // [B, N, H, W, 3] uint8
    const at::Tensor images = models::normalize_images(
        raw.view({-1, raw.size(2), raw.size(3), 3}).permute({0, 3, 1, 2}), at::kFloat);
    const at::Tensor fd = dense->encoder()->forward(images), fs = split->encoder()->forward(images);
    EXPECT_TRUE(tol::within(fs, fd, kForward * (1 + fd.abs().max().item<double>())))
        << "features sp " << sp;
    fd.pow(2).sum().backward();
    fs.pow(2).sum().backward();
    const auto dense_params = dense->encoder()->named_parameters();
    int compared = 0;
    for (const auto& it : split->encoder()->named_parameters()) {
      const at::Tensor& g = dense_params[it.key()].grad();
      const at::Tensor want = expected(layouts, "encoder." + it.key(), g, it.value().grad());
      EXPECT_TRUE(
          tol::within(it.value().grad(), want, kGrad * (want.abs().max().item<double>() + 1e-6)))
          << it.key() << " sp " << sp;
      ++compared;
    }
    EXPECT_GT(compared, 20);
  }
}

TEST_F(TensorParallelTest, DataParallelTimesTensorParallelWithDdpAndZero123) {
  if (n_ != 4) GTEST_SKIP() << "dp 2 x tp 2 needs 4 ranks";
  for (const int zero : {0, 1, 2, 3}) {
    for (const bool sp : {false, true})
      compare_with_single_process(world_, self_, vit_cls_config(), 2, sp, zero, 2, 3);
  }
}

TEST_F(TensorParallelTest, ShapesTheTpSizeDoesNotDivideAreConfigErrors) {
  if (n_ == 1) GTEST_SKIP() << "one rank divides every shape";
  auto group = std::make_shared<tensor::TpGroup>(world_, false);
  models::ModelConfig cfg = vit_cls_config();
  cfg.num_classes = 4 * n_ + 1;
  try {
    models::build_model(cfg, core::SceneSpec{}, group);
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(4 * n_ + 1)), std::string::npos)
        << e.what();
  }
  models::ModelConfig mlp;
  mlp.name = "mlp";
  EXPECT_THROW(models::build_model(mlp, core::SceneSpec{}, group), ConfigError);
  models::ModelConfig conv = bev_vit_config();
  conv.backbone = "conv";
  try {
    models::build_model(conv, core::SceneSpec{}, group);
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("conv backbone"), std::string::npos) << e.what();
  }
  models::ModelConfig resnet = bev_vit_config();
  resnet.backbone = "resnet50";
  try {
    models::build_model(resnet, core::SceneSpec{}, group);
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("TP splits ViT blocks only"), std::string::npos) << m;
    EXPECT_NE(m.find("model.backbone=resnet50"), std::string::npos) << m;
  }
}
