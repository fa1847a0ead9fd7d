// The engine seam and ZeRO-1/2/3 (parallel/engine.h, parallel/zero/zero.h) against DDP's engine
// (stage 0) on the same data and initial weights, under mpirun with 2 and 4 ranks (MPI on CPU
// tensors; PARALLAX_TEST_BACKEND=gloo on gloo, =nccl on GPUs). fp32, TF32 off.
//
// Tolerances (tests/TOLERANCES.md):
//  - gradients: ZeRO's shard of the averaged gradient against DDP's averaged gradient at the same
//    parameters. Both average the same local gradients (stage 2 with K micro-steps: K local
//    gradients per rank), summing n (or n K) terms in a different order: each is within
//    gamma(n K - 1) S of the exact average, S = sum over the terms of |term| / n, so they differ by
//    at most 2 gamma(n K) S. With n = 2 and K = 1 the two sums are the same single addition: equal.
//  - one optimizer step from a fresh state: AdamW is elementwise, so the update of an element only
//    depends on that element's inputs; applying it to a piece rather than the whole tensor can
//    change only how the compiler contracted its ~10 roundings (FMA or not, vector body or scalar
//    tail): within 16 u (|p| + lr) per element. Elements whose gradient is within the gradient
//    bound of 0 are left out (the first Adam step is lr * sign(g) there).
//  - across ranks, parameters are bitwise identical after every step (one all-gather).
#include "parallel/zero/zero.h"
#include "comm/factory.h"
#include "comm/world.h"
#include "optim/grad_utils.h"
#include "optim/optimizer.h"
#include "parallel/build_engine.h"
#include "parallel/memory_rules.h"
#include "tests/common/no_tf32.h"
#include "tests/common/tolerance.h"
#include "units/param_init.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <tuple>

using namespace parallax;
namespace comm = parallax::comm;
namespace par = parallax::parallel;
namespace tol = parallax::testing;

