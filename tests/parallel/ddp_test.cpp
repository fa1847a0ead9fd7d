// DDP against a single-process reference on the same data and initial weights, under mpirun with
// 2 and 4 ranks: MPI backend on CPU tensors, or (PARALLAX_TEST_BACKEND=nccl, label `cuda`) NCCL on
// one GPU per rank. fp32 throughout.
//
// Tolerances: the reference computes the gradient of the mean loss over the global batch; DDP
// averages per-rank means. Both are exact in real arithmetic; in fp32 they differ by summation
// order only, so losses and parameters after 10 AdamW steps agree to 1e-6 relative on the CPU
// (measured differences are ~1e-7). On GPUs the matmul kernels differ with the batch size (another
// reduction order inside cuBLAS), so the bound is 1e-5 there. Across ranks, parameters must be
// bitwise identical after every step on both.
#include "core/error.h"
#include "models/checkpointable.h"
#include "models/model.h"
#include "optim/grad_utils.h"
#include "optim/optimizer.h"
#include "parallel/comm/factory.h"
#include "parallel/comm/world.h"
#include "parallel/ddp/ddp.h"
#include "tests/common/no_tf32.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

using namespace parallax;
namespace comm = parallax::parallel::comm;
namespace ddp = parallax::parallel::ddp;

namespace {

std::string test_backend() {
  const char* b = std::getenv("PARALLAX_TEST_BACKEND");
  return b && *b ? b : "mpi";
}

c10::Device test_device() {
  return test_backend() == "nccl" ? *comm::World::current().device() : c10::Device(c10::kCPU);
}

double tol() { return test_backend() == "nccl" ? 1e-5 : 1e-6; }

// Regression MLP with an optional branch that is only used when `use_branch` is set.
struct Net : torch::nn::Module {
  explicit Net(bool with_branch = false) {
    fc1 = register_module("fc1", torch::nn::Linear(12, 48));
    fc2 = register_module("fc2", torch::nn::Linear(48, 48));
    fc3 = register_module("fc3", torch::nn::Linear(48, 4));
    if (with_branch) branch = register_module("branch", torch::nn::Linear(48, 4));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = at::gelu(fc2(at::gelu(fc1(x))));
    at::Tensor y = fc3(h);
    if (use_branch && branch) y = y + branch(h);
    return y;
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr}, branch{nullptr};
  bool use_branch = false;
};

std::shared_ptr<Net> make_net(uint64_t seed, bool with_branch = false) {
  at::manual_seed(seed);
  auto net = std::make_shared<Net>(with_branch);
  net->to(test_device());
  return net;
}

// The global batch of a step: identical on every rank (same seed); rank r uses rows of its chunk.
std::pair<at::Tensor, at::Tensor> global_batch(int step, int64_t rows) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  at::Tensor x = at::randn({rows, 12}, gen);
  at::Tensor y = at::sin(x.narrow(1, 0, 4) * 2.0) + 0.1 * at::randn({rows, 4}, gen);
  return {x.to(test_device()), y.to(test_device())};
}

at::Tensor mse(const at::Tensor& a, const at::Tensor& b) { return (a - b).pow(2).mean(); }


optim::ParamGroup all_params(torch::nn::Module& m) {
  optim::ParamGroup g;
  g.name = "all";
  g.weight_decay = 0.01;
  for (const auto& it : m.named_parameters()) {
    g.names.push_back(it.key());
    g.params.push_back(it.value());
  }
  return g;
}

double max_rel(const at::Tensor& a, const at::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item<double>();
}

at::Tensor flat_params(torch::nn::Module& m) {
  std::vector<at::Tensor> parts;
  for (const auto& p : m.parameters()) parts.push_back(p.detach().reshape({-1}));
  return at::cat(parts);
}

class DdpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    comm::CommOptions o;
    o.timeout_s = 60;
    world_ = comm::make_world_communicator(test_backend(), o);
    rank_ = world_->rank();
    n_ = world_->size();
  }

  // Every rank holds bitwise the same parameters.
  void expect_replicas_identical(torch::nn::Module& m, int step) {
    at::Tensor mine = flat_params(m);
    at::Tensor root = mine.clone();
    world_->broadcast(root, 0);
    EXPECT_TRUE(at::equal(mine, root)) << "rank " << rank_ << " diverged from rank 0 at step " << step;
  }

  // Wrapping a model with `o` is a ConfigError whose message names `key`.
  void expect_refused(const ddp::DdpOptions& o, const std::string& key) {
    try {
      ddp::DistributedDataParallel bad(make_net(2), world_, o);
      ADD_FAILURE() << "options naming " << key << " were accepted";
    } catch (const ConfigError& err) {
      EXPECT_NE(std::string(err.what()).find(key), std::string::npos) << err.what();
    }
  }

  // `steps` AdamW steps of two DDP-wrapped nets on the same batches (rank r takes rows 4r..4r+3 of
  // each global batch), one after the other within each step.
  void train_side_by_side(Net& a, ddp::DistributedDataParallel& ea, Net& b, ddp::DistributedDataParallel& eb,
                          int steps, bool set_to_none) {
    optim::AdamW oa({all_params(a)}, 0.9, 0.999, 1e-8, true), ob({all_params(b)}, 0.9, 0.999, 1e-8, true);
    for (int step = 0; step < steps; ++step) {
      auto [x, y] = global_batch(step, 4 * n_);
      at::Tensor xs = x.narrow(0, rank_ * 4, 4), ys = y.narrow(0, rank_ * 4, 4);
      for (auto [net, eng, opt] : {std::tuple{&a, &ea, &oa}, std::tuple{&b, &eb, &ob}}) {
        eng->before_backward();
        mse(net->forward(xs), ys).backward();
        eng->finalize_backward();
        opt->step(1e-2);
        opt->zero_grad(set_to_none);
      }
    }
  }

  comm::CommPtr world_;
  int rank_ = 0, n_ = 1;
};

// The tests that check the reduction itself run with both bucket layouts.
class DdpModeTest : public DdpTest, public ::testing::WithParamInterface<ddp::BucketMode> {
 protected:
  ddp::DdpOptions options() const {
    ddp::DdpOptions o;
    o.mode = GetParam();
    return o;
  }
};

}  // namespace

INSTANTIATE_TEST_SUITE_P(Layouts, DdpModeTest, ::testing::Values(ddp::BucketMode::kFlat, ddp::BucketMode::kGrouped),
                         [](const auto& info) { return std::string(ddp::to_string(info.param)); });

