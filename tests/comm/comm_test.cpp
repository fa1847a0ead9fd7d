// Multi-rank tests of the Communicator, run by every rank of an mpirun (mpi, nccl) or
// torchrun-style (gloo) launch with 2 or 4 ranks. Every expected value is computed independently on
// each rank from the other ranks' inputs, which every rank regenerates from their seeds.
#include "comm/topology.h"
#include "core/error.h"
#include "tests/comm/comm_test_util.h"

#include <gtest/gtest.h>

#include <map>

using namespace parallax;
using namespace parallax::comm;
using namespace parallax::comm::testing;

namespace {

const std::vector<c10::ScalarType> kDtypes = {at::kFloat, at::kBFloat16, at::kHalf, at::kLong};
const std::vector<ReduceOp> kOps = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin};
const std::vector<AllReduceAlgo> kAlgos = {AllReduceAlgo::kNative, AllReduceAlgo::kRing};

// Unit roundoff of the dtype the reduction rounds to.
double roundoff(c10::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return std::ldexp(1.0, -24);
    case at::kBFloat16:
      return std::ldexp(1.0, -8);
    case at::kHalf:
      return std::ldexp(1.0, -11);
    default:
      return 0.0;
  }
}

struct Reference {
  at::Tensor value;    // float64
  at::Tensor abs_sum;  // float64, sum over ranks of |x|
};

Reference reduce_reference(const std::vector<at::Tensor>& inputs, ReduceOp op,
                           c10::ScalarType dtype) {
  const int n = static_cast<int>(inputs.size());
  at::Tensor acc = inputs[0].to(at::kDouble).clone(), abs = inputs[0].to(at::kDouble).abs();
  for (int q = 1; q < n; ++q) {
    at::Tensor x = inputs[static_cast<size_t>(q)].to(at::kDouble);
    abs += x.abs();
    if (op == ReduceOp::kMax) {
      acc = at::maximum(acc, x);
    } else if (op == ReduceOp::kMin) {
      acc = at::minimum(acc, x);
    } else {
      acc += x;
    }
  }
  if (op == ReduceOp::kAvg) acc = at::isIntegralType(dtype, false) ? (acc / n).trunc() : acc / n;
  return {acc, abs};
}

// A reduction over n ranks rounds at most n times (n-1 partial sums in the dtype when the backend
// sums in it, one final rounding, one division for avg), each time by at most the unit roundoff of
// a partial sum, and every partial sum is bounded by sum_q |x_q|: |error| <= (n+2) u sum_q |x_q|.
// max/min and integer reductions are exact.
void expect_reduced(const at::Tensor& got, const Reference& ref, ReduceOp op, c10::ScalarType dtype,
                    int n, const std::string& what) {
  ASSERT_EQ(got.numel(), ref.value.numel()) << what;
  if (got.numel() == 0) return;
  at::Tensor g = got.cpu().to(at::kDouble).view({-1});
  at::Tensor v = ref.value.view({-1});
  const bool exact =
      op == ReduceOp::kMax || op == ReduceOp::kMin || at::isIntegralType(dtype, false);
  at::Tensor tol = exact ? at::zeros_like(v) : ref.abs_sum.view({-1}) * ((n + 2) * roundoff(dtype));
  at::Tensor bad = (g - v).abs() > tol;
  EXPECT_FALSE(bad.any().item<bool>())
      << what << ": " << bad.sum().item<int64_t>() << " of " << g.numel()
      << " elements off, max |diff| " << (g - v).abs().max().item<double>();
}

std::string case_name(const char* op, c10::ScalarType dt, ReduceOp r, int64_t numel,
                      const char* algo = "") {
  return fmt::format("{}({}, {}, {} elements{}{})", op, c10::toString(dt), to_string(r), numel,
                     *algo ? ", " : "", algo);
}

std::vector<int64_t> sizes_for(int n) {
  return {0, 1, 7, 1000 * n + 3, 4096};
}

}  // namespace

TEST(AllReduceTest, MatchesReferenceForEveryOpDtypeSizeAndAlgorithm) {
  auto& c = world_comm();
  const int n = c->size(), r = c->rank();
  uint64_t id = 100;
  for (auto algo : kAlgos) {
    for (auto dt : kDtypes) {
      for (auto op : kOps) {
        for (int64_t numel : sizes_for(n)) {
          ++id;
          std::vector<at::Tensor> inputs;
          for (int q = 0; q < n; ++q) inputs.push_back(random_input(numel, dt, seed_of(id, q)));
          at::Tensor t = inputs[static_cast<size_t>(r)].clone().to(test_device());
          c->all_reduce(t, op, algo);
          expect_reduced(t, reduce_reference(inputs, op, dt), op, dt, n,
                         case_name("all_reduce", dt, op, numel, to_string(algo)));
        }
      }
    }
  }
}