namespace {

std::string test_backend() {
  const char* b = std::getenv("PARALLAX_TEST_BACKEND");
  return b && *b ? b : "mpi";
}

c10::Device test_device() {
  return test_backend() == "nccl" ? *comm::World::current().device() : c10::Device(c10::kCPU);
}

// Odd sizes, so buckets and shards cut through parameters; a 1-D bias group and a 2-D decay group.
// Three units (one per layer) whose forwards call the engine's unit hooks, as the models do.
struct Net : torch::nn::Module {
  // Through units::layer, as the model zoo builds its LibTorch layers, so a deferred build of it
  // records recipes (the same draws as torch::nn::Linear's constructor otherwise).
  Net() {
    using L = torch::nn::Linear;
    fc1 = register_module("fc1", units::layer<L>(torch::nn::LinearOptions(13, 37)));
    fc2 = register_module("fc2", units::layer<L>(torch::nn::LinearOptions(37, 29)));
    fc3 = register_module("fc3", units::layer<L>(torch::nn::LinearOptions(29, 5)));
  }
  // Unit i: fc1 + gelu, fc2 + gelu, fc3.
  at::Tensor unit(int i, const at::Tensor& x) {
    if (hooks) hooks->before_unit(i);
    at::Tensor y = i == 0 ? at::gelu(fc1(x)) : i == 1 ? at::gelu(fc2(x)) : fc3(x);
    if (hooks) hooks->after_unit(i, {y});
    return y;
  }
  at::Tensor forward(const at::Tensor& x) { return unit(2, unit(1, unit(0, x))); }
  static std::vector<units::Unit> units() {
    std::vector<units::Unit> out;
    for (const char* m : {"fc1", "fc2", "fc3"})
      out.push_back({m, {std::string(m) + ".weight", std::string(m) + ".bias"}});
    return out;
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
  units::UnitHooks* hooks = nullptr;
};

std::shared_ptr<Net> make_net(uint64_t seed) {
  at::manual_seed(seed);
  auto net = std::make_shared<Net>();
  net->to(test_device());
  return net;
}

std::pair<at::Tensor, at::Tensor> global_batch(int step, int64_t rows) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(2000 + step);
  at::Tensor x = at::randn({rows, 13}, gen);
  at::Tensor y = at::sin(x.narrow(1, 0, 5) * 2.0) + 0.1 * at::randn({rows, 5}, gen);
  return {x.to(test_device()), y.to(test_device())};
}

std::vector<optim::ParamGroup> groups_of(torch::nn::Module& m) {
  optim::NamedParams named;
  for (const auto& it : m.named_parameters()) named.emplace_back(it.key(), it.value());
  return optim::make_param_groups(named, 0.05);
}

par::OptimizerFactory adamw() {
  return [](std::vector<optim::ParamGroup> g) {
    return std::make_unique<optim::AdamW>(std::move(g), 0.9, 0.999, 1e-8, true);
  };
}

at::Tensor flat_params(torch::nn::Module& m) {
  std::vector<at::Tensor> parts;
  for (const auto& p : m.parameters()) parts.push_back(p.detach().reshape({-1}));
  return at::cat(parts);
}

// An engine on `net`, its unit hooks installed in it (ZeRO-3 gathers and frees through them).
std::unique_ptr<par::Engine> engine_for(const par::Plan& plan, const std::shared_ptr<Net>& net,
                                        const comm::CommPtr& group,
                                        const par::ddp::DdpOptions& options) {
  auto e = par::build_engine(plan, net, groups_of(*net), adamw(), group, options, Net::units());
  net->hooks = e->unit_hooks();
  return e;
}

// Three steps of two micro-batches each (global batches first_batch, first_batch + 1, ...; rank r
// takes rows [4 r, 4 r + 4)), an AdamW update at lr 1e-2 after each.
void train_three_steps(par::Engine& zero, Net& net, int first_batch, int rank, int n) {
  for (int step = 0; step < 3; ++step) {
    zero.forward_backward(
        2,
        [&](int i) {
          auto [x, y] = global_batch(first_batch + 2 * step + i, 4 * n);
          return (net.forward(x.narrow(0, 4 * rank, 4)) - y.narrow(0, 4 * rank, 4)).pow(2).mean();
        },
        true);
    zero.update(1e-2);
    zero.zero_grad();
  }
}

// A Net built under deferred construction (units/param_init.h) from `seed`, placed on the test
// device: placeholders, and the recipes that give its full build's values.
std::pair<std::shared_ptr<Net>, std::shared_ptr<units::DeferredInit>> deferred_net(uint64_t seed) {
  at::manual_seed(seed);
  std::shared_ptr<Net> net;
  std::shared_ptr<units::DeferredInit> recipes;
  {
    units::DeferredInitScope scope;
    net = std::make_shared<Net>();
    units::finish_deferred(*net);
    recipes = scope.recipes();
  }
  units::place_deferred(*net, *recipes, test_device());
  return {net, recipes};
}

// The sum over `accum` micro-steps of |each micro-step's local gradient| (micro(net, i): its loss)
// on a plain net holding `src`'s parameters, per parameter in registration order.
std::vector<at::Tensor> local_abs_grad_sum(Net& src, int accum,
                                           const std::function<at::Tensor(Net&, int)>& micro) {
  std::vector<at::Tensor> abs_sum;
  for (int i = 0; i < accum; ++i) {
    auto probe = make_net(1);
    {
      at::NoGradGuard ng;
      const auto pp = probe->parameters(), from = src.parameters();
      for (std::size_t k = 0; k < pp.size(); ++k) pp[k].copy_(from[k]);
    }
    micro(*probe, i).backward();
    const auto pp = probe->parameters();
    for (std::size_t k = 0; k < pp.size(); ++k) {
      at::Tensor a = pp[k].grad().abs().to(at::kDouble);
      if (abs_sum.size() <= k)
        abs_sum.push_back(a);
      else
        abs_sum[k] += a;
    }
  }
  return abs_sum;
}

// One update from a fresh state, elementwise: ZeRO's parameters `b` against DDP's `a` (both from
// `before`), where the gradient `g` is well above its bound `gb` (well-conditioned first Adam
// steps).
void expect_same_first_update(const at::Tensor& before, const at::Tensor& a, const at::Tensor& b,
                              const at::Tensor& g, const at::Tensor& gb, double lr, int stage) {
  const at::Tensor ok = g.abs() > 2 * gb;
  const at::Tensor tolerance = 16 * tol::kFp32Unit * (before.abs() + lr);
  EXPECT_TRUE(((a - b).abs() <= tolerance).logical_or(ok.logical_not()).all().item<bool>())
      << "stage " << stage << ": max diff " << ((a - b).abs() * ok).max().item<double>();
  EXPECT_GT(ok.sum().item<int64_t>(), g.numel() / 2);
  EXPECT_FALSE(at::equal(before, b)) << "the step did not move the parameters";
}

class ZeroTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    comm::CommOptions o;
    o.timeout_s = 60;
    world_ = comm::make_world_communicator(test_backend(), o);
    rank_ = world_->rank();
    n_ = world_->size();
  }
  par::ddp::DdpOptions bucket_options() const {
    par::ddp::DdpOptions o;
    o.mode = par::ddp::BucketMode::kFlat;
    o.first_bucket_mb = 0.002;  // several buckets, some cutting parameters across shards
    o.bucket_mb = 0.004;
    return o;
  }
  par::Plan plan(int stage) const {
    par::Plan p;
    p.layout.dp = n_;
    p.zero_stage = stage;
    return p;
  }
  // DDP's averaged gradient of each of `net0`'s parameters (flat, double) and its bound: the sum
  // over ranks of `abs_sum` (local_abs_grad_sum), / n, times 2 gamma of the n x accum terms
  // (exact for two terms in one micro-step).
  void ddp_grads_and_bounds(torch::nn::Module& net0, const std::vector<at::Tensor>& abs_sum,
                            int accum, std::map<std::string, at::Tensor>& ddp_grad,
                            std::map<std::string, at::Tensor>& bound) const {
    const auto named0 = net0.named_parameters();
    for (std::size_t k = 0; k < named0.size(); ++k) {
      at::Tensor s = abs_sum[k].to(world_->device_type() == c10::kCPU ? c10::Device(c10::kCPU)
                                                                      : test_device());
      world_->all_reduce(s, comm::ReduceOp::kSum);
      const double terms = static_cast<double>(n_ * accum);
      bound[named0[k].key()] =
          (terms == 2 && accum == 1 ? 0.0 : 2 * tol::gamma_k(terms)) * s.cpu() / n_;
      ddp_grad[named0[k].key()] =
          named0[k].value().grad().detach().cpu().to(at::kDouble).reshape({-1});
    }
  }
  parallax::testing::NoTf32 no_tf32_;
  comm::CommPtr world_;
  int rank_ = 0, n_ = 1;
};

}  // namespace