TEST_P(DdpModeTest, MatchesSingleProcessOnFullBatch) {
  const int64_t global_rows = 8 * n_;
  auto ref = make_net(7);
  auto net = make_net(7 + rank_);  // different init per rank: DDP must broadcast rank 0's weights
  ddp::DistributedDataParallel engine(net, world_, options());
  ASSERT_EQ(engine.mode(), GetParam());
  EXPECT_TRUE(at::equal(flat_params(*net), flat_params(*ref))) << "parameters not broadcast from rank 0";
  optim::AdamW ref_opt({all_params(*ref)}, 0.9, 0.999, 1e-8, true);
  optim::AdamW opt({all_params(*net)}, 0.9, 0.999, 1e-8, true);
  for (int step = 0; step < 10; ++step) {
    auto [x, y] = global_batch(step, global_rows);
    at::Tensor ref_loss = mse(ref->forward(x), y);
    ref_loss.backward();
    ref_opt.step(1e-2);
    ref_opt.zero_grad(true);

    const int64_t rows = global_rows / n_;
    at::Tensor loss = mse(net->forward(x.narrow(0, rank_ * rows, rows)), y.narrow(0, rank_ * rows, rows));
    engine.before_forward();
    engine.before_backward();
    loss.backward();
    engine.finalize_backward();
    // Flat: every gradient is its bucket's view again, whether it was cleared in place or set to
    // None (then the bucket copied the new gradient in just before its all-reduce). Grouped: each
    // gradient is its own tensor, reduced in place.
    const std::vector<at::Tensor> grads = engine.gradients();
    ASSERT_EQ(engine.buckets().size(), 1u);
    for (std::size_t k = 1; k < grads.size(); ++k) {
      EXPECT_EQ(grads[k].is_alias_of(grads.front()), GetParam() == ddp::BucketMode::kFlat) << "step " << step;
    }
    // CPU: host clocks, read at finalize_backward(); backward did real work, waiting cannot be
    // negative. GPU: CUDA events read one step late without a sync (0 at the first step; the
    // loss's item() below makes each step's events complete before the next reads them).
    if (step > 0 || test_device().is_cpu()) {
      EXPECT_GT(engine.last_backward_ms(), 0.0);
    }
    EXPECT_GE(engine.last_exposed_comm_ms(), 0.0);
    opt.step(1e-2);
    // Both ways of clearing: zero in place (the bucket views stay), or set to None (the trainer's
    // way: the bucket copies the next first gradients in before its all-reduce and restores the
    // views).
    opt.zero_grad(/*set_to_none=*/step % 2 == 0);

    at::Tensor mean_loss = loss.detach().clone();
    world_->all_reduce(mean_loss, comm::ReduceOp::kAvg);
    EXPECT_NEAR(mean_loss.item<double>(), ref_loss.item<double>(), tol() * ref_loss.item<double>()) << "step " << step;
    expect_replicas_identical(*net, step);
  }
  EXPECT_LT(max_rel(flat_params(*net), flat_params(*ref)), tol());
  // The last step zeroed in place: the gradients are still there.
  for (const auto& g : engine.gradients()) EXPECT_TRUE(g.defined());
}

TEST_P(DdpModeTest, GradAccumulationEqualsLargerBatchAndSkipsCommunication) {
  const int k = 4;
  const int64_t micro_rows = 3;
  auto a = make_net(21), b = make_net(21);
  ddp::DistributedDataParallel ea(a, world_, options()), eb(b, world_, options());
  optim::Sgd oa({all_params(*a)}, 0.9, false, true), ob({all_params(*b)}, 0.9, false, true);
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = global_batch(step, k * micro_rows * n_);
    const int64_t mine = k * micro_rows;
    at::Tensor xs = x.narrow(0, rank_ * mine, mine), ys = y.narrow(0, rank_ * mine, mine);
    // K micro-steps, communication only on the last.
    for (int m = 0; m < k; ++m) {
      const bool last = m == k - 1;
      const int64_t before = world_->stats().collectives;
      ea.set_require_sync(last);
      ea.before_backward();
      (mse(a->forward(xs.narrow(0, m * micro_rows, micro_rows)), ys.narrow(0, m * micro_rows, micro_rows)) / k)
          .backward();
      ea.finalize_backward();
      if (!last) {
        EXPECT_EQ(world_->stats().collectives, before) << "collective issued in no-sync micro-step " << m;
      }
      if (last) {
        EXPECT_GT(world_->stats().collectives, before);
      }
    }
    oa.step(0.05);
    oa.zero_grad(false);
    // One step on the K-times larger batch.
    eb.before_backward();
    mse(b->forward(xs), ys).backward();
    eb.finalize_backward();
    ob.step(0.05);
    ob.zero_grad(false);
  }
  EXPECT_LT(max_rel(flat_params(*a), flat_params(*b)), tol());
}

TEST_F(DdpTest, NoSyncGuardRestoresSync) {
  auto a = make_net(3);
  ddp::DistributedDataParallel e(a, world_, {});
  {
    ddp::NoSyncGuard guard(e);
    EXPECT_FALSE(e.require_sync());
  }
  EXPECT_TRUE(e.require_sync());
}

