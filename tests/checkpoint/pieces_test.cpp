// Several pieces of one tensor in one rank file (format version 4), in one process with ranks
// simulated by threads sharing a c10d HashStore: a corrupt second or third piece is found by a load
// that reads the tensor whole, two flat pieces of a tensor in one file verify on load, replica-set
// ownership stays consistent when members hold different numbers of pieces of a name, a file that
// names one dataset twice is refused, checkpoints without several pieces per file keep version 2
// or 3 and their metadata keys, and inspect lists each piece's dataset. The multi-process round
// trip (qkv parts, ZeRO ranges of tp slices) is in mpi_test.cpp; the basic one in flat_test.cpp.
#include "checkpoint/checkpointer.h"
#include "checkpoint/inspect.h"
#include "checkpoint/reader.h"
#include "core/error.h"
#include "corrupt.h"
#include "parallel/engine.h"
#include "test_util.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>
#include <hdf5.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <vector>

using namespace parallax;
using namespace parallax::checkpoint;
using parallax::ckpt_test::bitwise_equal;
using parallax::ckpt_test::contains;
using parallax::ckpt_test::corrupt_dataset_byte;
using parallax::ckpt_test::run_ranks;
using parallax::ckpt_test::ScratchDir;
namespace fs = std::filesystem;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const CheckpointError& e) {
    return e.what();
  }
  return "no error";
}

// Saves step 1 of `states[r]` from rank r of states.size() (threads, one HashStore).
void save_all(const std::string& dir, const std::vector<SaveState>& states) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const int world = static_cast<int>(states.size());
  run_ranks(world, [&](int r) {
    CheckpointerOptions o;
    o.timeout_s = 60;
    Checkpointer ck(dir, o, CommitGroup{r, world, store});
    ck.save(1, states[static_cast<size_t>(r)]);
  });
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

// One rank holds the three parts of a fused qkv weight as three pieces (datasets "<name>",
// "<name>@1", "<name>@2"). A byte flipped in the last piece must fail a verified load of the whole
// tensor (each piece is checked, not only the file's first one) and verify_all; inspect lists the
// pieces' datasets.
TEST(CheckpointPiecesTest, CorruptLaterPieceFailsAVerifiedWholeLoad) {
  const uint64_t seed = ckpt_test::fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const int64_t d = 4, in = 5;
  const at::Tensor qkv = at::randn({3 * d, in}, gen);
  ScratchDir tmp("pieces_corrupt");
  const std::string dir = (tmp / "checkpoints").string();
  std::vector<SaveState> states(1);
  for (int64_t k = 2; k >= 0; --k)  // added in any order: numbered by where they start
    states[0].add_shard("model/qkv.weight", qkv.narrow(0, k * d, d).clone(), {3 * d, in},
                        {k * d, 0});
  save_all(dir, states);
  const std::string ckpt = (fs::path(dir) / "step_00000001").string();
  {
    CheckpointReader r(dir);
    EXPECT_EQ(r.metadata().format_version, kPieceFormatVersion);
    const TensorInfo& t = r.info("model/qkv.weight");
    ASSERT_EQ(t.shards.size(), 3u);
    for (int k = 0; k < 3; ++k) {
      EXPECT_EQ(t.shards[static_cast<size_t>(k)].piece, k);
      EXPECT_EQ(t.shards[static_cast<size_t>(k)].offsets, (std::vector<int64_t>{k * d, 0}));
    }
    EXPECT_TRUE(bitwise_equal(r.read("model/qkv.weight"), qkv));
  }
  std::ostringstream listing;
  InspectOptions o;
  o.list_shards = true;
  inspect(dir, listing, o);
  EXPECT_TRUE(contains(listing.str(), "lengths [4, 5] crc32 ")) << listing.str();
  EXPECT_TRUE(contains(listing.str(), " dataset model/qkv.weight@1\n")) << listing.str();
  EXPECT_TRUE(contains(listing.str(), " dataset model/qkv.weight@2\n")) << listing.str();
  EXPECT_TRUE(contains(listing.str(), "verified: 3 shards in 1 files")) << listing.str();

  corrupt_dataset_byte((fs::path(ckpt) / "rank_00000.h5").string(), "model/qkv.weight@2",
                       4 * 7 + 2);
  for (const std::string& m : {error_of([&] { CheckpointReader(dir).read("model/qkv.weight"); }),
                               error_of([&] { CheckpointReader(dir).verify_all(); })}) {
    EXPECT_TRUE(contains(m, "checksum mismatch") && contains(m, "rank_00000.h5") &&
                contains(m, "box [8, 0] + [4, 5]") && contains(m, "dataset 'model/qkv.weight@2'"))
        << m;
  }
  // The untouched pieces still read and verify.
  at::Tensor front = at::empty({2 * d, in});
  CheckpointReader(dir).read("model/qkv.weight", front, {0, 0});
  EXPECT_TRUE(bitwise_equal(front, qkv.narrow(0, 0, 2 * d)));
}