INSTANTIATE_TEST_SUITE_P(Stages, ZeroTest, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "stage" + std::to_string(info.param); });

TEST(FlatRangeBoxesTest, BoxesTileTheRangeInOrderAndAreContiguous) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 400; ++trial) {
    const int ndim = 1 + static_cast<int>(rng() % 4);
    std::vector<int64_t> shape;
    int64_t total = 1;
    for (int d = 0; d < ndim; ++d) {
      shape.push_back(1 + static_cast<int64_t>(rng() % 6));
      total *= shape.back();
    }
    const int64_t b = static_cast<int64_t>(rng() % (total + 1));
    const int64_t e = b + static_cast<int64_t>(rng() % (total - b + 1));
    const auto boxes = par::flat_range_boxes(shape, b, e);
    EXPECT_LE(boxes.size(), static_cast<std::size_t>(2 * ndim - 1));
    // Index every element by its flat position: the boxes, in order, enumerate b, b + 1, ..., e
    // - 1.
    at::Tensor idx = at::arange(total, at::kLong).view(shape);
    int64_t next = b;
    for (const auto& box : boxes) {
      at::Tensor v = idx;
      for (int d = 0; d < ndim; ++d) v = v.narrow(d, box.offsets[d], box.lengths[d]);
      const at::Tensor flat = v.reshape({-1});
      ASSERT_TRUE(at::equal(flat, at::arange(next, next + flat.numel(), at::kLong)))
          << "shape " << at::IntArrayRef(shape) << " range [" << b << ", " << e << ")";
      next += flat.numel();
    }
    EXPECT_EQ(next, e);
  }
  EXPECT_EQ(par::flat_range_boxes({}, 0, 1).size(), 1u);  // a 0-d tensor
}

