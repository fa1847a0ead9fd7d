// DDP against a single-process reference on the same data and weights, under mpirun with 2 and 4
// ranks: MPI backend on CPU tensors, or (PARALLAX_TEST_BACKEND=nccl, label `cuda`) NCCL on one GPU
// per rank. fp32 throughout (TF32 off).
//
// Tolerances (tests/TOLERANCES.md). DDP's contract is the averaged gradient, so the tests compare
// gradients, evaluated by DDP and by the reference at the same parameters, at every step; the
// reference is re-synchronised to the replicas' parameters before each step. Trajectories are not
// compared: two fp32 runs that differ by rounding at step 1 drift apart through the loss's
// curvature and AdamW's sign-like update (an element whose gradient is within rounding of zero
// can move by up to 2 lr), which no bound on the arithmetic controls. Each gradient bound comes
// from a running error analysis of the fp32 forward and backward (rounding_bound() below): beside
// each exact value (float64), a bound on how far its fp32 evaluation can be, propagated layer by
// layer from the terms each sum actually adds, so cancellation cannot break it and no constant is
// tuned to a CPU. Where two computations differ only in the order of a sum (ring vs native
// all-reduce), the bound is that sum's alone. Across ranks, parameters must be bitwise identical
// after every step.
#include "parallel/ddp/ddp.h"
#include "comm/factory.h"
#include "comm/world.h"
#include "core/error.h"
#include "models/model.h"
#include "models/recompute.h"
#include "optim/grad_utils.h"
#include "optim/optimizer.h"
#include "tests/common/no_tf32.h"
#include "tests/common/tolerance.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>

using namespace parallax;
namespace comm = parallax::comm;
namespace ddp = parallax::parallel::ddp;
namespace tol = parallax::testing;

namespace {

std::string test_backend() {
  const char* b = std::getenv("PARALLAX_TEST_BACKEND");
  return b && *b ? b : "mpi";
}

c10::Device test_device() {
  return test_backend() == "nccl" ? *comm::World::current().device() : c10::Device(c10::kCPU);
}

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

at::Tensor mse(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).pow(2).mean();
}

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

at::Tensor flat_params(torch::nn::Module& m) {
  std::vector<at::Tensor> parts;
  for (const auto& p : m.parameters()) parts.push_back(p.detach().reshape({-1}));
  return at::cat(parts);
}

// dst's parameters := src's (bitwise), gradients cleared: the reference evaluates at the replicas'
// point.
void copy_params(torch::nn::Module& dst, torch::nn::Module& src) {
  at::NoGradGuard no_grad;
  const auto d = dst.parameters(), s = src.parameters();
  for (std::size_t i = 0; i < d.size(); ++i) {
    d[i].copy_(s[i]);
    d[i].mutable_grad() = at::Tensor();
  }
}

// Running error analysis (Higham, Accuracy and Stability, 3.3; tests/common/tolerance.h) of Net's
// fp32 loss and gradients on a batch (x, t) at net's parameters. In float64, the layers are run
// forward and backward by hand with, beside each exact value v, a bound E_v on how far the fp32
// evaluation of v can be from it; mag(v) = |v| + E_v bounds the computed value:
//   linear, K inputs + bias: E_z = E_in |W| + gamma_{K+1} (mag(in) |W| + |b|) (a sum of K + 1
//   terms in any order: any BLAS kernel, SIMD width, thread count or GPU);
//   gelu and gelu' as ATen computes them are within 16 u (|z| + E_z) and 16 u of exact at the
//   computed argument (its vectorised erf is Abramowitz-Stegun 7.1.26: 1.5e-7 = 2.5 u absolute,
//   plus a few roundings), and move by at most (|gelu'(z)| + 0.8 E_z) E_z and 0.8 E_z with it
//   (|gelu''| <= 0.8): E_a = (|gelu'(z)| + 0.8 E_z) E_z + 16 u mag(z); back through it,
//   E_dz = G E_da + mag(da) (0.8 E_z + 16 u) + u mag(da) G, with G = |gelu'(z)| + 0.8 E_z + 16 u;
//   the MSE: d = y - t (one rounding), dy = 2 d / N (three).
// A gradient is a sum over rows of terms (products of two such factors): `prop` bounds the error
// its terms carry in, `terms` is sum |terms|; the sum itself adds gamma_R terms for R rows, and an
// all-reduce over n ranks gamma_{n-1} of the ranks' partial sums, whose magnitudes add up to at
// most `terms`. Both evaluations carry `prop`, so two of them differ by at most
// 2 prop + gamma(their sums' roundings together) terms. Likewise the loss, a mean of N squares.
struct NetRounding {
  std::vector<at::Tensor> prop, terms;  // per parameter, net.parameters() order; zeros if unused
  double loss_prop = 0, loss_terms = 0;
};