// An async save snapshots each piece into its own buffer: the three equal parts of a qkv weight on
// one rank (and on the other rank the interleaved ones), saved twice (the second save reuses the
// buffers) while the live tensors change after each save() returns, read back bitwise.
TEST(CheckpointPiecesTest, AsyncSaveSnapshotsEachPieceApart) {
  const uint64_t seed = ckpt_test::fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const int64_t d = 4, in = 3;
  const at::Tensor qkv = at::randn({3 * d, in}, gen);
  ScratchDir tmp("pieces_async");
  const std::string dir = (tmp / "checkpoints").string();
  auto store = c10::make_intrusive<c10d::HashStore>();
  run_ranks(2, [&](int r) {
    std::vector<at::Tensor> live;
    for (int64_t k = 0; k < 3; ++k) live.push_back(qkv.narrow(0, k * d + r * d / 2, d / 2).clone());
    CheckpointerOptions o;
    o.async = true;
    o.timeout_s = 60;
    Checkpointer ck(dir, o, CommitGroup{r, 2, store});
    for (int64_t step = 1; step <= 2; ++step) {
      SaveState s;
      for (int64_t k = 0; k < 3; ++k)
        s.add_shard("model/qkv.weight", live[static_cast<size_t>(k)], {3 * d, in},
                    {k * d + r * d / 2, 0});
      ck.save(step, s);
      for (at::Tensor& t : live) t.add_(1.0f);  // training goes on: the snapshot must not see it
    }
    ck.wait();
  });
  for (int64_t step = 1; step <= 2; ++step) {
    CheckpointReader reader((fs::path(dir) / step_dir_name(step)).string());
    EXPECT_TRUE(bitwise_equal(reader.read("model/qkv.weight"), qkv + static_cast<float>(step - 1)))
        << "step " << step;
  }
}

// NaN in two pieces of a tensor in one rank file (a checkpoint as an older Parallax could commit
// it): verify_all counts both and names the file once.
TEST(CheckpointPiecesTest, NonFinitePiecesNameTheirFileOnce) {
  ScratchDir tmp("pieces_nan");
  const std::string dir = (tmp / "checkpoints").string();
  at::Tensor w = at::ones({6, 2});
  w.index_put_({0, 1}, std::numeric_limits<float>::quiet_NaN());
  w.index_put_({4, 0}, std::numeric_limits<float>::infinity());
  SaveState s;
  for (int64_t k = 0; k < 3; ++k)
    s.add_shard("model/w", w.narrow(0, 2 * k, 2).clone(), {6, 2}, {2 * k, 0});
  CheckpointerOptions o;
  o.allow_nonfinite = true;
  Checkpointer(dir, o, CommitGroup{0, 1, c10::make_intrusive<c10d::HashStore>()}).save(1, s);
  std::vector<NonFiniteTensor> bad;
  CheckpointReader(dir).verify_all(nullptr, &bad);
  ASSERT_EQ(bad.size(), 1u);
  EXPECT_EQ(bad[0].name, "model/w");
  EXPECT_EQ(bad[0].nan, 1);
  EXPECT_EQ(bad[0].inf, 1);
  EXPECT_EQ(bad[0].files, (std::vector<std::string>{rank_file_name(0)}));
}