TEST(AllReduceTest, CoalescedReducesEachTensorInPlace) {
  auto& c = world_comm();
  const int n = c->size(), r = c->rank();
  // Several shapes (one empty), a strided view and, for the mixed case, a second dtype: each
  // tensor is reduced in place, as one all_reduce of it would be.
  for (bool mixed : {false, true}) {
    for (auto op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      const std::vector<int64_t> numels = {7, 0, 1000 * n + 3, 4096};
      std::vector<std::vector<at::Tensor>> inputs(numels.size());
      std::vector<at::Tensor> mine;
      for (std::size_t k = 0; k < numels.size(); ++k) {
        const auto dt = mixed && k % 2 == 1 ? at::kBFloat16 : at::kFloat;
        for (int q = 0; q < n; ++q)
          inputs[k].push_back(random_input(numels[k], dt, seed_of(900 + k + (mixed ? 50 : 0), q)));
        mine.push_back(inputs[k][static_cast<size_t>(r)].clone().to(test_device()));
      }
      // A transposed (non-contiguous, but dense) matrix and a strided slice.
      at::Tensor base =
          at::arange(24, at::TensorOptions().dtype(at::kFloat)).view({4, 6}) * (r + 1);
      at::Tensor dense_t = base.clone().to(test_device()).t();
      at::Tensor holder = at::zeros({10}, at::TensorOptions().device(test_device()));
      at::Tensor strided = holder.slice(0, 0, 10, 2);
      strided.fill_(static_cast<double>(r + 1));
      std::vector<at::Tensor> all = mine;
      all.push_back(dense_t);
      all.push_back(strided);
      const int64_t before = c->stats().collectives;
      auto work = c->all_reduce_coalesced_async(all, op);
      work->wait();
      EXPECT_GT(c->stats().collectives, before);
      if (c->backend() == "nccl" && !mixed) {
        // One grouped op: one sequence number and one flight-recorder entry for all six tensors.
        EXPECT_EQ(c->stats().collectives, before + 1);
        const auto entries = c->flight_entries();
        ASSERT_FALSE(entries.empty());
        EXPECT_NE(entries.back().detail.find("6 tensors"), std::string::npos)
            << entries.back().detail;
        int64_t total = 0;
        for (const auto& t : all) total += t.numel();
        EXPECT_EQ(entries.back().shape, std::vector<int64_t>({total}));
      }
      for (std::size_t k = 0; k < numels.size(); ++k) {
        const auto dt = inputs[k][0].scalar_type();
        expect_reduced(mine[k], reduce_reference(inputs[k], op, dt), op, dt, n,
                       fmt::format("coalesced tensor {} ({}mixed)", k, mixed ? "" : "not "));
      }
      const double ranks_sum = n * (n + 1) / 2.0;
      const double scale = op == ReduceOp::kAvg ? ranks_sum / n : ranks_sum;
      at::Tensor want_t =
          (at::arange(24, at::TensorOptions().dtype(at::kFloat)).view({4, 6}) * scale).t();
      // Exact: sums of small integers (at most 23 n (n + 1) / 2 < 2^24), and an average
      // x (n + 1) / 2 that a float holds exactly, whatever the order or the rounding.
      EXPECT_TRUE(at::equal(dense_t.cpu(), want_t)) << "transposed view";
      at::Tensor h = holder.cpu();
      for (int64_t i = 0; i < 10; ++i) {
        EXPECT_EQ(h[i].item<double>(), i % 2 == 0 ? scale : 0.0) << "strided view, element " << i;
      }
    }
  }
}