TEST_P(ZeroTest, MatchesDdpGradientsOneStepAndKeepsReplicasIdentical) {
  const int stage = GetParam();
  for (const int accum : {1, 3}) {
    auto net0 = make_net(11), netz = make_net(11 + rank_);  // ZeRO must broadcast rank 0's weights
    auto ddp =
        par::build_engine(plan(0), net0, groups_of(*net0), adamw(), world_, bucket_options());
    auto zero = engine_for(plan(stage), netz, world_, bucket_options());
    {
      par::FullParams whole(*zero);  // stage 3: the parameters are shards between units
      ASSERT_TRUE(at::equal(flat_params(*net0), flat_params(*netz)))
          << "parameters not broadcast from rank 0";
    }
    const double lr = 1e-2;
    for (int step = 0; step < 4; ++step) {
      const int64_t rows = 6;
      auto [x, y] = global_batch(step, rows * n_ * accum);
      auto micro = [&](Net& net, int i) {
        const int64_t first = (rank_ * accum + i) * rows;
        return (net.forward(x.narrow(0, first, rows)) - y.narrow(0, first, rows)).pow(2).mean() /
               accum;
      };
      // The same parameters for both (stage 0 re-synchronised to ZeRO's), fresh optimizer state
      // only at step 0.
      {
        par::FullParams whole(*zero);
        at::NoGradGuard ng;
        const auto a = net0->parameters(), b = netz->parameters();
        for (std::size_t k = 0; k < a.size(); ++k) a[k].copy_(b[k]);
      }
      ddp->forward_backward(
          accum, [&](int i) { return micro(*net0, i); }, true);
      zero->forward_backward(
          accum, [&](int i) { return micro(*netz, i); }, true);
      // S: the sum of |local gradient terms| over ranks and micro-steps, / n (a plain net, per
      // micro-step).
      const std::vector<at::Tensor> abs_sum = local_abs_grad_sum(*net0, accum, micro);  // = netz's
      // Each ZeRO piece against the same range of DDP's gradient.
      const auto zg = zero->grads();
      ASSERT_EQ(zg.size(), 1u);
      ASSERT_EQ(zg[0].sharded_over.size(), 1u);
      std::map<std::string, at::Tensor> ddp_grad, bound;
      ddp_grads_and_bounds(*net0, abs_sum, accum, ddp_grad, bound);
      // Pieces: the optimizer's groups hold them, named by their parameter. Where each starts in
      // its parameter: stage 3 says so (model_state(): the same ranges of the shards); otherwise
      // the parameter is a view of the same flat buffer.
      std::map<const void*, int64_t> flat_begin;
      for (const auto& piece : zero->model_state())
        if (piece.flat_begin >= 0) flat_begin[piece.tensor.data_ptr()] = piece.flat_begin;
      const auto& groups = zero->optimizer().groups();
      std::map<std::string, int> seen;
      int64_t covered = 0;
      for (const auto& g : groups) {
        for (std::size_t i = 0; i < g.params.size(); ++i) {
          const at::Tensor piece = g.params[i];
          ASSERT_TRUE(piece.grad().defined()) << g.names[i];
          // Where the piece sits in its parameter: the parameter is a view of the same flat buffer.
          const at::Tensor param = net0->named_parameters()[g.names[i]];
          int64_t begin = 0;
          if (!flat_begin.empty()) {
            ASSERT_EQ(flat_begin.count(piece.data_ptr()), 1u) << g.names[i];
            begin = flat_begin.at(piece.data_ptr());
          } else {
            begin = (static_cast<const char*>(piece.data_ptr()) -
                     static_cast<const char*>(netz->named_parameters()[g.names[i]].data_ptr())) /
                    static_cast<int64_t>(piece.element_size());
          }
          ASSERT_GE(begin, 0);
          ASSERT_LE(begin + piece.numel(), param.numel());
          const at::Tensor want = ddp_grad[g.names[i]].narrow(0, begin, piece.numel());
          const at::Tensor b = bound[g.names[i]].reshape({-1}).narrow(0, begin, piece.numel());
          EXPECT_TRUE(tol::within(piece.grad().detach().cpu().to(at::kDouble), want, b))
              << "stage " << stage << " accum " << accum << " step " << step << " " << g.names[i];
          covered += piece.numel();
          ++seen[g.names[i]];
        }
      }
      // Every element of every parameter lives in exactly one rank's pieces.
      at::Tensor total = at::full({1}, static_cast<double>(covered), at::kDouble);
      if (world_->device_type() != c10::kCPU) total = total.to(test_device());
      world_->all_reduce(total, comm::ReduceOp::kSum);
      EXPECT_EQ(total.cpu().item<double>(), static_cast<double>(flat_params(*net0).numel()));

      // The inf check and the norm see every element once: ZeRO's global norm equals DDP's.
      const double n0 = optim::clip_grad_norm(ddp->grads(), 0.0).item<double>();
      const double nz = optim::clip_grad_norm(zero->grads(), 0.0).item<double>();
      EXPECT_NEAR(nz, n0, 1e-5 * n0) << "step " << step;

      if (step == 0) {
        // One step from a fresh state, elementwise: ZeRO's pieces against DDP's whole tensors.
        const at::Tensor before = flat_params(*net0).to(at::kDouble).cpu();
        ddp->update(lr);
        zero->update(lr);
        par::FullParams whole(*zero);
        const at::Tensor a = flat_params(*net0).to(at::kDouble).cpu(),
                         b = flat_params(*netz).to(at::kDouble).cpu();
        std::vector<at::Tensor> gs, bs;
        for (const auto& it : net0->named_parameters()) {
          gs.push_back(ddp_grad[it.key()]);
          bs.push_back(bound[it.key()].reshape({-1}));
        }
        expect_same_first_update(before, a, b, at::cat(gs), at::cat(bs), lr, stage);
      } else {
        zero->update(lr);
      }
      ddp->zero_grad();
      zero->zero_grad();
      // Every rank holds bitwise the same parameters after the all-gather.
      par::FullParams whole(*zero);
      at::Tensor mine = flat_params(*netz), root = mine.clone();
      world_->broadcast(root, 0);
      EXPECT_TRUE(at::equal(mine, root)) << "rank " << rank_ << " diverged at step " << step;
    }
  }
}

