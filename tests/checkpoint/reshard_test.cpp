// Resharding across runs: SaveOnFourRanks (mpirun -np 4, layout dp 2 x tp 2) writes a checkpoint
// to --dir with a flat tensor sharded 4 ways (ZeRO-like), a 2-D tensor split along dim 1 over the
// 4 ranks (TP-like), a 2-D tensor split along dim 0 over tp and replicated over dp, a replicated
// tensor, per-rank state, and ZeRO pieces: flat ranges of a 2-D tensor cutting its rows in the
// middle (one rank's range empty) and of a 0-d tensor (held by one rank). LoadOnThisWorld (mpirun
// -np 2, then -np 1) asks for the slices of its own layout and compares them bitwise with the
// global tensors regenerated from the seed stored in the checkpoint; with verification off it must
// read exactly the bytes it asked for.
#include "checkpoint/checkpointer.h"
#include "checkpoint/reader.h"
#include "mpi_env.h"
#include "test_util.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <filesystem>

using namespace parallax;
using namespace parallax::checkpoint;
using parallax::ckpt_test::bitwise_equal;
using parallax::ckpt_test::chunk;
using parallax::ckpt_test::MpiEnv;
using parallax::ckpt_test::random_tensor;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kFlat = 1003;
// The flat ranges of optim/w.exp_avg [37, 13] on the 4 saving ranks: rank 1's is empty, 100 and
// 300 are inside rows 7 and 23.
const std::vector<int64_t> kCuts = {0, 100, 100, 300, 481};

std::map<std::string, at::Tensor> globals(uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::map<std::string, at::Tensor> g;
  g["optim/flat.exp_avg"] = random_tensor(at::kFloat, {kFlat}, gen);
  g["model/col.weight"] = random_tensor(at::kBFloat16, {6, 10}, gen);
  g["model/row.weight"] = random_tensor(at::kFloat, {9, 4}, gen);
  g["model/ids"] = random_tensor(at::kLong, {17}, gen);
  g["optim/w.exp_avg"] = random_tensor(at::kFloat, {37, 13}, gen);
  g["optim/w.step"] = random_tensor(at::kFloat, {}, gen);
  return g;
}

at::Tensor rank_state(uint64_t seed, int rank) {
  return random_tensor(
      at::kByte, {16},
      at::make_generator<at::CPUGeneratorImpl>(seed + 77 + static_cast<uint64_t>(rank)));
}

std::string dir() {
  const std::string d = MpiEnv::get().dir;
  EXPECT_FALSE(d.empty()) << "pass --dir=PATH";
  return d;
}

}  // namespace

TEST(CheckpointReshardTest, SaveOnFourRanks) {
  MpiEnv& env = MpiEnv::get();
  ASSERT_EQ(env.size(), 4) << "run with mpirun -np 4";
  const int r = env.rank();
  if (r == 0) fs::remove_all(dir());
  env.barrier();
  const uint64_t seed = env.shared_seed() & 0x7fffffffffffffffULL;
  const auto g = globals(seed);
  // Layout dp 2 x tp 2: world rank = dp * 2 + tp.
  const int tp = r % 2;
  SaveState s;
  const auto [fo, fl] = chunk(kFlat, 4, r);
  s.add_shard("optim/flat.exp_avg", g.at("optim/flat.exp_avg").narrow(0, fo, fl).clone(), {kFlat},
              {fo});
  const auto [co, cl] = chunk(10, 4, r);
  s.add_shard("model/col.weight", g.at("model/col.weight").narrow(1, co, cl), {6, 10}, {0, co});
  const auto [ro, rl] = chunk(9, 2, tp);
  s.add_shard("model/row.weight", g.at("model/row.weight").narrow(0, ro, rl).clone(), {9, 4},
              {ro, 0}, {tp, 2 + tp});
  s.add_replicated("model/ids", g.at("model/ids").clone());
  const at::Tensor w = g.at("optim/w.exp_avg").view({-1});
  s.add_flat_shard("optim/w.exp_avg", w.narrow(0, kCuts[r], kCuts[r + 1] - kCuts[r]).clone(),
                   {37, 13}, kCuts[r]);
  s.add_flat_shard("optim/w.step", g.at("optim/w.step").view({1}).narrow(0, 0, r == 2 ? 1 : 0), {},
                   0);
  s.add_rank_local("rng/cpu", rank_state(seed, r));
  s.set_extra("seed", static_cast<int64_t>(seed));
  CheckpointerOptions o;
  o.layout = {2, 2, 1};
  Checkpointer ck(dir(), o);
  ck.save(12, s);
  CheckpointReader reader(dir());
  EXPECT_EQ(reader.info("model/row.weight").shards.size(), 2u);  // replicated over dp: once each
  EXPECT_EQ(reader.info("optim/flat.exp_avg").shards.size(), 4u);
  EXPECT_EQ(reader.metadata().format_version, kFlatFormatVersion);
  for (const ShardInfo& sh : reader.info("optim/w.exp_avg").shards) EXPECT_TRUE(sh.is_flat());
}