TEST_F(DdpTest, RingAndNativeGiveTheSameParameters) {
  auto a = make_net(31), b = make_net(31);
  ddp::DdpOptions ring;
  ring.algo = comm::AllReduceAlgo::kRing;
  ring.bucket_mb = 0.002;  // three buckets: {fc3}, {fc2}, {fc1}
  ring.first_bucket_mb = 0.0005;
  ddp::DdpOptions native = ring;
  native.algo = comm::AllReduceAlgo::kNative;
  ddp::DistributedDataParallel ea(a, world_, ring), eb(b, world_, native);
  EXPECT_GT(ea.buckets().size(), 2u);
  train_side_by_side(*a, ea, *b, eb, 5, /*set_to_none=*/false);
  // fp32 sums in a different order: equal within rounding.
  EXPECT_LT(max_rel(flat_params(*a), flat_params(*b)), tol());
}

// DdpOptions::timing off (what train.cuda_graph uses: timing events cannot be captured) records no
// timers and reduces exactly as with timing on.
TEST_F(DdpTest, TimingOffReducesTheSameAndReportsNoTimes) {
  auto a = make_net(41), b = make_net(41);
  ddp::DdpOptions off;
  off.timing = false;
  ddp::DistributedDataParallel ea(a, world_, {}), eb(b, world_, off);
  train_side_by_side(*a, ea, *b, eb, 3, /*set_to_none=*/true);
  EXPECT_TRUE(at::equal(flat_params(*a), flat_params(*b)));
  EXPECT_EQ(eb.last_backward_ms(), 0.0);
  EXPECT_EQ(eb.last_exposed_comm_ms(), 0.0);
  // With timing on, CPU timers are host clocks read at once (GPU ones a step or more later).
  if (test_device().is_cpu()) EXPECT_GT(ea.last_backward_ms(), 0.0);
}

// auto: grouped where NCCL groups the per-gradient all-reduces natively; the CPU backends would
// flatten and copy back, so flat there.
TEST_F(DdpTest, AutoLayoutIsGroupedOnNcclUnlessTheRingOrReduceDtypeNeedFlat) {
  auto net = make_net(2);
  ddp::DistributedDataParallel e(net, world_, {});
  EXPECT_EQ(e.mode(), test_backend() == "nccl" ? ddp::BucketMode::kGrouped : ddp::BucketMode::kFlat);
  ddp::DdpOptions ring;
  ring.algo = comm::AllReduceAlgo::kRing;
  EXPECT_EQ(ddp::DistributedDataParallel(make_net(2), world_, ring).mode(), ddp::BucketMode::kFlat);
  ddp::DdpOptions bf16;
  bf16.reduce_dtype = at::kBFloat16;
  EXPECT_EQ(ddp::DistributedDataParallel(make_net(2), world_, bf16).mode(), ddp::BucketMode::kFlat);
  ring.mode = ddp::BucketMode::kGrouped;
  expect_refused(ring, "parallel.ddp.bucket_mode");  // grouped buckets with the ring
  EXPECT_EQ(ddp::parse_bucket_mode("auto"), ddp::BucketMode::kAuto);
  EXPECT_EQ(ddp::parse_bucket_mode("grouped"), ddp::BucketMode::kGrouped);
  EXPECT_THROW(ddp::parse_bucket_mode("fused"), ConfigError);
}