// all_reduce_compressed: each rank's fp32 tensor travels as its bf16/fp16 copy. The result is the
// reduction of those copies (the reference reduces the inputs rounded to the wire dtype, within
// the wire dtype's error bound), every element is representable in the wire dtype, and the call
// counts as one collective of wire-dtype bytes.
TEST(AllReduceTest, CompressedReducesTheWireCopies) {
  auto& c = world_comm();
  const int n = c->size(), r = c->rank();
  const int64_t numel = 1000 * n + 5;
  for (auto wire : {at::kBFloat16, at::kHalf}) {
    for (auto algo : kAlgos) {
      for (auto op : kOps) {
        const uint64_t id = 1300 + 10 * (wire == at::kHalf) + 4 * (algo == AllReduceAlgo::kRing) +
                            static_cast<int>(op);
        std::vector<at::Tensor> inputs, rounded;
        for (int q = 0; q < n; ++q) {
          inputs.push_back(random_input(numel, at::kFloat, seed_of(id, q)));
          rounded.push_back(inputs.back().to(wire));
        }
        // A shaped tensor: the copy back keeps its shape.
        at::Tensor mine = inputs[static_cast<size_t>(r)].to(test_device()).view({-1, 1}).clone();
        const std::string what = fmt::format("compressed all_reduce through {} ({}, {})",
                                             c10::toString(wire), to_string(op), to_string(algo));
        const int64_t before = c->stats().collectives;
        c->all_reduce_compressed(mine, op, wire, algo);
        EXPECT_EQ(c->stats().collectives, before + 1) << what;
        EXPECT_EQ(mine.scalar_type(), at::kFloat) << what;
        expect_reduced(mine, reduce_reference(rounded, op, wire), op, wire, n, what);
        at::Tensor got = mine.cpu();
        EXPECT_TRUE(at::equal(got, got.to(wire).to(at::kFloat)))
            << what << ": not rounded to the wire dtype";
        const auto entries = c->flight_entries();
        ASSERT_FALSE(entries.empty());
        EXPECT_EQ(entries.back().bytes, numel * 2) << what << ": the entry records the wire bytes";
      }
    }
  }
  // The tensor's own dtype is a plain all-reduce; a wider wire or an integer tensor is refused.
  at::Tensor x =
      at::full({8}, static_cast<double>(r + 1), at::TensorOptions().device(test_device()));
  c->all_reduce_compressed(x, ReduceOp::kSum, at::kFloat, AllReduceAlgo::kNative);
  EXPECT_TRUE(at::equal(x.cpu(), at::full({8}, n * (n + 1) / 2.0))) << x.cpu();
  at::Tensor half = at::ones({8}, at::TensorOptions().dtype(at::kBFloat16).device(test_device()));
  at::Tensor ints = at::ones({8}, at::TensorOptions().dtype(at::kLong).device(test_device()));
  for (at::Tensor* bad : {&half, &ints}) {
    try {
      c->all_reduce_compressed(*bad, ReduceOp::kSum, bad == &half ? at::kFloat : at::kHalf,
                               AllReduceAlgo::kNative);
      FAIL() << "accepted a " << c10::toString(bad->scalar_type()) << " tensor";
    } catch (const CommError& e) {
      EXPECT_NE(std::string(e.what()).find("rank " + std::to_string(r)), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("no wider than"), std::string::npos) << e.what();
    }
  }
}

TEST(AllReduceTest, FourRankFixtureAveragesToKnownValues) {
  auto& c = world_comm();
  if (c->size() != 4) GTEST_SKIP() << "needs 4 ranks";
  const float rows[4][4] = {{1, 2, 3, 4}, {5, 6, 7, 8}, {0.5f, 1.5f, 2.5f, 3.5f}, {2, 3, 4, 5}};
  const at::Tensor expected = at::tensor({2.125f, 3.125f, 4.125f, 5.125f});
  for (auto algo : kAlgos) {
    at::Tensor t =
        at::tensor(std::vector<float>(rows[c->rank()], rows[c->rank()] + 4)).to(test_device());
    c->all_reduce(t, ReduceOp::kAvg, algo);
    EXPECT_TRUE(at::equal(t.cpu(), expected)) << to_string(algo) << ": " << t.cpu();
  }
}