TEST_P(ZeroTest, OptimizerStatePiecesTileEveryParameterOnce) {
  auto net = make_net(3);
  std::map<std::string, at::Tensor> count;
  for (const auto& it : net->named_parameters())
    count[it.key() + ".exp_avg"] = at::zeros(it.value().sizes(), at::kDouble);
  auto zero = engine_for(plan(GetParam()), net, world_, bucket_options());
  zero->forward_backward(
      1, [&](int) { return net->forward(global_batch(0, 4).first).pow(2).mean(); }, true);
  zero->update(1e-3);
  int scalars = 0;
  std::set<std::string> seen;
  for (const auto& piece : zero->optimizer_state()) {
    if (piece.name == "step") continue;
    if (piece.global_shape.empty()) {
      ++scalars;
      continue;
    }
    ASSERT_EQ(piece.replicas.size(), 1u) << piece.name;  // a flat range: this rank alone
    // One flat piece per state tensor: 1-D, a range of the parameter's flattening, no box.
    ASSERT_GE(piece.flat_begin, 0) << piece.name;
    ASSERT_EQ(piece.tensor.dim(), 1) << piece.name;
    EXPECT_TRUE(piece.offsets.empty()) << piece.name;
    ASSERT_TRUE(seen.insert(piece.name).second) << piece.name << " twice on rank " << rank_;
    const auto it = count.find(piece.name);
    if (it == count.end()) continue;  // exp_avg_sq: the same ranges
    it->second.view({-1}).narrow(0, piece.flat_begin, piece.tensor.numel()).add_(1);
  }
  EXPECT_GT(scalars, 0);  // Adam's per-parameter step, written by the ranks holding a piece
  for (auto& [name, c] : count) {
    at::Tensor t = world_->device_type() == c10::kCPU ? c : c.to(test_device());
    world_->all_reduce(t, comm::ReduceOp::kSum);
    EXPECT_TRUE(at::equal(t.cpu(), at::ones_like(c))) << name << " is not covered exactly once";
  }
}

// Bytes per rank between steps, exactly (fp32, AdamW: 4 B parameters, 4 B gradients, 8 B moments
// per element): DDP holds 16 Psi; ZeRO-1 holds the padded parameters and flat gradients (4 P
// each), the reduce-scatter shard (4 P / N) and the moments of its own elements only; ZeRO-2 holds
// no flat gradient buffer (transient buckets), only the shard. Summed over the ranks, the moments
// are those of Psi elements: 8 Psi / N each on average (Megatron's distributed optimizer: 8 + 8 / N
// bytes per parameter for fp32 state beside full fp32 parameters and gradients; ours adds the P / N
// shards).
TEST_P(ZeroTest, MemoryPerRankFollowsTheFormula) {
  auto net0 = make_net(3), netz = make_net(3);
  auto ddp = engine_for(plan(0), net0, world_, bucket_options());
  auto zero = engine_for(plan(GetParam()), netz, world_, bucket_options());
  for (auto [net, eng] : {std::pair{net0.get(), ddp.get()}, std::pair{netz.get(), zero.get()}}) {
    eng->forward_backward(
        1, [&](int) { return net->forward(global_batch(0, 4).first).pow(2).mean(); }, true);
    eng->update(1e-3);
  }
  const int64_t psi = flat_params(*net0).numel();
  const par::EngineMemory d = ddp->memory(), z = zero->memory();
  EXPECT_EQ(d.params, 4 * psi);
  EXPECT_EQ(d.grads, 4 * psi);
  EXPECT_EQ(d.optimizer, 8 * psi);
  // P: the padded bucket elements (the flat parameter buffers; stage 3 keeps only their shards
  // between steps, every unit freed).
  const int stage = GetParam();
  const int64_t padded = stage == 3 ? z.params * n_ / 4 : z.params / 4;
  if (stage == 3) EXPECT_EQ(z.params % 4, 0);
  EXPECT_GE(padded, psi);
  EXPECT_LT(padded, psi + 64 * n_);  // at most n - 1 padding elements per bucket
  // Stage 1: the flat gradient buffers and the shard; stages 2 and 3: the shard only (transient
  // buckets). One rank: the flat buffers are the shards.
  EXPECT_EQ(z.grads, n_ == 1 ? 4 * padded : (stage == 1 ? 4 * padded : 0) + 4 * padded / n_);
  int64_t mine = 0;
  for (const auto& g : zero->optimizer().groups())
    for (const auto& p : g.params) mine += p.numel();
  EXPECT_EQ(z.optimizer, 8 * mine);
  at::Tensor total = at::full({1}, static_cast<double>(mine), at::kDouble);
  if (world_->device_type() != c10::kCPU) total = total.to(test_device());
  world_->all_reduce(total, comm::ReduceOp::kSum);
  EXPECT_EQ(total.cpu().item<double>(), static_cast<double>(psi));
}