// reduce_dtype=bf16 (PyTorch's bf16_compress_hook): two engines on identical replicas and data,
// one reducing in fp32 and one in bf16 through three buckets. The bf16 engine's averaged gradients
// are exactly bf16 values (the average is rounded to bf16, then cast back into the fp32 bucket)
// and agree with the fp32 average to bf16's precision: an element's error is at most (n+2)
// roundings of 2^-8 of the ranks' summed magnitudes (each rank's copy, the partial sums, the
// division). The test bounds those magnitudes loosely by n times the largest element of the fp32
// average's tensor; a missing division or a wrong bucket is off by far more. The bf16 engine's
// replicas stay bitwise identical.
TEST_F(DdpTest, Bf16ReductionRoundsTheAverageToBf16) {
  auto a = make_net(41), b = make_net(41);
  ddp::DdpOptions fp32;
  fp32.bucket_mb = 0.002;  // three buckets: {fc3}, {fc2}, {fc1}
  fp32.first_bucket_mb = 0.0005;
  ddp::DdpOptions bf16 = fp32;
  bf16.reduce_dtype = at::kBFloat16;
  ddp::DistributedDataParallel ea(a, world_, fp32), eb(b, world_, bf16);
  ASSERT_GT(eb.buckets().size(), 2u);
  ASSERT_EQ(eb.mode(), ddp::BucketMode::kFlat);
  optim::AdamW oa({all_params(*a)}, 0.9, 0.999, 1e-8, true), ob({all_params(*b)}, 0.9, 0.999, 1e-8, true);
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = global_batch(step, 4 * n_);
    at::Tensor xs = x.narrow(0, rank_ * 4, 4), ys = y.narrow(0, rank_ * 4, 4);
    for (auto [net, eng] : {std::pair{a.get(), &ea}, std::pair{b.get(), &eb}}) {
      eng->before_backward();
      mse(net->forward(xs), ys).backward();
      eng->finalize_backward();
    }
    const auto ga = ea.gradients(), gb = eb.gradients();
    ASSERT_EQ(ga.size(), gb.size());
    for (std::size_t k = 0; k < ga.size(); ++k) {
      at::Tensor g32 = ga[k].cpu(), g16 = gb[k].cpu();
      ASSERT_EQ(g16.scalar_type(), at::kFloat);
      EXPECT_TRUE(at::equal(g16, g16.to(at::kBFloat16).to(at::kFloat))) << "step " << step << ", gradient " << k
                                                                         << ": not a bf16 value";
      EXPECT_FALSE(at::equal(g16, g32)) << "step " << step << ", gradient " << k << ": not reduced in bf16";
      const double bound = std::ldexp(1.0, -8) * (n_ + 2) * n_ * g32.abs().max().item<double>();
      EXPECT_LE((g16 - g32).abs().max().item<double>(), bound) << "step " << step << ", gradient " << k;
    }
    oa.step(1e-2);
    ob.step(1e-2);
    oa.zero_grad(true);
    ob.zero_grad(true);
    expect_replicas_identical(*b, step);
  }
  // Only flat buckets reduce a copy; the config names the key.
  ddp::DdpOptions grouped = bf16;
  grouped.mode = ddp::BucketMode::kGrouped;
  expect_refused(grouped, "parallel.ddp.reduce_dtype=bf16");
  EXPECT_EQ(ddp::parse_reduce_dtype("grad"), std::nullopt);
  EXPECT_EQ(ddp::parse_reduce_dtype("fp16"), at::kHalf);
  EXPECT_THROW(ddp::parse_reduce_dtype("fp8"), ConfigError);
}

TEST(DdpBucketTest, ReverseOrderCapsAndFirstBucket) {
  // Parameter sizes in bytes, registration order.
  const std::vector<int64_t> sizes = {400, 400, 4000, 100, 100, 100, 2000};
  const std::vector<at::ScalarType> dt(sizes.size(), at::kFloat);
  const auto b = ddp::assign_buckets(sizes, dt, /*first=*/250, /*cap=*/1000);
  // Reverse order: 6 (2000 >= 250 closes the first bucket), then 5,4,3 (300), 2 (4300 closes),
  // then 1,0 (800, left open at the end).
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0], (std::vector<int64_t>{6}));
  EXPECT_EQ(b[1], (std::vector<int64_t>{5, 4, 3, 2}));
  EXPECT_EQ(b[2], (std::vector<int64_t>{1, 0}));
  // Dtypes never mix.
  const auto mixed = ddp::assign_buckets({100, 100, 100}, {at::kFloat, at::kBFloat16, at::kFloat}, 1000, 1000);
  ASSERT_EQ(mixed.size(), 2u);
  EXPECT_EQ(mixed[0], (std::vector<int64_t>{2, 0}));
  EXPECT_EQ(mixed[1], (std::vector<int64_t>{1}));
}