TEST(AllReduceTest, RingMatchesNativeAndSendsTwoNMinusOneOverNOfTheBytes) {
  CommOptions o = test_options();
  o.ring_chunk_bytes = 1024;  // many pipelined columns per segment
  CommPtr c = make_world_communicator(test_backend(), o);
  const int n = c->size(), r = c->rank();
  for (int64_t m : {int64_t(64 * 1024) * n, int64_t(10007)}) {
    std::vector<at::Tensor> inputs;
    for (int q = 0; q < n; ++q) inputs.push_back(random_input(m, at::kFloat, seed_of(7000 + m, q)));
    at::Tensor ring = inputs[static_cast<size_t>(r)].clone().to(test_device());
    at::Tensor native = ring.clone();
    const int64_t before = c->stats().bytes_sent;
    c->all_reduce(ring, ReduceOp::kSum, AllReduceAlgo::kRing);
    const int64_t sent = c->stats().bytes_sent - before;
    c->all_reduce(native, ReduceOp::kSum, AllReduceAlgo::kNative);
    if (m % n == 0) {
      EXPECT_EQ(sent, 2 * (n - 1) * m * 4 / n) << "ring bytes for M = " << m * 4 << " bytes";
    } else {
      // Segments differ by one element: between 2(N-1) floor(M/N) and 2(N-1) ceil(M/N) elements.
      EXPECT_GE(sent, 2 * (n - 1) * (m / n) * 4);
      EXPECT_LE(sent, 2 * (n - 1) * (m / n + 1) * 4);
    }
    Reference ref = reduce_reference(inputs, ReduceOp::kSum, at::kFloat);
    expect_reduced(ring, ref, ReduceOp::kSum, at::kFloat, n, "ring");
    expect_reduced(native, ref, ReduceOp::kSum, at::kFloat, n, "native");
    // Ring and native differ only by summation order.
    at::Tensor tol = ref.abs_sum * (2 * (n + 2) * roundoff(at::kFloat));
    EXPECT_TRUE(((ring.cpu().to(at::kDouble) - native.cpu().to(at::kDouble)).abs() <= tol)
                    .all()
                    .item<bool>());
  }
}

TEST(AllReduceTest, ConcurrentAsyncOpsCompleteInAnyWaitOrder) {
  auto& c = world_comm();
  const int n = c->size(), r = c->rank();
  std::vector<std::vector<at::Tensor>> inputs;
  std::vector<at::Tensor> tensors;
  std::vector<WorkPtr> works;
  for (int k = 0; k < 6; ++k) {
    const int64_t m = 3000 + 1001 * k;
    inputs.emplace_back();
    for (int q = 0; q < n; ++q)
      inputs.back().push_back(random_input(m, at::kFloat, seed_of(9000 + k, q)));
    tensors.push_back(inputs.back()[static_cast<size_t>(r)].clone().to(test_device()));
    works.push_back(c->all_reduce_async(tensors.back(), ReduceOp::kSum,
                                        k % 2 ? AllReduceAlgo::kRing : AllReduceAlgo::kNative));
  }
  // Even ranks wait first-to-last, odd ranks last-to-first: pending rings must progress meanwhile.
  for (int i = 0; i < 6; ++i) works[static_cast<size_t>(r % 2 ? 5 - i : i)]->wait();
  for (int k = 0; k < 6; ++k) {
    EXPECT_TRUE(works[static_cast<size_t>(k)]->is_completed());
    expect_reduced(tensors[static_cast<size_t>(k)],
                   reduce_reference(inputs[static_cast<size_t>(k)], ReduceOp::kSum, at::kFloat),
                   ReduceOp::kSum, at::kFloat, n, fmt::format("async op {}", k));
  }
}

TEST(ReduceScatterTest, EachRankGetsItsChunkOfTheReduction) {
  auto& c = world_comm();
  const int n = c->size(), r = c->rank();
  uint64_t id = 2000;
  for (auto dt : kDtypes) {
    for (auto op : kOps) {
      for (int64_t m : sizes_for(n)) {
        ++id;
        std::vector<at::Tensor> inputs;
        for (int q = 0; q < n; ++q) inputs.push_back(random_input(m, dt, seed_of(id, q)));
        at::Tensor in = inputs[static_cast<size_t>(r)].to(test_device());
        at::Tensor out = at::empty({chunk_numel(m, n, r)}, in.options());
        c->reduce_scatter(in, out, op);
        Reference full = reduce_reference(inputs, op, dt);
        Reference mine{full.value.narrow(0, chunk_offset(m, n, r), chunk_numel(m, n, r)),
                       full.abs_sum.narrow(0, chunk_offset(m, n, r), chunk_numel(m, n, r))};
        expect_reduced(out, mine, op, dt, n, case_name("reduce_scatter", dt, op, m));
      }
    }
  }
}