TEST(CheckpointReshardTest, LoadOnThisWorld) {
  MpiEnv& env = MpiEnv::get();
  const int w = env.size(), r = env.rank();
  CheckpointReader meta(dir());
  ASSERT_EQ(meta.metadata().world, 4);
  ASSERT_EQ(meta.metadata().layout.tp, 2);
  const uint64_t seed = static_cast<uint64_t>(meta.metadata().extra_int("seed"));
  const auto g = globals(seed);
  for (const bool verify : {false, true}) {
    CheckpointReader reader(dir());
    const auto [fo, fl] = chunk(kFlat, w, r);
    at::Tensor flat = at::empty({fl}, at::kFloat);
    const auto [co, cl] = chunk(10, w, r);
    at::Tensor col = at::empty({6, cl}, at::kBFloat16);
    const auto [ro, rl] = chunk(9, w, r);
    at::Tensor row = at::empty({rl, 4}, at::kFloat);
    at::Tensor ids = at::empty({17}, at::kLong);
    // This world's flat ranges of optim/w.exp_avg (other cuts than the saved ones), a column split
    // of it (a box crossing every saved range) and the 0-d tensor.
    const auto [wo, wl] = chunk(481, w, r);
    at::Tensor wflat = at::empty({wl}, at::kFloat);
    at::Tensor wcol = at::empty({37, cl}, at::kFloat);
    at::Tensor wstep = at::empty({}, at::kFloat);
    std::vector<LoadTarget> targets = {
        {"optim/flat.exp_avg", flat, {fo}}, {"model/col.weight", col, {0, co}},
        {"model/row.weight", row, {ro, 0}}, {"model/ids", ids, {}},
        {"optim/w.exp_avg", wcol, {0, co}}, {"optim/w.step", wstep, {}}};
    for (auto& t : flat_load_targets("optim/w.exp_avg", wflat, {37, 13}, wo))
      targets.push_back(std::move(t));
    reader.load(targets, ReadOptions{verify, false});
    EXPECT_TRUE(bitwise_equal(flat, g.at("optim/flat.exp_avg").narrow(0, fo, fl)))
        << "verify " << verify;
    EXPECT_TRUE(bitwise_equal(col, g.at("model/col.weight").narrow(1, co, cl)))
        << "verify " << verify;
    EXPECT_TRUE(bitwise_equal(row, g.at("model/row.weight").narrow(0, ro, rl)))
        << "verify " << verify;
    EXPECT_TRUE(bitwise_equal(ids, g.at("model/ids")));
    EXPECT_TRUE(bitwise_equal(wflat, g.at("optim/w.exp_avg").view({-1}).narrow(0, wo, wl)))
        << "verify " << verify;
    EXPECT_TRUE(bitwise_equal(wcol, g.at("optim/w.exp_avg").narrow(1, co, cl)))
        << "verify " << verify;
    EXPECT_TRUE(bitwise_equal(wstep, g.at("optim/w.step")));
    const int64_t asked =
        static_cast<int64_t>(flat.nbytes() + col.nbytes() + row.nbytes() + ids.nbytes() +
                             wflat.nbytes() + wcol.nbytes() + wstep.nbytes());
    EXPECT_EQ(reader.stats().bytes_read, asked);
    if (!verify) {
      EXPECT_EQ(reader.stats().extra_bytes, 0) << "read more than the overlapping parts";
    }
    // The per-rank state of the old ranks is there for whoever needs it.
    EXPECT_TRUE(bitwise_equal(reader.read(rank_local_name(r, "rng/cpu")), rank_state(seed, r)));
  }
}