TEST_F(DdpTest, BucketLayoutOfARealModel) {
  auto net = make_net(1);
  ddp::DdpOptions o;
  o.first_bucket_mb = 1.0 / 1024;  // 1 KiB
  o.bucket_mb = 8.0 / 1024;        // 8 KiB
  ddp::DistributedDataParallel e(net, world_, o);
  const auto& buckets = e.buckets();
  ASSERT_FALSE(buckets.empty());
  // Registration order is fc1.weight, fc1.bias, fc2.weight, ...; buckets start from the end.
  EXPECT_EQ(buckets.front().param_names.front(), "fc3.bias");
  EXPECT_EQ(buckets.back().param_names.back(), "fc1.weight");
  for (std::size_t i = 0; i < buckets.size(); ++i) {
    const int64_t cap = i == 0 ? 1024 : 8 * 1024;
    // A bucket exceeds its cap only by its last parameter.
    const auto& bk = buckets[i];
    const int64_t last_bytes = (bk.numel - bk.offsets.back()) * 4;
    EXPECT_LT(bk.bytes() - last_bytes, cap) << "bucket " << i;
  }
}

TEST_F(DdpTest, UnusedParameterIsAnErrorNamingIt) {
  auto net = make_net(5, /*with_branch=*/true);
  ddp::DistributedDataParallel e(net, world_, {});
  auto [x, y] = global_batch(0, 4);
  e.before_backward();
  mse(net->forward(x), y).backward();  // the branch is not used
  try {
    e.finalize_backward();
    FAIL() << "expected an error for the unused branch";
  } catch (const Error& err) {
    const std::string msg = err.what();
    EXPECT_NE(msg.find("branch.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("parallel.ddp.find_unused=true"), std::string::npos) << msg;
  }
}

TEST_P(DdpModeTest, FindUnusedMatchesReference) {
  auto ref = make_net(6, true), net = make_net(6, true);
  ddp::DdpOptions o = options();
  o.find_unused = true;
  ddp::DistributedDataParallel e(net, world_, o);
  optim::AdamW ref_opt({all_params(*ref)}, 0.9, 0.999, 1e-8, true), opt({all_params(*net)}, 0.9, 0.999, 1e-8, true);
  const at::Tensor branch_before = net->branch->weight.detach().clone();
  for (int step = 0; step < 4; ++step) {
    // The branch is used in steps 2 and 3 only, and then on every rank.
    ref->use_branch = net->use_branch = step >= 2;
    auto [x, y] = global_batch(step, 4 * n_);
    mse(ref->forward(x), y).backward();
    ref_opt.step(1e-2);
    ref_opt.zero_grad(true);
    e.before_backward();
    mse(net->forward(x.narrow(0, rank_ * 4, 4)), y.narrow(0, rank_ * 4, 4)).backward();
    e.finalize_backward();
    if (step < 2) {
      EXPECT_FALSE(net->branch->weight.grad().defined()) << "globally unused: no gradient";
    }
    opt.step(1e-2);
    opt.zero_grad(false);
    if (step < 2) {
      EXPECT_TRUE(at::equal(net->branch->weight.detach(), branch_before));
    }
  }
  EXPECT_LT(max_rel(flat_params(*net), flat_params(*ref)), tol());
}

TEST_F(DdpTest, GlobalNormClippingEqualsSingleProcessClip) {
  auto ref = make_net(8), net = make_net(8);
  ddp::DistributedDataParallel e(net, world_, {});
  optim::Sgd ref_opt({all_params(*ref)}, 0.0, false, true), opt({all_params(*net)}, 0.0, false, true);
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = global_batch(step, 4 * n_);
    mse(ref->forward(x), y * 50.0).backward();  // large targets: the clip is active
    std::vector<at::Tensor> rg;
    for (auto& p : ref->parameters()) rg.push_back(p.grad());
    const double ref_norm = optim::clip_grad_norm(rg, 0.5).item<double>();
    ref_opt.step(0.1);
    ref_opt.zero_grad(true);
    e.before_backward();
    mse(net->forward(x.narrow(0, rank_ * 4, 4)), y.narrow(0, rank_ * 4, 4) * 50.0).backward();
    e.finalize_backward();
    const double norm = optim::clip_grad_norm(e.gradients(), 0.5).item<double>();
    EXPECT_GT(ref_norm, 0.5);
    EXPECT_NEAR(norm, ref_norm, 10 * tol() * ref_norm);
    opt.step(0.1);
    opt.zero_grad(false);
  }
  EXPECT_LT(max_rel(flat_params(*net), flat_params(*ref)), tol());
}

TEST_F(DdpTest, InfOnOneRankSkipsTheStepEverywhere) {
  auto net = make_net(9);
  ddp::DistributedDataParallel e(net, world_, {});
  optim::AdamW opt({all_params(*net)}, 0.9, 0.999, 1e-8, true);
  optim::LossScaler scaler(true, 1024.0, 2000, 1.0);
  const at::Tensor before = flat_params(*net).clone();
  auto [x, y] = global_batch(0, 4);
  at::Tensor loss = mse(net->forward(x), y);
  if (rank_ == n_ - 1) loss = loss * std::numeric_limits<float>::infinity();
  e.before_backward();
  scaler.scale_loss(loss).backward();
  e.finalize_backward();
  const bool inf = scaler.unscale_and_check(e.gradients());
  EXPECT_TRUE(inf) << "rank " << rank_ << " did not see the overflow of rank " << n_ - 1;
  if (!inf) opt.step(1e-2);
  scaler.update(inf);
  EXPECT_DOUBLE_EQ(scaler.scale(), 512.0);
  EXPECT_TRUE(at::equal(flat_params(*net), before));
}

namespace {

struct ResBlock : models::CheckpointableBlock {
  ResBlock() { fc = register_module("fc", torch::nn::Linear(24, 24)); }
  at::Tensor forward_impl(const at::Tensor& x) override { return x + at::gelu(fc(x)); }
  torch::nn::Linear fc{nullptr};
};

struct BlockNet : torch::nn::Module {
  BlockNet() {
    in = register_module("in", torch::nn::Linear(12, 24));
    b1 = register_module("b1", std::make_shared<ResBlock>());
    b2 = register_module("b2", std::make_shared<ResBlock>());
    out = register_module("out", torch::nn::Linear(24, 4));
  }
  at::Tensor forward(const at::Tensor& x) { return out(b2->forward(b1->forward(in(x)))); }
  torch::nn::Linear in{nullptr}, out{nullptr};
  std::shared_ptr<ResBlock> b1, b2;
};

}  // namespace

TEST_F(DdpTest, ActivationCheckpointingGivesIdenticalGradients) {
  at::manual_seed(41);
  auto a = std::make_shared<BlockNet>();
  at::manual_seed(41);
  auto b = std::make_shared<BlockNet>();
  a->to(test_device());
  b->to(test_device());
  a->b1->set_checkpointing(true);
  a->b2->set_checkpointing(true);
  ddp::DdpOptions o;
  o.bucket_mb = 0.001;  // a bucket per parameter or two: hooks inside the recomputation launch them
  o.first_bucket_mb = 0.001;
  ddp::DistributedDataParallel ea(a, world_, o), eb(b, world_, o);
  optim::Sgd oa({all_params(*a)}, 0.9, false, true), ob({all_params(*b)}, 0.9, false, true);
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = global_batch(step, 4 * n_);
    at::Tensor xs = x.narrow(0, rank_ * 4, 4), ys = y.narrow(0, rank_ * 4, 4);
    ea.before_backward();
    mse(a->forward(xs), ys).backward();
    ea.finalize_backward();
    eb.before_backward();
    mse(b->forward(xs), ys).backward();
    eb.finalize_backward();
    const auto ga = ea.gradients(), gb = eb.gradients();
    for (std::size_t i = 0; i < ga.size(); ++i) EXPECT_TRUE(at::equal(ga[i], gb[i])) << "gradient " << i << " step " << step;
    oa.step(0.05);
    ob.step(0.05);
    oa.zero_grad(false);
    ob.zero_grad(false);
  }
  EXPECT_TRUE(at::equal(flat_params(*a), flat_params(*b)));
}