// Chunk shapes are checked before anything is sent, on every rank, with the numbers in the message.
TEST(ReduceScatterTest, WrongChunkShapeOrDtypeIsAnErrorNamingBoth) {
  auto& c = world_comm();
  const int n = c->size(), r = c->rank();
  const auto opts = at::TensorOptions().device(test_device());
  at::Tensor whole = at::ones({10 * n + 1}, opts);  // rank 0's chunk is one longer
  at::Tensor bad = at::empty({5}, opts),
             other_dtype = at::empty({10 + (r == 0 ? 1 : 0)}, opts.dtype(at::kDouble));
  std::string message;
  try {
    c->reduce_scatter(whole, bad, ReduceOp::kSum);
  } catch (const CommError& e) {
    message = e.what();
  }
  EXPECT_NE(message.find(fmt::format(
                "reduce_scatter on group 'world' (rank {}): output has 5 elements but chunk "
                "{} of the {}-element input over {} ranks has {}",
                r, r, 10 * n + 1, n, 10 + (r == 0 ? 1 : 0))),
            std::string::npos)
      << message;
  EXPECT_THROW(c->reduce_scatter(whole, other_dtype, ReduceOp::kSum), CommError);
  message.clear();
  try {
    c->all_gather(bad, whole);
  } catch (const CommError& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("all_gather on group 'world'"), std::string::npos) << message;
  EXPECT_NE(message.find("input has 5 elements but chunk"), std::string::npos) << message;
  // Nothing was issued: the group still works.
  at::Tensor t = at::ones({3}, opts);
  c->all_reduce(t, ReduceOp::kSum);
  EXPECT_TRUE(at::equal(t.cpu(), at::full({3}, double(n), at::kFloat)));
}

TEST(AllGatherTest, FlatOutputHoldsEveryRanksChunkInRankOrder) {
  auto& c = world_comm();
  const int n = c->size(), r = c->rank();
  uint64_t id = 3000;
  for (auto dt : kDtypes) {
    for (int64_t total : {int64_t(0), int64_t(1), int64_t(7), int64_t(1000 * n + 3)}) {
      ++id;
      std::vector<at::Tensor> inputs;
      for (int q = 0; q < n; ++q)
        inputs.push_back(random_input(chunk_numel(total, n, q), dt, seed_of(id, q)));
      at::Tensor in = inputs[static_cast<size_t>(r)].to(test_device());
      at::Tensor out = at::full({total}, 3, in.options());
      c->all_gather(in, out);
      EXPECT_TRUE(at::equal(out.cpu(), at::cat(inputs)))
          << "all_gather " << c10::toString(dt) << " of " << total;
    }
  }
}

TEST(AllGatherTest, InputMayBeItsOwnChunkOfTheOutput) {
  auto& c = world_comm();
  const int n = c->size(), r = c->rank();
  const int64_t total = 100 * n + 1;
  std::vector<at::Tensor> inputs;
  for (int q = 0; q < n; ++q)
    inputs.push_back(random_input(chunk_numel(total, n, q), at::kFloat, seed_of(3500, q)));
  at::Tensor out = at::full({total}, -1.0f, at::TensorOptions().device(test_device()));
  at::Tensor in = out.narrow(0, chunk_offset(total, n, r), chunk_numel(total, n, r));
  in.copy_(inputs[static_cast<size_t>(r)]);
  c->all_gather(in, out);
  EXPECT_TRUE(at::equal(out.cpu(), at::cat(inputs)));
}

TEST(AllGatherTest, ListFormGivesEachRankItsOwnShape) {
  auto& c = world_comm();
  const int n = c->size(), r = c->rank();
  std::vector<at::Tensor> inputs, outputs;
  for (int q = 0; q < n; ++q) {
    inputs.push_back(random_input((q + 1) * 3, at::kBFloat16, seed_of(3700, q)).view({q + 1, 3}));
    outputs.push_back(
        at::empty({q + 1, 3}, at::TensorOptions().dtype(at::kBFloat16).device(test_device())));
  }
  at::Tensor in = inputs[static_cast<size_t>(r)].to(test_device());
  c->all_gather(in, outputs);
  for (int q = 0; q < n; ++q) {
    EXPECT_TRUE(at::equal(outputs[static_cast<size_t>(q)].cpu(), inputs[static_cast<size_t>(q)]))
        << "rank " << q << "'s tensor";
  }
}

TEST(BroadcastTest, EveryRootDeliversItsTensor) {
  auto& c = world_comm();
  const int n = c->size(), r = c->rank();
  for (auto dt : kDtypes) {
    for (int root = 0; root < n; ++root) {
      at::Tensor expected = random_input(513, dt, seed_of(4000 + root, root));
      at::Tensor t =
          (r == root ? expected.clone() : at::full({513}, 5, expected.options())).to(test_device());
      c->broadcast(t, root);
      EXPECT_TRUE(at::equal(t.cpu(), expected)) << "root " << root << " " << c10::toString(dt);
    }
  }
}