// The memory rule each engine states (parallel::predicted_memory, what `parallax plan` predicts
// with) equals what the engine holds after a step, on every rank: DDP and this ZeRO stage, with
// gradient accumulation (stage 2's shard accumulator) and with a frozen parameter (a LoRA base:
// whole, or under stage 3 a shard of its unit).
TEST_P(ZeroTest, PredictedMemoryEqualsTheMeasuredOnEveryRank) {
  for (const bool frozen : {false, true}) {
    for (const int stage : {0, GetParam()}) {
      auto net = make_net(9);
      if (frozen) net->fc2->weight.set_requires_grad(false);
      const std::vector<optim::ParamGroup> groups = groups_of(*net);
      par::MemoryQuery q;
      q.dp = n_;
      q.dp_rank = rank_;
      q.micro_batches = 2;
      q.units = 3;
      q.groups = static_cast<int>(groups.size());
      q.optimizer_bytes_per_element = 8;  // AdamW: two fp32 moments
      q.ddp = bucket_options();
      const std::vector<units::Unit> units = Net::units();
      std::vector<par::ParamInfo> params;
      for (const auto& item : net->named_parameters()) {
        par::ParamInfo info;
        info.name = item.key();
        info.numel = item.value().numel();
        info.trainable = item.value().requires_grad();
        for (std::size_t u = 0; u < units.size(); ++u) {
          const auto& names = units[u].param_names;
          if (std::find(names.begin(), names.end(), info.name) != names.end())
            info.unit = static_cast<int>(u);
        }
        for (std::size_t g = 0; g < groups.size(); ++g) {
          const auto& names = groups[g].names;
          if (std::find(names.begin(), names.end(), info.name) != names.end())
            info.group = static_cast<int>(g);
        }
        params.push_back(info);
      }
      const par::EngineMemory predicted = par::predicted_memory(stage, params, q);
      auto engine = engine_for(plan(stage), net, world_, bucket_options());
      engine->forward_backward(
          2, [&](int i) { return net->forward(global_batch(i, 4).first).pow(2).mean(); }, true);
      engine->update(1e-3);
      const par::EngineMemory measured = engine->memory();
      const std::string what = "stage " + std::to_string(stage) + (frozen ? ", frozen fc2" : "") +
                               ", rank " + std::to_string(rank_);
      EXPECT_EQ(predicted.params, measured.params) << what;
      EXPECT_EQ(predicted.grads, measured.grads) << what;
      EXPECT_EQ(predicted.optimizer, measured.optimizer) << what;
      net->hooks = nullptr;
    }
  }
}

// Frozen parameters (requires_grad false, e.g. a LoRA base) stay out of the buckets and the
// optimizer; a parameter no rank used (find_unused) gets no gradient, so AdamW leaves it (and its
// weight decay) alone, as under DDP; one used on some ranks only is averaged with zeros.
TEST_P(ZeroTest, FrozenAndUnusedParametersBehaveAsUnderDdp) {
  for (const bool used_somewhere : {false, true}) {
    auto net0 = make_net(5), netz = make_net(5);
    for (auto* n : {net0.get(), netz.get()}) n->fc1->weight.set_requires_grad(false);
    auto opts = bucket_options();
    opts.find_unused = true;
    const at::Tensor fc1_before = netz->fc1->weight.detach().clone(),
                     fc3_before = netz->fc3->weight.detach().clone();
    auto ddp = engine_for(plan(0), net0, world_, opts);
    auto zero = engine_for(plan(GetParam()), netz, world_, opts);
    // fc3 is skipped by every rank (or, used_somewhere, by every rank but 0: a unit run on one
    // rank only, which ZeRO-3 would refuse; that case runs for stages 1 and 2).
    if (used_somewhere && GetParam() == 3) continue;
    auto loss = [&](Net& net) {
      const at::Tensor x = global_batch(rank_, 4).first;
      const bool skip = !used_somewhere || rank_ != 0;
      at::Tensor h = net.unit(1, net.unit(0, x));
      return skip ? h.pow(2).mean() : (h.pow(2).mean() + net.unit(2, h).pow(2).mean());
    };
    ddp->forward_backward(
        1, [&](int) { return loss(*net0); }, true);
    zero->forward_backward(
        1, [&](int) { return loss(*netz); }, true);
    for (const auto& g : zero->optimizer().groups()) {
      for (const auto& name : g.names)
        EXPECT_NE(name, "fc1.weight") << "a frozen parameter reached the optimizer";
    }
    bool fc3_has_grad = false;
    for (const auto& g : zero->optimizer().groups())
      for (std::size_t i = 0; i < g.params.size(); ++i)
        if (g.names[i] == "fc3.weight") fc3_has_grad = g.params[i].grad().defined();
    // Some rank may hold no piece of fc3.weight; where it does, the gradient exists iff any rank
    // used it.
    EXPECT_EQ(net0->fc3->weight.grad().defined(), used_somewhere);
    if (fc3_has_grad) {
      EXPECT_TRUE(used_somewhere);
    }
    ddp->update(1e-2);
    zero->update(1e-2);
    par::FullParams whole(*zero);
    EXPECT_TRUE(at::equal(netz->fc1->weight, fc1_before)) << "frozen parameter moved";
    EXPECT_EQ(at::equal(netz->fc3->weight, fc3_before), !used_somewhere)
        << "used somewhere: " << used_somewhere;
    EXPECT_TRUE(at::equal(net0->fc3->weight, fc3_before) == !used_somewhere);
  }
}