// The perception model's losses are normalised by counts in the batch (centre cells, target boxes,
// labelled cells per class), which differ between the ranks' slices. With the mean over the
// replicas installed on the model (as the trainer does around each step), DDP's averaged gradient
// equals one process's on the whole batch, to fp32 summation order; without it, it does not.
TEST_F(DdpTest, BevLossNormalisersSpanTheWholeBatch) {
  // On GPUs the convolutions would otherwise run in TF32, whose rounding depends on the batch
  // split (measured: 3.4% of the largest gradient apart on 2 x H200).
  parallax::testing::NoTf32 exact;
  models::ModelConfig cfg;
  cfg.name = "bev";
  cfg.size = "tiny";
  const core::SceneSpec scene;  // bev/tiny's default scene
  at::manual_seed(3);
  auto ref = models::build_model(cfg, scene);
  at::manual_seed(3);
  auto net = models::build_model(cfg, scene);
  ref->to(test_device());
  net->to(test_device());
  const int64_t per_rank = 1;
  at::manual_seed(11);  // the same global batch on every rank
  core::TensorDict batch = ref->example_batch(per_rank * n_);
  for (auto& [k, v] : batch) v = v.to(test_device());

  const models::LossOutput ref_loss = ref->loss(batch, ref->forward(batch));
  ref_loss.total.backward();
  std::vector<at::Tensor> ref_grads;
  for (const auto& p : ref->parameters()) ref_grads.push_back(p.grad().reshape({-1}));
  const at::Tensor expected = at::cat(ref_grads);

  ddp::DistributedDataParallel engine(net, world_, {});
  core::TensorDict mine;
  for (const auto& [k, v] : batch) mine[k] = v.narrow(0, rank_ * per_rank, per_rank);
  auto ddp_gradient = [&](bool replica_mean) {
    if (replica_mean) {
      net->set_replica_mean([this](const at::Tensor& t) {
        at::Tensor x = t.detach().to(at::kFloat).clone();
        world_->all_reduce(x, comm::ReduceOp::kAvg);
        return x;
      });
    } else {
      net->set_replica_mean({});
    }
    for (auto& p : net->parameters()) p.mutable_grad() = at::Tensor();
    const models::LossOutput loss = net->loss(mine, net->forward(mine));
    engine.before_forward();
    engine.before_backward();
    loss.total.backward();
    engine.finalize_backward();
    at::Tensor mean_loss = loss.total.detach().clone();
    world_->all_reduce(mean_loss, comm::ReduceOp::kAvg);
    std::vector<at::Tensor> parts;
    for (const auto& g : engine.gradients()) parts.push_back(g.reshape({-1}).clone());
    return std::make_pair(at::cat(parts), mean_loss.item<double>());
  };
  // The engine's gradients follow named_parameters() order, like ref->parameters().
  const auto [with_mean, loss_with_mean] = ddp_gradient(true);
  EXPECT_NEAR(loss_with_mean, ref_loss.total.item<double>(), 1e-5 * std::abs(ref_loss.total.item<double>()));
  EXPECT_LT(max_rel(with_mean, expected), 1e-5);
  if (n_ > 1) {
    const auto [without, loss_without] = ddp_gradient(false);
    EXPECT_GT(max_rel(without, expected), 1e-3) << "the ranks' slices count the same: the test cannot fail";
  }
}