// Two flat ranges of one tensor in each of two rank files (rank 0: [0, 10) and [20, 30); rank 1:
// [10, 20) and [30, 50) of a [5, 10] tensor): a verified load checks each range by its own
// checksum, whole and through other layouts.
TEST(CheckpointPiecesTest, TwoFlatPiecesOfATensorInOneFileVerify) {
  const uint64_t seed = ckpt_test::fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const at::Tensor x = at::randn({5, 10}, gen);
  const at::Tensor flat = x.reshape({-1});
  ScratchDir tmp("pieces_flat");
  const std::string dir = (tmp / "checkpoints").string();
  const std::vector<std::vector<std::pair<int64_t, int64_t>>> ranges = {{{20, 30}, {0, 10}},
                                                                        {{10, 20}, {30, 50}}};
  std::vector<SaveState> states(2);
  for (int r = 0; r < 2; ++r) {
    for (const auto& [b, e] : ranges[static_cast<size_t>(r)])
      states[static_cast<size_t>(r)].add_flat_shard("optim/x", flat.narrow(0, b, e - b).clone(),
                                                    {5, 10}, b);
  }
  save_all(dir, states);
  CheckpointReader reader(dir);
  EXPECT_EQ(reader.metadata().format_version, kPieceFormatVersion);
  EXPECT_TRUE(bitwise_equal(reader.read("optim/x"), x));
  EXPECT_EQ(reader.stats().extra_bytes, 0);  // every range checked on the bytes read
  for (int r = 0; r < 2; ++r) {
    for (const auto& [b, e] : ranges[static_cast<size_t>(r)]) {
      at::Tensor piece = at::empty({e - b});
      CheckpointReader(dir).load(flat_load_targets("optim/x", piece, {5, 10}, b));
      EXPECT_TRUE(bitwise_equal(piece, flat.narrow(0, b, e - b))) << b;
    }
  }
  // Another split ([0, 25), [25, 50)) and a box across all four pieces.
  for (const int64_t b : {int64_t{0}, int64_t{25}}) {
    at::Tensor piece = at::empty({25});
    CheckpointReader(dir).load(flat_load_targets("optim/x", piece, {5, 10}, b));
    EXPECT_TRUE(bitwise_equal(piece, flat.narrow(0, b, 25))) << b;
  }
  at::Tensor box = at::empty({4, 3});
  CheckpointReader(dir).read("optim/x", box, {1, 6});
  EXPECT_TRUE(bitwise_equal(box, x.narrow(0, 1, 4).narrow(1, 6, 3)));
  EXPECT_EQ(CheckpointReader(dir).verify_all(), 50 * 4);
}

// Replica set {0, 1} holds box rows [0, 2) of "w" and all of "w a" (same bytes); rank 0 also holds
// rows [2, 4) of "w" alone, rank 1 nothing else of "w". Both members must order the set's entries
// alike (each written exactly once) although only rank 0 holds two pieces of "w".
TEST(CheckpointPiecesTest, ReplicaSetOwnershipIgnoresPiecesHeldOutsideTheSet) {
  const uint64_t seed = ckpt_test::fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const at::Tensor w = at::randn({4, 3}, gen), wa = at::randn({2, 3}, gen);
  ScratchDir tmp("pieces_owner");
  const std::string dir = (tmp / "checkpoints").string();
  std::vector<SaveState> states(2);
  for (int r = 0; r < 2; ++r) {
    SaveState& s = states[static_cast<size_t>(r)];
    s.add_shard("w a", wa.clone(), {2, 3}, {0, 0}, {0, 1});
    s.add_shard("w", w.narrow(0, 0, 2).clone(), {4, 3}, {0, 0}, {0, 1});
    if (r == 0) s.add_shard("w", w.narrow(0, 2, 2).clone(), {4, 3}, {2, 0});
  }
  // Each member sees the same owners for the set (select_owned is what save() runs).
  std::map<std::string, int> owner;
  for (int r = 0; r < 2; ++r) {
    for (const OwnedEntry& e : select_owned(states[static_cast<size_t>(r)], r, 2)) {
      const std::string key = fmt::format("{} {}", e.name, e.offsets);
      EXPECT_FALSE(owner.count(key)) << key << " written by ranks " << owner[key] << " and " << r;
      owner[key] = r;
    }
  }
  EXPECT_EQ(owner.size(), 3u);
  save_all(dir, states);
  CheckpointReader reader(dir);
  EXPECT_TRUE(bitwise_equal(reader.read("w"), w));
  EXPECT_TRUE(bitwise_equal(reader.read("w a"), wa));
}