TEST(SendRecvTest, TaggedMessagesReachTheNextRankInAnyOrder) {
  auto& c = world_comm();
  if (c->backend() == "nccl")
    GTEST_SKIP() << "NCCL has no tags: see BatchExchangesWithBothNeighboursAtOnce";
  const int n = c->size(), r = c->rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  at::Tensor a = random_input(300, at::kFloat, seed_of(5000, r)).to(test_device());
  at::Tensor b = random_input(77, at::kLong, seed_of(5001, r)).to(test_device());
  at::Tensor ra = at::empty({300}, a.options()), rb = at::empty({77}, b.options());
  const int64_t sent_before = c->stats().bytes_sent;
  // Receives are posted in the opposite order of the sends: tags must keep them apart.
  auto wb = c->recv_async(rb, prev, 5);
  auto wa = c->recv_async(ra, prev, 3);
  auto sa = c->send_async(a, next, 3);
  auto sb = c->send_async(b, next, 5);
  for (auto& w : {wa, wb, sa, sb}) w->wait();
  EXPECT_TRUE(at::equal(ra.cpu(), random_input(300, at::kFloat, seed_of(5000, prev))));
  EXPECT_TRUE(at::equal(rb.cpu(), random_input(77, at::kLong, seed_of(5001, prev))));
  EXPECT_EQ(c->stats().bytes_sent - sent_before, 300 * 4 + 77 * 8);
  EXPECT_THROW(c->send(a, next, kMaxUserTag), CommError);
  EXPECT_THROW(c->send(a, r), CommError);
}

TEST(SendRecvTest, BatchExchangesWithBothNeighboursAtOnce) {
  auto& c = world_comm();
  const int n = c->size(), r = c->rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  auto opts = at::TensorOptions().device(test_device());
  at::Tensor to_next = random_input(1000, at::kFloat, seed_of(5100, r)).to(test_device());
  at::Tensor to_prev = random_input(1000, at::kFloat, seed_of(5200, r)).to(test_device());
  at::Tensor from_prev = at::empty({1000}, opts), from_next = at::empty({1000}, opts);
  // Same order on every rank, so that NCCL (no tags, in-order per pair) matches as mpi/gloo do.
  std::vector<P2POp> ops = {{P2POp::Kind::kSend, to_next, next, 1},
                            {P2POp::Kind::kSend, to_prev, prev, 2},
                            {P2POp::Kind::kRecv, from_prev, prev, 1},
                            {P2POp::Kind::kRecv, from_next, next, 2}};
  c->batch_isend_irecv(ops)->wait();
  EXPECT_TRUE(at::equal(from_prev.cpu(), random_input(1000, at::kFloat, seed_of(5100, prev))));
  EXPECT_TRUE(at::equal(from_next.cpu(), random_input(1000, at::kFloat, seed_of(5200, next))));
}

TEST(BarrierTest, DefaultAndCheckpointBarriersComplete) {
  auto& c = world_comm();
  const int64_t before = c->stats().collectives;
  c->barrier();
  c->barrier(BarrierKind::kCheckpoint);
  auto w = c->barrier_async();
  w->wait();
  EXPECT_TRUE(w->is_completed());
  EXPECT_EQ(c->stats().collectives - before, 3);
}

namespace {

// Expected groups, written out by hand for the layouts tested (world rank lists per group name).
using Groups = std::map<std::string, std::vector<std::vector<int>>>;

std::vector<int> group_of(const std::vector<std::vector<int>>& groups, int r) {
  for (const auto& g : groups) {
    if (std::find(g.begin(), g.end(), r) != g.end()) return g;
  }
  return {};
}

void check_layout(const CommPtr& world, RankLayout layout, const Groups& expected) {
  Topology topo(world, layout);
  const int r = world->rank();
  for (const auto& [name, groups] : expected) {
    const std::vector<int> members = group_of(groups, r);
    const CommPtr& g = topo.group(name);
    ASSERT_TRUE(g) << name;
    EXPECT_EQ(g->world_ranks(), members) << layout.to_string() << " group " << name;
    EXPECT_EQ(g->name(), topo.communicator_of(name));
    if (topo.communicator_of(name) != name) {  // shared: an earlier group with the same ranks
      EXPECT_EQ(topo.group(topo.communicator_of(name)), g);
      EXPECT_EQ(g->world_ranks(), members);
    }
    // Each rank contributes (world rank + 1); the sum covers exactly the group's members.
    at::Tensor t =
        at::full({3}, double(r + 1), at::TensorOptions().dtype(at::kDouble).device(test_device()));
    g->all_reduce(t, ReduceOp::kSum);
    double expect = 0;
    for (int m : members) expect += m + 1;
    EXPECT_TRUE(at::equal(t.cpu(), at::full({3}, expect, at::kDouble)))
        << layout.to_string() << " group " << name;
  }
}

}  // namespace