NetRounding rounding_bound(Net& net, const at::Tensor& x_in, const at::Tensor& t_in) {
  constexpr double kL2 = 0.8, kAct = 16;
  const double u = tol::kFp32Unit;
  auto f64 = [](const at::Tensor& v) { return v.detach().cpu().to(at::kDouble); };
  auto d_gelu = [](const at::Tensor& z) {
    return 0.5 * (1 + at::erf(z * M_SQRT1_2)) +
           z * at::exp(-0.5 * z * z) * (0.5 * M_2_SQRTPI * M_SQRT1_2);
  };
  struct V {
    at::Tensor v, e;
    at::Tensor mag() const { return v.abs() + e; }
  };
  // in W^T + b, K = in's columns.
  auto linear = [&](const V& in, const at::Tensor& w, const at::Tensor& bias) {
    const double k = static_cast<double>(w.size(1)) + 1;
    return V{in.v.mm(w.t()) + bias,
             in.e.mm(w.abs().t()) + tol::gamma_k(k) * (in.mag().mm(w.abs().t()) + bias.abs())};
  };
  auto gelu = [&](const V& z) {
    return V{at::gelu(z.v), (d_gelu(z.v).abs() + kL2 * z.e) * z.e + kAct * u * z.mag()};
  };
  auto gelu_back = [&](const V& da, const V& z) {
    const at::Tensor g = d_gelu(z.v).abs() + kL2 * z.e + kAct * u;
    return V{da.v * d_gelu(z.v), g * da.e + da.mag() * (kL2 * z.e + kAct * u) + u * da.mag() * g};
  };
  // (left^T right): the error its terms carry in, and sum |terms|.
  auto outer = [](const V& left, const V& right) {
    return std::make_pair(left.e.t().mm(right.mag()) + left.mag().t().mm(right.e),
                          left.mag().t().mm(right.mag()));
  };

  const bool branch = net.use_branch && net.branch;
  const at::Tensor w1 = f64(net.fc1->weight), w2 = f64(net.fc2->weight), w3 = f64(net.fc3->weight);
  const V x{f64(x_in), at::zeros_like(f64(x_in))};
  const V z1 = linear(x, w1, f64(net.fc1->bias)), a1 = gelu(z1);
  const V z2 = linear(a1, w2, f64(net.fc2->bias)), a2 = gelu(z2);
  V y = linear(a2, w3, f64(net.fc3->bias));
  at::Tensor wb;
  if (branch) {
    wb = f64(net.branch->weight);
    const V yb = linear(a2, wb, f64(net.branch->bias));
    y = V{y.v + yb.v, y.e + yb.e + u * (y.mag() + yb.mag())};
  }
  const at::Tensor dv = y.v - f64(t_in);
  const V d{dv, y.e + u * (dv.abs() + y.e)};
  const double n_el = static_cast<double>(dv.numel());
  const V dy{2 * d.v / n_el, 2 * d.e / n_el + 3 * u * 2 * d.mag() / n_el};
  const at::Tensor w_back = branch ? w3.abs() + wb.abs() : w3.abs();
  const V da2{branch ? dy.v.mm(w3) + dy.v.mm(wb) : dy.v.mm(w3),
              dy.e.mm(w_back) + tol::gamma_k(branch ? 9 : 4) * dy.mag().mm(w_back)};
  const V dz2 = gelu_back(da2, z2);
  const V da1{dz2.v.mm(w2), dz2.e.mm(w2.abs()) + tol::gamma_k(48) * dz2.mag().mm(w2.abs())};
  const V dz1 = gelu_back(da1, z1);

  NetRounding r;
  auto add = [&r](const std::pair<at::Tensor, at::Tensor>& pt) {
    r.prop.push_back(pt.first);
    r.terms.push_back(pt.second);
  };
  auto add_bias = [&r](const V& g) {
    r.prop.push_back(g.e.sum(0));
    r.terms.push_back(g.mag().sum(0));
  };
  add(outer(dz1, x));
  add_bias(dz1);
  add(outer(dz2, a1));
  add_bias(dz2);
  add(outer(dy, a2));
  add_bias(dy);
  if (net.branch) {
    if (branch) {
      add(outer(dy, a2));
      add_bias(dy);
    } else {
      for (const auto& p : {net.branch->weight, net.branch->bias}) {
        r.prop.push_back(at::zeros(p.sizes(), at::kDouble));
        r.terms.push_back(at::zeros(p.sizes(), at::kDouble));
      }
    }
  }
  r.loss_prop = ((2 * d.mag() * d.e).sum() / n_el).item<double>();
  r.loss_terms = (d.mag().pow(2).sum() / n_el).item<double>();
  return r;
}