// A metadata.json in which two shards of one file name the same dataset (two first pieces of a
// tensor, or piece 1 of "w" beside a tensor named "w@1") is refused: both would read one dataset.
TEST(CheckpointPiecesTest, MetadataNamingOneDatasetTwiceIsRefused) {
  auto box = [](int rank, int64_t row, int piece) {
    ShardInfo s;
    s.file = rank_file_name(rank);
    s.offsets = {row, 0};
    s.lengths = {1, 3};
    s.piece = piece;
    return s;
  };
  auto metadata = [](std::vector<TensorInfo> tensors) {
    Metadata m;
    m.format_version = kPieceFormatVersion;
    m.step = 7;
    m.layout = {2, 1, 1};
    m.world = 2;
    for (int r = 0; r < 2; ++r) m.files.push_back({rank_file_name(r), r, 4096});
    for (TensorInfo& t : tensors) m.tensors.emplace(t.name, std::move(t));
    return m;
  };
  auto tensor = [](const std::string& name, int64_t rows, std::vector<ShardInfo> shards) {
    TensorInfo t;
    t.name = name;
    t.dtype = at::kFloat;
    t.shape = {rows, 3};
    t.shards = std::move(shards);
    return t;
  };
  // Good: pieces 0 and 1 in rank 0's file, piece 0 in rank 1's.
  const Metadata good = metadata({tensor("w", 3, {box(0, 0, 0), box(1, 1, 0), box(0, 2, 1)})});
  const Metadata back = Metadata::from_json(good.to_json(), "good/metadata.json");
  EXPECT_EQ(back.tensors.at("w").shards[2].piece, 1);
  EXPECT_EQ(back.tensors.at("w").shards[1].piece, 0);

  const std::string twice = error_of([&] {
    Metadata::from_json(
        metadata({tensor("w", 3, {box(0, 0, 0), box(1, 1, 0), box(0, 2, 0)})}).to_json(),
        "twice/metadata.json");
  });
  EXPECT_TRUE(contains(twice, "twice/metadata.json") && contains(twice, "tensors.w.shards[2]") &&
              contains(twice, "dataset 'w'") && contains(twice, "tensors.w.shards[0]"))
      << twice;
  const std::string named_like = error_of([&] {
    Metadata::from_json(
        metadata({tensor("w", 2, {box(0, 0, 0), box(0, 1, 1)}), tensor("w@1", 1, {box(0, 0, 0)})})
            .to_json(),
        "named/metadata.json");
  });
  EXPECT_TRUE(contains(named_like, "dataset 'w@1'") && contains(named_like, "rank_00000.h5"))
      << named_like;
  // A piece in a file that claims version 3: refused (a version 3 reader would misread it).
  Metadata old = good;
  old.format_version = kFlatFormatVersion;
  const std::string v3 = error_of([&] { Metadata::from_json(old.to_json(), "v3/metadata.json"); });
  EXPECT_TRUE(contains(v3, "piece") && contains(v3, "format version 4")) << v3;
}

// Without two pieces of a tensor in one rank file the checkpoint keeps the version and keys of
// before: version 2 for boxes (here although rank 0 adds two pieces of "w": the replica set's box
// goes to rank 1, so each file holds one), version 3 with a flat range; no shard has "piece".
TEST(CheckpointPiecesTest, OnePiecePerFileKeepsVersionTwoOrThreeAndItsKeys) {
  const uint64_t seed = ckpt_test::fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const at::Tensor w = at::randn({4, 3}, gen), v = at::randn({2, 3}, gen);
  const at::Tensor m = at::randn({6, 5}, gen);
  ScratchDir tmp("pieces_version");
  std::regex shard_keys(R"(\{"file": "rank_0000[01]\.h5", ("offsets": \[[0-9, ]*\], "lengths": )"
                        R"(\[[0-9, ]*\]|"flat": \[[0-9]+, [0-9]+\]), "crc32": [0-9]+\})");
  for (const bool with_flat : {false, true}) {
    SCOPED_TRACE(with_flat ? "with a flat range" : "boxes only");
    const std::string dir = (tmp / (with_flat ? "flat" : "boxes")).string();
    std::vector<SaveState> states(2);
    for (int r = 0; r < 2; ++r) {
      SaveState& s = states[static_cast<size_t>(r)];
      s.add_shard("v", v.clone(), {2, 3}, {0, 0}, {0, 1});
      s.add_shard("w", w.narrow(0, 0, 2).clone(), {4, 3}, {0, 0}, {0, 1});
      if (r == 0) s.add_shard("w", w.narrow(0, 2, 2).clone(), {4, 3}, {2, 0});
      if (with_flat) {
        s.add_flat_shard("optim/m", m.reshape({-1}).narrow(0, r * 13, r == 0 ? 13 : 17).clone(),
                         {6, 5}, r * 13);
      } else {
        s.add_shard("optim/m", m.narrow(0, r * 3, 3).clone(), {6, 5}, {r * 3, 0});
      }
    }
    save_all(dir, states);
    CheckpointReader reader(dir);
    EXPECT_EQ(reader.metadata().format_version, with_flat ? kFlatFormatVersion : kBoxFormatVersion);
    std::set<std::string> files_of_w;
    for (const ShardInfo& s : reader.info("w").shards) {
      EXPECT_EQ(s.piece, 0);
      files_of_w.insert(s.file);
    }
    EXPECT_EQ(files_of_w.size(), 2u);  // rank 1 writes the set's box of "w"
    EXPECT_TRUE(bitwise_equal(reader.read("w"), w));
    EXPECT_TRUE(bitwise_equal(reader.read("optim/m"), m));
    const std::string text = read_text(fs::path(reader.dir()) / kMetadataFile);
    EXPECT_FALSE(contains(text, "piece")) << text;
    // Every shard line holds exactly the keys a version 2 or 3 writer wrote, in its order.
    size_t lines = 0;
    for (std::sregex_iterator it(text.begin(), text.end(), shard_keys), end; it != end; ++it)
      ++lines;
    size_t shards = 0;
    for (const auto& [name, t] : reader.metadata().tensors) shards += t.shards.size();
    EXPECT_EQ(lines, shards) << text;
  }
}