TEST(TopologyTest, GroupsOfEachLayoutReduceOnlyInsideThemselves) {
  auto& c = world_comm();
  if (c->size() == 4) {
    // dp=2 x tp=2: TP innermost.
    check_layout(
        c, resolve_layout(4, 0, 2, 1),
        {{"tp", {{0, 1}, {2, 3}}}, {"dp", {{0, 2}, {1, 3}}}, {"pp", {{0}, {1}, {2}, {3}}}});
    // dp=2 x tp=1 x pp=2: PP outermost.
    check_layout(
        c, resolve_layout(4, 2, 1, 2),
        {{"tp", {{0}, {1}, {2}, {3}}}, {"dp", {{0, 1}, {2, 3}}}, {"pp", {{0, 2}, {1, 3}}}});
  } else if (c->size() == 2) {
    check_layout(c, resolve_layout(2, 0, 2, 1),
                 {{"tp", {{0, 1}}}, {"dp", {{0}, {1}}}, {"pp", {{0}, {1}}}});
    check_layout(c, resolve_layout(2, 1, 1, 2),
                 {{"tp", {{0}, {1}}}, {"dp", {{0}, {1}}}, {"pp", {{0, 1}}}});
    check_layout(c, resolve_layout(2, 0, 1, 1), {{"dp", {{0, 1}}}});
  } else {
    GTEST_SKIP() << "layouts are written out for 2 and 4 ranks";
  }
}

// Groups with the same ranks share one communicator (one set of NCCL buffers), decided by the
// layout alone: the 1-rank groups share the first one made, dp = world when tp = pp = 1.
TEST(TopologyTest, GroupsWithTheSameRanksShareACommunicator) {
  auto& c = world_comm();
  const int n = c->size();
  if (n < 2) GTEST_SKIP() << "needs 2 or more ranks";
  Topology pure_dp(c, resolve_layout(n, 0, 1, 1));
  EXPECT_EQ(pure_dp.dp(), c);
  EXPECT_EQ(pure_dp.communicator_of("dp"), "world");
  EXPECT_EQ(pure_dp.communicator_of("tp"), "tp");  // the first 1-rank group
  EXPECT_EQ(pure_dp.communicator_of("pp"), "tp");
  EXPECT_EQ(pure_dp.pp(), pure_dp.tp());
  if (n % 2 == 0 && n >= 4) {
    Topology dp_pp(c, resolve_layout(n, 0, 1, 2));
    EXPECT_EQ(dp_pp.communicator_of("dp"), "dp");
    EXPECT_NE(dp_pp.dp(), c);
  }
  EXPECT_THROW(pure_dp.communicator_of("ep"), CommError);
  EXPECT_THROW(pure_dp.communicator_of("dp_tp"), CommError);  // no dp x tp group (topology.h)
}

TEST(SplitTest, NegativeColorJoinsNoGroupAndKeyOrdersRanks) {
  auto& c = world_comm();
  const int n = c->size(), r = c->rank();
  // Even ranks form a group ordered by descending world rank; odd ranks join none.
  CommPtr g = c->split(r % 2 == 0 ? 0 : -1, -r, "evens");
  if (r % 2) {
    EXPECT_EQ(g, nullptr);
    return;
  }
  ASSERT_NE(g, nullptr);
  std::vector<int> expected;
  for (int q = n - 1; q >= 0; --q) {
    if (q % 2 == 0) expected.push_back(q);
  }
  EXPECT_EQ(g->world_ranks(), expected);
  EXPECT_EQ(g->world_ranks()[static_cast<size_t>(g->rank())], r);
  at::Tensor t =
      at::full({1}, int64_t(1) << r, at::TensorOptions().dtype(at::kLong).device(test_device()));
  g->all_reduce(t, ReduceOp::kSum);
  int64_t mask = 0;
  for (int q : expected) mask |= int64_t(1) << q;
  EXPECT_EQ(t.cpu().item<int64_t>(), mask);
}

namespace {
CommPtr debug_comm() {
  CommOptions o = test_options();
  o.debug_collectives = true;
  return make_world_communicator(test_backend(), o);
}
}  // namespace