// fp16 loss scaling: an inf in one rank's local gradient reaches some rank's shard; every rank
// must still skip the step (the inf check is agreed over the shard group).
TEST_P(ZeroTest, InfOnOneRankSkipsTheStepOnEveryRank) {
  auto net = make_net(9);
  const at::Tensor before = flat_params(*net).clone();
  auto zero = engine_for(plan(GetParam()), net, world_, bucket_options());
  optim::LossScaler scaler(true, 1024.0);
  zero->forward_backward(
      1,
      [&](int) {
        at::Tensor l = net->forward(global_batch(0, 4).first).pow(2).mean();
        // Rank n - 1 overflows: its loss scaled by inf.
        return scaler.scale_loss(rank_ == n_ - 1 ? l * std::numeric_limits<float>::infinity() : l);
      },
      true);
  const bool found = scaler.unscale_and_check(zero->grads());
  EXPECT_TRUE(found) << "rank " << rank_ << " would step";
  if (!found) zero->update(1e-2);
  scaler.update(found);
  par::FullParams whole(*zero);
  EXPECT_TRUE(at::equal(flat_params(*net), before));
  EXPECT_EQ(scaler.scale(), 512.0);
}

using Zero3Test = ZeroTest;  // its SetUp only; no stage parameter

// Between units a rank holds only its shards: every parameter is empty outside a unit's window
// (a read there fails on the shape instead of reading freed memory), and whole inside FullParams.
TEST_F(Zero3Test, ParametersAreShardsOutsideTheirUnits) {
  auto net = make_net(21);
  const at::Tensor reference = flat_params(*net).clone();
  auto zero = engine_for(plan(3), net, world_, bucket_options());
  for (int step = 0; step < 2; ++step) {
    zero->forward_backward(
        2, [&](int i) { return net->forward(global_batch(step * 2 + i, 4).first).pow(2).mean(); },
        true);
    zero->update(1e-3);
    zero->zero_grad();
  }
  for (const auto& p : net->parameters()) {
    if (n_ > 1) EXPECT_EQ(p.numel(), 0);
  }
  const par::EngineMemory m = zero->memory();
  EXPECT_LE(m.params, 4 * (reference.numel() + 64 * n_) / n_);
  par::FullParams whole(*zero);
  for (const auto& p : net->parameters()) EXPECT_GT(p.numel(), 0);
  EXPECT_FALSE(at::equal(flat_params(*net), reference)) << "the steps did not move the weights";
}

// Prefetching changes when a gather is issued, never what the ranks compute: bitwise the same.
TEST_F(Zero3Test, PrefetchOffGivesBitwiseTheSameWeights) {
  std::vector<at::Tensor> out;
  for (const bool prefetch : {true, false}) {
    auto net = make_net(23);
    par::Plan p = plan(3);
    p.zero_prefetch = prefetch;
    auto zero = engine_for(p, net, world_, bucket_options());
    for (int step = 0; step < 3; ++step) {
      zero->forward_backward(
          1,
          [&](int) {
            auto [x, y] = global_batch(step, 4 * n_);
            return (net->forward(x.narrow(0, 4 * rank_, 4)) - y.narrow(0, 4 * rank_, 4))
                .pow(2)
                .mean();
          },
          true);
      zero->update(1e-2);
      zero->zero_grad();
    }
    par::FullParams whole(*zero);
    out.push_back(flat_params(*net).clone());
  }
  EXPECT_TRUE(at::equal(out[0], out[1]));
}

// The gather path itself (free after each unit, re-gather before its backward, storage released
// and re-allocated in place) even on one rank, where the engine otherwise skips it because the
// shard is the whole parameter: bitwise the weights of the shortcut, over accumulated steps. On
// nccl np1 this runs the NCCL gathers on the device.
TEST_F(Zero3Test, TheGatherPathGivesBitwiseTheWeightsOfTheOneRankShortcut) {
  std::vector<at::Tensor> out;
  for (const bool always : {false, true}) {
    auto net = make_net(27);
    auto zero = std::make_unique<par::zero::ZeroEngine>(
        net, groups_of(*net), adamw(), world_, bucket_options(), 3, Net::units(), true, always);
    net->hooks = zero->unit_hooks();
    train_three_steps(*zero, *net, 10, rank_, n_);
    if (always || n_ > 1) {
      for (const auto& p : net->parameters()) EXPECT_EQ(p.numel(), 0) << "not freed after the step";
    }
    par::FullParams whole(*zero);
    out.push_back(flat_params(*net).cpu().clone());
  }
  EXPECT_TRUE(at::equal(out[0], out[1]));
}