// Two evaluations of parameter k's gradient differ by at most 2 prop (none where both summed the
// same local gradients) + gamma(roundings) terms, `roundings` counting both evaluations' sums. The
// factor 1 + 1e-3 covers the products of rounding terms (relative size below gamma(512) < 4e-5
// here) that the first-order bookkeeping leaves out, e.g. the all-reduce's roundings of the
// partial sums' own errors.
at::Tensor gradient_bound(const NetRounding& r, std::size_t k, bool same_local, double roundings) {
  return ((same_local ? 0.0 : 2.0) * r.prop[k] + tol::gamma_k(roundings) * r.terms[k]) * (1 + 1e-3);
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

  // Each gradient of `net` (DDP's average, what the optimizer reads) is within gradient_bound() of
  // the reference's at the same parameters. The bound can fail: summing over the ranks without
  // dividing (n x the gradient, off by (n - 1) |g|) must exceed it somewhere in every tensor.
  void expect_gradients_within(Net& net, Net& ref, const NetRounding& r, bool same_local,
                               double roundings, const std::string& what) {
    const auto got = net.parameters(), want = ref.parameters();
    ASSERT_EQ(got.size(), r.prop.size());
    for (std::size_t k = 0; k < got.size(); ++k) {
      const at::Tensor g = got[k].grad(), w = want[k].grad();
      ASSERT_EQ(g.defined(), w.defined()) << what << ", parameter " << k;
      if (!w.defined()) continue;
      const at::Tensor bound = gradient_bound(r, k, same_local, roundings);
      EXPECT_TRUE(tol::within(g, w, bound)) << what << ", parameter " << k;
      if (n_ > 1) {
        EXPECT_TRUE((w.detach().cpu().to(at::kDouble).abs() * (n_ - 1) > bound).any().item<bool>())
            << what << ", parameter " << k << ": a sum in place of the mean would pass";
      }
    }
  }

  // Every rank holds bitwise the same parameters.
  void expect_replicas_identical(torch::nn::Module& m, int step) {
    at::Tensor mine = flat_params(m);
    at::Tensor root = mine.clone();
    world_->broadcast(root, 0);
    EXPECT_TRUE(at::equal(mine, root))
        << "rank " << rank_ << " diverged from rank 0 at step " << step;
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
  void train_side_by_side(Net& a, ddp::DistributedDataParallel& ea, Net& b,
                          ddp::DistributedDataParallel& eb, int steps, bool set_to_none) {
    optim::AdamW oa({all_params(a)}, 0.9, 0.999, 1e-8, true),
        ob({all_params(b)}, 0.9, 0.999, 1e-8, true);
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

  // The bounds assume fp32 arithmetic: no TF32 in cuBLAS or cuDNN on the NCCL runs.
  parallax::testing::NoTf32 no_tf32_;
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

INSTANTIATE_TEST_SUITE_P(Layouts, DdpModeTest,
                         ::testing::Values(ddp::BucketMode::kFlat, ddp::BucketMode::kGrouped),
                         [](const auto& info) { return std::string(ddp::to_string(info.param)); });

TEST_P(DdpModeTest, MatchesSingleProcessOnFullBatch) {
  const int64_t global_rows = 8 * n_;
  auto ref = make_net(7);
  auto net = make_net(7 + rank_);  // different init per rank: DDP must broadcast rank 0's weights
  ddp::DistributedDataParallel engine(net, world_, options());
  ASSERT_EQ(engine.mode(), GetParam());
  EXPECT_TRUE(at::equal(flat_params(*net), flat_params(*ref)))
      << "parameters not broadcast from rank 0";
  const at::Tensor start = flat_params(*net).clone();
  optim::AdamW opt({all_params(*net)}, 0.9, 0.999, 1e-8, true);
  for (int step = 0; step < 10; ++step) {
    auto [x, y] = global_batch(step, global_rows);
    // One process on the whole batch, at the replicas' parameters.
    copy_params(*ref, *net);
    at::Tensor ref_loss = mse(ref->forward(x), y);
    ref_loss.backward();
    const NetRounding r = rounding_bound(*ref, x, y);

    const int64_t rows = global_rows / n_;
    at::Tensor loss =
        mse(net->forward(x.narrow(0, rank_ * rows, rows)), y.narrow(0, rank_ * rows, rows));
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
      EXPECT_EQ(grads[k].is_alias_of(grads.front()), GetParam() == ddp::BucketMode::kFlat)
          << "step " << step;
    }
    // CPU: host clocks, read at finalize_backward(); backward did real work, waiting cannot be
    // negative. GPU: CUDA events read one step late without a sync (0 at the first step; the
    // loss's item() below makes each step's events complete before the next reads them).
    if (step > 0 || test_device().is_cpu()) {
      EXPECT_GT(engine.last_backward_ms(), 0.0);
    }
    EXPECT_GE(engine.last_exposed_comm_ms(), 0.0);
    // The reference sums R = global_rows rows, each rank R / n, and the average over the ranks
    // adds n - 1 roundings.
    expect_gradients_within(*net, *ref, r, false, global_rows + rows + n_ - 1,
                            "step " + std::to_string(step));
    opt.step(1e-2);
    // Both ways of clearing: zero in place (the bucket views stay), or set to None (the trainer's
    // way: the bucket copies the next first gradients in before its all-reduce and restores the
    // views).
    opt.zero_grad(/*set_to_none=*/step % 2 == 0);

    // The mean of the ranks' losses, the same way: a mean of N = 4 R non-negative squares (a
    // rounding each, the sum, the division) against the ranks' means of N / n, averaged.
    at::Tensor mean_loss = loss.detach().clone();
    world_->all_reduce(mean_loss, comm::ReduceOp::kAvg);
    const double squares = 4.0 * static_cast<double>(global_rows);
    EXPECT_NEAR(mean_loss.item<double>(), ref_loss.item<double>(),
                (2 * r.loss_prop +
                 tol::gamma_k((squares + 2) + (squares / n_ + 2) + n_ - 1) * r.loss_terms) *
                    (1 + 1e-3))
        << "step " << step;
    expect_replicas_identical(*net, step);
  }
  EXPECT_FALSE(at::equal(flat_params(*net), start)) << "the optimizer never moved the replicas";
  // The last step zeroed in place: the gradients are still there.
  for (const auto& g : engine.gradients()) EXPECT_TRUE(g.defined());
}

TEST_P(DdpModeTest, GradAccumulationEqualsLargerBatchAndSkipsCommunication) {
  const int k = 4;
  const int64_t micro_rows = 3;
  auto a = make_net(21), b = make_net(21);
  ddp::DistributedDataParallel ea(a, world_, options()), eb(b, world_, options());
  optim::Sgd oa({all_params(*a)}, 0.9, false, true);
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = global_batch(step, k * micro_rows * n_);
    const int64_t mine = k * micro_rows;
    at::Tensor xs = x.narrow(0, rank_ * mine, mine), ys = y.narrow(0, rank_ * mine, mine);
    copy_params(*b, *a);  // b evaluates at a's parameters
    // K micro-steps, communication only on the last.
    for (int m = 0; m < k; ++m) {
      const bool last = m == k - 1;
      const int64_t before = world_->stats().collectives;
      ea.set_require_sync(last);
      ea.before_backward();
      (mse(a->forward(xs.narrow(0, m * micro_rows, micro_rows)),
           ys.narrow(0, m * micro_rows, micro_rows)) /
       k)
          .backward();
      ea.finalize_backward();
      if (!last) {
        EXPECT_EQ(world_->stats().collectives, before)
            << "collective issued in no-sync micro-step " << m;
      }
      if (last) {
        EXPECT_GT(world_->stats().collectives, before);
      }
    }
    // One step on the K-times larger batch.
    eb.before_backward();
    mse(b->forward(xs), ys).backward();
    eb.finalize_backward();
    // On the global batch (the ranks' terms add up to its terms): a sums micro_rows rows per
    // micro-step and K - 1 accumulations (the / K is exact: K = 4), b sums `mine` rows, and each
    // average adds n - 1 roundings.
    const NetRounding r = rounding_bound(*a, x, y);
    expect_gradients_within(*a, *b, r, false, micro_rows + (k - 1) + mine + 2 * (n_ - 1),
                            "step " + std::to_string(step));
    oa.step(0.05);
    oa.zero_grad(false);
  }
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

// The ring and the native all-reduce average the same local gradients (a and b hold the same
// parameters and read the same rows, and the CPU and cuBLAS kernels are deterministic, as
// ActivationCheckpointingGivesIdenticalGradients relies on too): the averages differ only in the
// order of the sum over n ranks, each within gamma(n - 1) of the ranks' magnitudes.
TEST_F(DdpTest, RingAndNativeAverageToTheSameGradients) {
  auto a = make_net(31), b = make_net(31);
  ddp::DdpOptions ring;
  ring.algo = comm::AllReduceAlgo::kRing;
  ring.bucket_mb = 0.002;  // three buckets: {fc3}, {fc2}, {fc1}
  ring.first_bucket_mb = 0.0005;
  ddp::DdpOptions native = ring;
  native.algo = comm::AllReduceAlgo::kNative;
  ddp::DistributedDataParallel ea(a, world_, ring), eb(b, world_, native);
  EXPECT_GT(ea.buckets().size(), 2u);
  optim::AdamW oa({all_params(*a)}, 0.9, 0.999, 1e-8, true);
  for (int step = 0; step < 5; ++step) {
    auto [x, y] = global_batch(step, 4 * n_);
    at::Tensor xs = x.narrow(0, rank_ * 4, 4), ys = y.narrow(0, rank_ * 4, 4);
    copy_params(*b, *a);
    for (auto [net, eng] : {std::pair{a.get(), &ea}, std::pair{b.get(), &eb}}) {
      eng->before_backward();
      mse(net->forward(xs), ys).backward();
      eng->finalize_backward();
    }
    const NetRounding r = rounding_bound(*a, x, y);
    expect_gradients_within(*a, *b, r, true, 2 * (n_ - 1), "step " + std::to_string(step));
    oa.step(1e-2);
    oa.zero_grad(false);
  }
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
  EXPECT_EQ(e.mode(),
            test_backend() == "nccl" ? ddp::BucketMode::kGrouped : ddp::BucketMode::kFlat);
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

// reduce_dtype=bf16 (PyTorch's bf16_compress_hook): two engines at the same parameters on the same
// rows, one reducing in fp32 and one in bf16 through three buckets. The bf16 engine's averaged
// gradients are exactly bf16 values (the average is rounded to bf16, then cast back into the fp32
// bucket) and agree with the fp32 average to bf16's precision. With S = sum_r |g_r| over the ranks'
// local gradients (identical in both engines: same parameters, rows and deterministic kernels):
// each rank's cast to bf16 errs by u16 |g_r|; the sum adds n - 1 roundings (in bf16 on NCCL, in
// fp32 on MPI, which stages 16-bit reductions in fp32); the average's division and its cast to
// bf16 one more (NCCL: the bf16 average; MPI: the cast of the fp32 average). So the bf16 average
// is within (n + 1) u16 S / n of the exact one to first order, the fp32 average within
// (n - 1) u32 S / n; (n + 2) u16 S / n covers both and the second-order terms. A missing division
// or a wrong bucket is off by far more. The bf16 engine's replicas stay bitwise identical.
TEST_F(DdpTest, Bf16ReductionRoundsTheAverageToBf16) {
  auto a = make_net(41), b = make_net(41), local = make_net(41);
  ddp::DdpOptions fp32;
  fp32.bucket_mb = 0.002;  // three buckets: {fc3}, {fc2}, {fc1}
  fp32.first_bucket_mb = 0.0005;
  ddp::DdpOptions bf16 = fp32;
  bf16.reduce_dtype = at::kBFloat16;
  ddp::DistributedDataParallel ea(a, world_, fp32), eb(b, world_, bf16);
  ASSERT_GT(eb.buckets().size(), 2u);
  ASSERT_EQ(eb.mode(), ddp::BucketMode::kFlat);
  optim::AdamW oa({all_params(*a)}, 0.9, 0.999, 1e-8, true),
      ob({all_params(*b)}, 0.9, 0.999, 1e-8, true);
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = global_batch(step, 4 * n_);
    at::Tensor xs = x.narrow(0, rank_ * 4, 4), ys = y.narrow(0, rank_ * 4, 4);
    copy_params(*b, *a);
    copy_params(*local, *a);
    for (auto [net, eng] : {std::pair{a.get(), &ea}, std::pair{b.get(), &eb}}) {
      eng->before_backward();
      mse(net->forward(xs), ys).backward();
      eng->finalize_backward();
    }
    mse(local->forward(xs), ys).backward();  // this rank's gradient, not reduced
    const auto ga = ea.gradients(), gb = eb.gradients();
    std::vector<at::Tensor> gl;
    for (const auto& it : local->named_parameters()) gl.push_back(it.value().grad());
    ASSERT_EQ(ga.size(), gb.size());
    ASSERT_EQ(ga.size(), gl.size());
    for (std::size_t k = 0; k < ga.size(); ++k) {
      at::Tensor g32 = ga[k].cpu(), g16 = gb[k].cpu();
      ASSERT_EQ(g16.scalar_type(), at::kFloat);
      EXPECT_TRUE(at::equal(g16, g16.to(at::kBFloat16).to(at::kFloat)))
          << "step " << step << ", gradient " << k << ": not a bf16 value";
      EXPECT_FALSE(at::equal(g16, g32))
          << "step " << step << ", gradient " << k << ": not reduced in bf16";
      at::Tensor s = gl[k].detach().abs().to(at::kDouble);
      world_->all_reduce(s, comm::ReduceOp::kSum);
      const at::Tensor bound = s.cpu() * ((n_ + 2) * tol::kBf16Unit / n_);
      EXPECT_TRUE(tol::within(g16, g32, bound)) << "step " << step << ", gradient " << k;
      if (n_ > 1) {
        EXPECT_TRUE((g32.to(at::kDouble).abs() * (n_ - 1) > bound).any().item<bool>())
            << "step " << step << ", gradient " << k << ": a sum in place of the mean would pass";
      }
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
  const auto mixed =
      ddp::assign_buckets({100, 100, 100}, {at::kFloat, at::kBFloat16, at::kFloat}, 1000, 1000);
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
  optim::AdamW opt({all_params(*net)}, 0.9, 0.999, 1e-8, true);
  const at::Tensor branch_before = net->branch->weight.detach().clone();
  for (int step = 0; step < 4; ++step) {
    // The branch is used in steps 2 and 3 only, and then on every rank.
    ref->use_branch = net->use_branch = step >= 2;
    auto [x, y] = global_batch(step, 4 * n_);
    copy_params(*ref, *net);
    mse(ref->forward(x), y).backward();
    e.before_backward();
    mse(net->forward(x.narrow(0, rank_ * 4, 4)), y.narrow(0, rank_ * 4, 4)).backward();
    e.finalize_backward();
    if (step < 2) {
      EXPECT_FALSE(net->branch->weight.grad().defined()) << "globally unused: no gradient";
    }
    // As in MatchesSingleProcessOnFullBatch; an unused parameter has no gradient on either side.
    expect_gradients_within(*net, *ref, rounding_bound(*ref, x, y), false, 4 * n_ + 4 + n_ - 1,
                            "step " + std::to_string(step));
    opt.step(1e-2);
    opt.zero_grad(false);
    if (step < 2) {
      EXPECT_TRUE(at::equal(net->branch->weight.detach(), branch_before));
    }
  }
  EXPECT_FALSE(at::equal(net->branch->weight.detach(), branch_before))
      << "the branch never trained";
}

TEST_F(DdpTest, GlobalNormClippingEqualsSingleProcessClip) {
  auto ref = make_net(8), net = make_net(8);
  ddp::DistributedDataParallel e(net, world_, {});
  optim::Sgd opt({all_params(*net)}, 0.0, false, true);
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = global_batch(step, 4 * n_);
    const at::Tensor big = y * 50.0;  // large targets: the clip is active
    copy_params(*ref, *net);
    mse(ref->forward(x), big).backward();
    std::vector<at::Tensor> rg;
    for (auto& p : ref->parameters()) rg.push_back(p.grad());
    e.before_backward();
    mse(net->forward(x.narrow(0, rank_ * 4, 4)), big.narrow(0, rank_ * 4, 4)).backward();
    e.finalize_backward();
    // The gradients before clipping, as in MatchesSingleProcessOnFullBatch.
    const NetRounding r = rounding_bound(*ref, x, big);
    const double roundings = 4 * n_ + 4 + n_ - 1;
    expect_gradients_within(*net, *ref, r, false, roundings, "step " + std::to_string(step));
    // The norms: | ||a|| - ||b|| | <= ||a - b||_2 <= ||E||_2 (E: the elementwise bound above), plus
    // each norm's own rounding, gamma(P + 2T + 4) relative: P squares summed per tensor in any
    // order, T per-tensor norms squared and summed, the square roots.
    double e2 = 0, elements = 0;
    for (std::size_t k = 0; k < rg.size(); ++k) {
      e2 += gradient_bound(r, k, false, roundings).pow(2).sum().item<double>();
      elements += static_cast<double>(rg[k].numel());
    }
    const std::vector<at::Tensor> unclipped = [&] {
      std::vector<at::Tensor> c;
      for (const auto& g : e.gradients()) c.push_back(g.detach().clone());
      return c;
    }();
    const double ref_norm = optim::clip_grad_norm(rg, 0.5).item<double>();
    const double norm = optim::clip_grad_norm(e.gradients(), 0.5).item<double>();
    EXPECT_GT(ref_norm, 0.5);
    const double norm_bound =
        std::sqrt(e2) + tol::gamma_k(elements + 2.0 * rg.size() + 4) * (norm + ref_norm);
    EXPECT_NEAR(norm, ref_norm, norm_bound) << "step " << step;
    // A norm over the n replicated copies (sqrt(n) x) or over one rank's share would not pass.
    if (n_ > 1) {
      EXPECT_GT((std::sqrt(static_cast<double>(n_)) - 1) * ref_norm, norm_bound);
    }
    // The clip scaled each gradient by 0.5 / (norm + 1e-6), rounded: the coefficient (an add and a
    // divide; 1e-6 as a float is 1e-13 of the coefficient off) and the product: gamma(4).
    const double coef = 0.5 / (norm + 1e-6);
    const auto clipped = e.gradients();
    for (std::size_t k = 0; k < clipped.size(); ++k) {
      const at::Tensor want = unclipped[k].to(at::kDouble) * coef;
      EXPECT_TRUE(tol::within(clipped[k], want, want.abs() * tol::gamma_k(4)))
          << "step " << step << ", gradient " << k;
    }
    opt.step(0.1);
    opt.zero_grad(false);
  }
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
  EXPECT_EQ(scaler.scale(), 512.0);  // halved: exact
  EXPECT_TRUE(at::equal(flat_params(*net), before));
}

namespace {

struct ResBlock : models::RecomputableBlock {
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
  a->b1->set_recompute(true);
  a->b2->set_recompute(true);
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
    for (std::size_t i = 0; i < ga.size(); ++i)
      EXPECT_TRUE(at::equal(ga[i], gb[i])) << "gradient " << i << " step " << step;
    oa.step(0.05);
    ob.step(0.05);
    oa.zero_grad(false);
    ob.zero_grad(false);
  }
  EXPECT_TRUE(at::equal(flat_params(*a), flat_params(*b)));
}

namespace {

// Check 2's ingredients per BEV loss term (the test below): {K_whole, the elements summed over the
// whole batch; the term's perturbation c u sum mu / D}, from the whole batch's predictions, its
// targets and its recorded counts (class counts, heatmap positives, boxes).
std::map<std::string, std::pair<double, double>> bev_loss_term_bounds(
    const core::TensorDict& whole_pred, const core::TensorDict& batch,
    const std::vector<at::Tensor>& whole_counts) {
  const double u = tol::kFp32Unit;
  const at::Tensor logits = whole_pred.at("bev_logits").to(at::kDouble),
                   heat = whole_pred.at("heatmap").to(at::kDouble);
  const at::Tensor boxes = batch.at("boxes").to(at::kDouble);
  const double classes = static_cast<double>(logits.size(1));
  const double seg_pert = 32 * u * (3 * logits.abs().max().item<double>() + std::log(classes) + 1);
  // The focal and L1 normalisers: the whole batch's counts (recorded above), at least 1.
  const double heat_pert = 64 * u * (heat.abs() + 1).sum().item<double>() /
                           std::max(1.0, whole_counts[1].item<double>());
  const double box_pert =
      32 * u *
      (4 + boxes.select(-1, 2).abs() + boxes.narrow(-1, 3, 3).clamp_min(1e-3).log().abs().sum(-1))
          .sum()
          .item<double>() /
      std::max(1.0, whole_counts[2].item<double>());
  return {
      {"seg_ce", {static_cast<double>(logits.numel()) / classes, seg_pert}},
      {"heatmap_focal", {static_cast<double>(heat.numel()) + 1, heat_pert}},
      {"box_l1", {static_cast<double>(boxes.numel()) + 1, box_pert}},  // 9 per box >= 8 codes + 1
  };
}

// One forward, loss and DDP backward of `net` on this rank's `mine`, with the mean over the
// replicas installed on the model (`replica_mean`) or without: the averaged gradient, the loss
// terms averaged over the ranks, and what the replica mean returned.
struct DdpRun {
  at::Tensor grad;
  std::map<std::string, double> terms;  // averaged over the ranks
  std::vector<at::Tensor> normalisers;  // what the replica mean returned
};
DdpRun bev_ddp_run(models::Model& net, ddp::DistributedDataParallel& engine,
                   comm::Communicator& world, const core::TensorDict& mine, bool replica_mean) {
  DdpRun run;
  if (replica_mean) {
    net.set_replica_mean([&](const at::Tensor& t) {
      at::Tensor x = t.detach().to(at::kFloat).clone();
      world.all_reduce(x, comm::ReduceOp::kAvg);
      run.normalisers.push_back(x.clone());
      return x;
    });
  } else {
    net.set_replica_mean({});
  }
  for (auto& p : net.parameters()) p.mutable_grad() = at::Tensor();
  const models::LossOutput loss = net.loss(mine, net.forward(mine));
  engine.before_forward();
  engine.before_backward();
  loss.total.backward();
  engine.finalize_backward();
  for (const auto& [k, v] : loss.terms) {
    at::Tensor m = v.detach().to(at::kDouble).clone();
    world.all_reduce(m, comm::ReduceOp::kAvg);
    run.terms[k] = m.item<double>();
  }
  std::vector<at::Tensor> parts;
  for (const auto& g : engine.gradients()) parts.push_back(g.reshape({-1}).clone());
  run.grad = at::cat(parts);
  net.set_replica_mean({});  // the lambda refers to `run`
  return run;
}

}  // namespace

// The perception model's losses are normalised by counts in the batch (centre cells, target boxes,
// labelled cells per class), which differ between the ranks' slices. With the mean over the
// replicas installed on the model (as the trainer does around each step), DDP computes one
// process's gradient on the whole batch; without it, it does not. Three checks:
// 1. Exact: the normalisers DDP's replica mean returns are the whole batch's counts / n, bitwise
//    (sums of integer counts are exact in fp32, and both divide the same value by n).
// 2. The loss terms: each rank's, averaged, against one process's on the whole batch, on the same
//    predictions (each slice predicted as the rank that owns it predicts it). This catches a
//    normaliser the loss counts without the replica mean. Each term is (sum of K non-negative
//    per-element terms) / (the same normaliser D): the sums differ by their orders, gamma(K) of
//    their value each (no cancellation), the per-rank division and the average by n + 1 more
//    roundings, and the per-element terms by at most c u mu_i (the same inputs through the same
//    elementwise ops, whose transcendental parts ATen may vectorise on one side and not on the
//    other, 2 ulp apart): cross-entropy mu = w_y (3 max|x| + ln C + 1), c = 32 (log_softmax:
//    an exp, a sum over C classes, a log); focal mu = |x| + 1, c = 64 (sigmoid, two powers, the
//    target's exp, log_sigmoid: 38 u counted); L1 mu = 4 + |z| + sum |log size| per box, c = 32
//    (the codes' log, sin and cos). Sum_i w_y = D for the cross-entropy; D is the count otherwise.
// 3. The gradient: DDP's average against the exact mean of the ranks' gradients, each computed on
//    its own rank by a second model with the whole batch's normalisers (the same computation as
//    DDP's local gradient, so the two differ only by the all-reduce: gamma(n) of sum_r |g_r| / n).
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
  // Odd slices count very differently (one class everywhere, one box), so a count taken per rank
  // shows in every loss term.
  for (int r = 1; r < n_; r += 2) {
    batch.at("bev_semantics").narrow(0, r * per_rank, per_rank).fill_(0);
    at::Tensor boxes = batch.at("boxes").narrow(0, r * per_rank, per_rank);
    boxes.narrow(1, 1, boxes.size(1) - 1).select(-1, 8).fill_(0);  // visibility 0: not a target
  }
  for (auto& [k, v] : batch) v = v.to(test_device());
  auto slice = [&](int r) {
    core::TensorDict s;
    for (const auto& [k, v] : batch) s[k] = v.narrow(0, r * per_rank, per_rank);
    return s;
  };
  const core::TensorDict mine = slice(rank_);

  // The whole batch: predictions slice by slice, the loss over all of them, its counts recorded.
  std::vector<at::Tensor> whole_counts;
  ref->set_replica_mean([&](const at::Tensor& t) {
    whole_counts.push_back(t.detach().clone());
    return t;  // this process alone: the whole batch's counts
  });
  core::TensorDict whole_pred;
  {
    std::map<std::string, std::vector<at::Tensor>> parts;
    for (int r = 0; r < n_; ++r) {
      for (const auto& [k, v] : ref->forward(slice(r))) parts[k].push_back(v.detach());
    }
    for (auto& [k, v] : parts) whole_pred[k] = at::cat(v);
  }
  const models::LossOutput whole = ref->loss(batch, whole_pred);
  ASSERT_EQ(whole_counts.size(), 3u) << "class counts, heatmap positives, boxes";

  // This rank's gradient with the whole batch's normalisers, then the exact mean over the ranks.
  std::size_t call = 0;
  ref->set_replica_mean([&](const at::Tensor& t) { return whole_counts.at(call++) / n_; });
  for (auto& p : ref->parameters()) p.mutable_grad() = at::Tensor();
  ref->loss(mine, ref->forward(mine)).total.backward();
  std::vector<at::Tensor> local;
  for (const auto& p : ref->parameters()) local.push_back(p.grad().reshape({-1}).to(at::kDouble));
  at::Tensor mean_grad = at::cat(local), abs_mean = mean_grad.abs();
  world_->all_reduce(mean_grad, comm::ReduceOp::kSum);
  world_->all_reduce(abs_mean, comm::ReduceOp::kSum);
  mean_grad = mean_grad.cpu() / n_;
  abs_mean = abs_mean.cpu() / n_;
  at::Tensor grad_bound = abs_mean * tol::gamma_k(n_);
  if (test_device().is_cuda()) {
    // On GPUs the local gradient itself is not deterministic (atomic adds in the grid-sampling
    // backward, cuDNN's algorithm choice), so `ref` and `net` differ before any reduction. Kind N
    // (tests/TOLERANCES.md): 1e-4 relative plus 1e-7 of the largest magnitude; measured 1.4e-5
    // relative on 2 x H200 (2026-11-24), while per-rank normalisers (the check below) are off by
    // far more.
    grad_bound = grad_bound + 1e-4 * abs_mean + 1e-7 * abs_mean.max();
  }

  ddp::DistributedDataParallel engine(net, world_, {});
  auto ddp_run = [&](bool replica_mean) {
    return bev_ddp_run(*net, engine, *world_, mine, replica_mean);
  };

  // Check 2's bounds, per term: gamma(K_whole + K_rank + n + 4) of the value, plus c u sum mu / D.
  const std::map<std::string, std::pair<double, double>> term_bound =
      bev_loss_term_bounds(whole_pred, batch, whole_counts);
  auto term_gap = [&](const DdpRun& run, const std::string& k) {
    const double a = run.terms.at(k), b = whole.terms.at(k).item<double>();
    const auto [kw, pert] = term_bound.at(k);
    const double bound =
        tol::gamma_k(kw + kw / n_ + n_ + 4) * std::max(std::abs(a), std::abs(b)) + pert;
    return std::make_pair(std::abs(a - b), bound);
  };

  const DdpRun with_mean = ddp_run(true);
  ASSERT_EQ(with_mean.normalisers.size(), whole_counts.size());
  for (std::size_t i = 0; i < whole_counts.size(); ++i) {
    EXPECT_TRUE(at::equal(with_mean.normalisers[i], whole_counts[i] / n_)) << "normaliser " << i;
  }
  for (const auto& [k, kb] : term_bound) {
    const auto [gap, bound] = term_gap(with_mean, k);
    EXPECT_LE(gap, bound) << k;
  }
  EXPECT_TRUE(tol::within(with_mean.grad, mean_grad, grad_bound));
  if (n_ > 1) {
    // Without the replica mean the ranks normalise by their own counts: the test can fail.
    const DdpRun without = ddp_run(false);
    EXPECT_FALSE(tol::within(without.grad, mean_grad, grad_bound))
        << "the ranks' slices count the same";
    for (const auto& [k, kb] : term_bound) {
      const auto [gap, bound] = term_gap(without, k);
      EXPECT_GT(gap, bound) << k << ": a per-rank count would pass";
    }
  }
}