TEST(DebugModeTest, ConsistentCallsPassTheCrossCheck) {
  CommPtr c = debug_comm();
  const int n = c->size(), r = c->rank();
  at::Tensor t = random_input(10, at::kFloat, seed_of(6000, r)).to(test_device());
  c->all_reduce(t, ReduceOp::kSum);
  c->all_reduce(t, ReduceOp::kMax, AllReduceAlgo::kRing);
  at::Tensor part = at::empty({chunk_numel(10, n, r)}, t.options());
  c->reduce_scatter(t, part, ReduceOp::kAvg);
  at::Tensor all = at::empty({10}, t.options());
  c->all_gather(part, all);  // uneven inputs, same total: not a mismatch
  c->broadcast(t, n - 1);
  c->barrier();
  CommPtr g = c->split(0, r, "same");
  EXPECT_FALSE(c->aborted());
  EXPECT_EQ(g->size(), n);
}

TEST(DebugModeTest, DifferentShapesFailOnEveryRankNamingBothCallSites) {
  CommPtr c = debug_comm();
  const int r = c->rank();
  at::Tensor small = at::ones({4}, at::TensorOptions().device(test_device()));
  at::Tensor large = at::ones({8}, at::TensorOptions().device(test_device()));
  std::string message;
  const int line_rank0 = __LINE__ + 3;
  try {
    if (r == 0) {
      c->all_reduce(small, ReduceOp::kSum);
    } else {
      c->all_reduce(large, ReduceOp::kSum);
    }
  } catch (const CommError& e) {
    message = e.what();
  }
  const int line_others = line_rank0 + 2;
  ASSERT_FALSE(message.empty()) << "the mismatch was not detected";
  EXPECT_NE(message.find("collective mismatch on group 'world'"), std::string::npos) << message;
  EXPECT_NE(message.find("the size differs"), std::string::npos) << message;
  EXPECT_NE(message.find(fmt::format("comm_test.cpp:{}", line_rank0)), std::string::npos)
      << message;
  EXPECT_NE(message.find(fmt::format("comm_test.cpp:{}", line_others)), std::string::npos)
      << message;
  EXPECT_NE(message.find("float32[4]"), std::string::npos) << message;
  EXPECT_NE(message.find("float32[8]"), std::string::npos) << message;
  EXPECT_TRUE(c->aborted());
  EXPECT_THROW(c->barrier(), CommError);  // unusable afterwards
}

TEST(DebugModeTest, DifferentOpsFailNamingBothOps) {
  CommPtr c = debug_comm();
  const int r = c->rank();
  at::Tensor t = at::ones({16}, at::TensorOptions().device(test_device()));
  std::string message;
  try {
    if (r == 0) {
      c->all_reduce(t, ReduceOp::kSum);
    } else {
      c->broadcast(t, 0);
    }
  } catch (const CommError& e) {
    message = e.what();
  }
  ASSERT_FALSE(message.empty());
  EXPECT_NE(message.find("the op differs"), std::string::npos) << message;
  EXPECT_NE(message.find("all_reduce(sum, native)"), std::string::npos) << message;
  EXPECT_NE(message.find("broadcast(root 0)"), std::string::npos) << message;
}

TEST(FlightRecorderTest, RecordsEachOpWithSequenceSiteAndState) {
  CommOptions o = test_options();
  o.flight_recorder_size = 3;
  CommPtr c = make_world_communicator(test_backend(), o);
  at::Tensor t = at::ones({5}, at::TensorOptions().device(test_device()));
  const int first_line = __LINE__ + 1;
  c->all_reduce(t, ReduceOp::kSum);
  c->broadcast(t, 0);
  c->barrier();
  c->all_reduce(t, ReduceOp::kMax);
  auto entries = c->flight_entries();
  ASSERT_EQ(entries.size(), 3u);  // the oldest of 4 ops fell out of the ring buffer
  const std::vector<std::string> ops = {"broadcast", "barrier", "all_reduce"};
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(entries[i].seq, i + 2);
    EXPECT_EQ(entries[i].op, ops[i]);
    EXPECT_EQ(entries[i].group, "world");
    EXPECT_EQ(entries[i].state, OpState::kCompleted);
    EXPECT_NE(entries[i].site.find(fmt::format("comm_test.cpp:{}", first_line + 1 + int(i))),
              std::string::npos)
        << entries[i].site;
    EXPECT_GT(entries[i].finished_at, 0);
    EXPECT_EQ(entries[i].peers.size(), static_cast<size_t>(c->size()));
  }
  EXPECT_EQ(entries[0].shape, std::vector<int64_t>({5}));
  EXPECT_EQ(entries[0].dtype, "float32");
  EXPECT_EQ(c->stats().collectives, 4);
}