// Deferred initialisation (parallel.meta_init): a Net built without storage, its recipes
// handed to the engine, which fills each unit's flat parameter from them and keeps its shard:
// bitwise the weights of a full build after the same steps, with nothing broadcast. The gather
// path runs on every rank count (always_gather), on nccl np1 on the device.
TEST_F(Zero3Test, DeferredInitialisationGivesBitwiseTheWeightsOfAFullBuild) {
  std::vector<at::Tensor> out;
  for (const bool deferred : {false, true}) {
    std::shared_ptr<Net> net;
    std::shared_ptr<units::DeferredInit> recipes;
    if (deferred) {
      std::tie(net, recipes) = deferred_net(29);
      for (const auto& p : net->parameters())
        EXPECT_LE(p.storage().nbytes(), static_cast<std::size_t>(p.element_size()));
    } else {
      net = make_net(29);
    }
    auto zero = std::make_unique<par::zero::ZeroEngine>(net, groups_of(*net), adamw(), world_,
                                                        bucket_options(), 3, Net::units(), true,
                                                        true, par::TensorParallelInfo{}, recipes);
    net->hooks = zero->unit_hooks();
    train_three_steps(*zero, *net, 30, rank_, n_);
    par::FullParams whole(*zero);
    out.push_back(flat_params(*net).cpu().clone());
  }
  EXPECT_TRUE(at::equal(out[0], out[1]));
}

// Deferred initialisation is ZeRO-3's: stages 1 and 2 keep the whole model, so they refuse it.
TEST_F(Zero3Test, DeferredInitialisationNeedsStage3) {
  auto [net, recipes] = deferred_net(31);
  EXPECT_THROW(par::build_engine(plan(2), net, groups_of(*net), adamw(), world_, bucket_options(),
                                 Net::units(), {}, recipes),
               Error);
}

// A unit run once more on one rank (a data-dependent branch): every rank gets an error naming the
// units the ranks disagree on, at the first gather where they differ; nobody waits for a
// collective the others never issue (DeepSpeed#7998 hangs there). CPU backends check each gather
// as it is issued; NCCL checks at the end of the backward (not exercised here: with one GPU there
// is no second rank to disagree with).
TEST_F(Zero3Test, AUnitRunOnceMoreOnOneRankIsAnErrorNamingIt) {
  if (n_ == 1 || world_->device_type() != c10::kCPU) GTEST_SKIP() << "needs two CPU ranks";
  for (const bool prefetch : {true, false}) {
    auto net = make_net(25);
    par::Plan p = plan(3);
    p.zero_prefetch = prefetch;
    auto zero = engine_for(p, net, world_, bucket_options());
    try {
      zero->forward_backward(
          1,
          [&](int) {
            const at::Tensor x = global_batch(0, 4).first;
            if (rank_ == 1) net->unit(0, x);  // the extra call
            return net->forward(x).pow(2).mean();
          },
          true);
      ADD_FAILURE() << "rank " << rank_ << ": no error (prefetch " << prefetch << ")";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("ranks disagree on which unit runs next"), std::string::npos) << what;
      EXPECT_NE(what.find("unit 'fc1' for the 2nd time"), std::string::npos) << what;
      EXPECT_NE(what.find("rank 1 gathers"), std::string::npos) << what;
    }
  }
}

TEST(ZeroPlanTest, RefusesWhatItCannotDoNamingTheKey) {
  par::ParallelConfig p;
  p.zero.stage = 3;
  try {
    par::Plan::from(p, "none", true, 2, 0);
    ADD_FAILURE() << "ZeRO-3 with CUDA graphs accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("train.cuda_graph"), std::string::npos) << e.what();
  }
  p.zero.prefetch = false;
  EXPECT_FALSE(par::Plan::from(p, "none", false, 2, 0).zero_prefetch);
  p.zero.stage = 1;
  try {
    par::Plan::from(p, "none", true, 2, 0);
    ADD_FAILURE() << "ZeRO with CUDA graphs accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("train.cuda_graph"), std::string::npos) << e.what();
  }
  EXPECT_EQ(par::Plan::from(p, "full", false, 2, 0).describe(),
            "dp=2 x tp=1 x pp=1, ZeRO-1, activation checkpointing full");
}
