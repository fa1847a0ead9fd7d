// Flat-range shards (a ZeRO rank's piece of a parameter: elements [b, e) of the C-order
// flattening), in one process with 2 and 4 ranks simulated by threads sharing a c10d HashStore (the
// commit protocol of mpirun): metadata.json records them exactly ("flat": [b, e], format version
// 3); the commit refuses overlaps and gaps naming the tensor and the files, for flat ranges, boxes
// and a mix; every box (whole tensors, arbitrary boxes, other flat decompositions) reads back
// bitwise from any mix of flat and box shards, reading only the overlap; corruption and non-finite
// values in a flat shard are found by the reader and by inspect; export writes whole tensors.
#include "checkpoint/checkpointer.h"
#include "checkpoint/inspect.h"
#include "checkpoint/reader.h"
#include "checkpoint/tensor_io.h"
#include "checkpoint/weights.h"
#include "core/error.h"
#include "corrupt.h"
#include "test_util.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>
#include <hdf5.h>
#include <torch/nn/modules/linear.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <sstream>

using namespace parallax;
using namespace parallax::checkpoint;
using parallax::ckpt_test::bitwise_equal;
using parallax::ckpt_test::contains;
using parallax::ckpt_test::corrupt_dataset_byte;
using parallax::ckpt_test::random_tensor;
using parallax::ckpt_test::run_ranks;
using parallax::ckpt_test::ScratchDir;
namespace fs = std::filesystem;

namespace {

// parts + 1 cut points 0 = c_0 <= ... <= c_parts = n at random (so mostly inside rows); with
// `empty_piece`, one piece is empty.
std::vector<int64_t> random_cuts(int64_t n, int parts, std::mt19937_64& rng, bool empty_piece) {
  std::vector<int64_t> c{0, n};
  for (int i = 1; i < parts; ++i)
    c.push_back(static_cast<int64_t>(rng() % static_cast<uint64_t>(n + 1)));
  std::sort(c.begin(), c.end());
  if (empty_piece && parts > 1) {
    const size_t i = 1 + rng() % static_cast<size_t>(parts - 1);
    c[i] = c[i - 1];  // piece i - 1 is empty
  }
  return c;
}

std::vector<int64_t> even_cuts(int64_t n, int parts) {
  std::vector<int64_t> c{0};
  for (int i = 0; i < parts; ++i) c.push_back(c.back() + n / parts + (i < n % parts ? 1 : 0));
  return c;
}

at::Tensor flat_part(const at::Tensor& g, int64_t b, int64_t e) {
  return g.contiguous().view({-1}).narrow(0, b, e - b).clone();
}

// metadata.json's text with its checksum line recomputed (format.h), for hand-edited texts.
std::string reseal(const std::string& text) {
  const std::string body = text.substr(text.find('\n', 2) + 1);
  const uint32_t crc =
      tensor_io::crc32_update(0, body.data(), static_cast<int64_t>(body.size()), false);
  return fmt::format("{{\n  \"checksum\": \"crc32:{:08x}\",\n", crc) + body;
}

// The tensors of the round trips, and how `world` ranks hold them: flat ranges cutting rows in
// the middle with an empty piece (w), flat ranges of a 3-D bf16 tensor (c), even flat ranges of a
// 1-D tensor (v), a 0-d tensor held by the last rank (its other ranks' pieces are empty), and a
// tensor that rank 0 holds as a box (rows [0, 3)) and the others as flat ranges of the rest (mix).
struct Layout {
  int world;
  std::map<std::string, at::Tensor> g;
  std::map<std::string, std::vector<int64_t>> cuts;  // rank r holds [cuts[r], cuts[r + 1])

  Layout(int w, std::mt19937_64& rng) : world(w) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(rng());
    g["optim/w.exp_avg"] = random_tensor(at::kFloat, {37, 13}, gen);
    g["optim/c.exp_avg_sq"] = random_tensor(at::kBFloat16, {5, 4, 7}, gen);
    g["optim/v"] = random_tensor(at::kFloat, {1001}, gen);
    g["optim/s"] = random_tensor(at::kDouble, {}, gen);
    g["model/mix"] = random_tensor(at::kLong, {9, 6}, gen);
    cuts["optim/w.exp_avg"] = random_cuts(37 * 13, w, rng, /*empty_piece=*/true);
    cuts["optim/c.exp_avg_sq"] = random_cuts(5 * 4 * 7, w, rng, false);
    cuts["optim/v"] = even_cuts(1001, w);
    cuts["optim/s"] = std::vector<int64_t>(static_cast<size_t>(w), 0);
    cuts["optim/s"].push_back(1);
    // Rank 0's piece [18, 18) is unused (it holds the box); ranks 1.. split [18, 54).
    cuts["model/mix"] = random_cuts(54 - 18, w - 1, rng, false);
    for (auto& c : cuts["model/mix"]) c += 18;
    cuts["model/mix"].insert(cuts["model/mix"].begin(), 18);
  }

  SaveState state(int r) const {
    SaveState s;
    const size_t i = static_cast<size_t>(r);
    for (const auto& [name, c] : cuts) {
      if (name == "model/mix" && r == 0) {
        s.add_shard(name, g.at(name).narrow(0, 0, 3), {9, 6}, {0, 0});
        continue;
      }
      s.add_flat_shard(name, flat_part(g.at(name), c[i], c[i + 1]), g.at(name).sizes().vec(), c[i]);
    }
    return s;
  }

  // Saves on `world` thread ranks as step 1 of `dir`.
  void save(const std::string& dir) const {
    auto store = c10::make_intrusive<c10d::HashStore>();
    run_ranks(world, [&](int r) {
      CheckpointerOptions o;
      o.timeout_s = 60;
      Checkpointer ck(dir, o, CommitGroup{r, world, store});
      ck.save(1, state(r));
    });
  }
};

// Saves `states[r]` on thread rank r as step 3; each rank's CheckpointError ("" if it committed).
std::vector<std::string> try_save(const std::string& dir, const std::vector<SaveState>& states) {
  const int world = static_cast<int>(states.size());
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(states.size());
  run_ranks(world, [&](int r) {
    try {
      CheckpointerOptions o;
      o.timeout_s = 60;
      Checkpointer ck(dir, o, CommitGroup{r, world, store});
      ck.save(3, states[static_cast<size_t>(r)]);
    } catch (const CheckpointError& e) {
      errors[static_cast<size_t>(r)] = e.what();
    }
  });
  return errors;
}

TensorInfo tensor_of(std::vector<int64_t> shape, std::vector<ShardInfo> shards) {
  TensorInfo t;
  t.name = "optim/x";
  t.shape = std::move(shape);
  t.shards = std::move(shards);
  return t;
}
ShardInfo flat(int rank, int64_t b, int64_t e) {
  ShardInfo s;
  s.file = rank_file_name(rank);
  s.flat = FlatRange{b, e};
  return s;
}
ShardInfo box(int rank, std::vector<int64_t> offsets, std::vector<int64_t> lengths) {
  ShardInfo s;
  s.file = rank_file_name(rank);
  s.offsets = std::move(offsets);
  s.lengths = std::move(lengths);
  return s;
}

}  // namespace

TEST(CheckpointFlatTest, MetadataRecordsFlatRangesAsVersion3) {
  Metadata m;
  m.step = 4;
  m.files = {{rank_file_name(0), 0, 100}, {rank_file_name(1), 1, 100}};
  TensorInfo t = tensor_of({37, 13}, {flat(0, 0, 200), flat(1, 200, 481)});
  t.shards[0].crc32 = 123;
  t.shards[1].crc32 = 4000000000u;
  m.tensors.emplace(t.name, t);
  TensorInfo b = tensor_of({4}, {box(0, {0}, {4})});
  b.name = "model/b";
  m.tensors.emplace(b.name, b);
  EXPECT_EQ(m.version_needed(), kFlatFormatVersion);
  m.format_version = m.version_needed();
  const std::string text = m.to_json();
  EXPECT_TRUE(contains(text, "\"flat\": [200, 481]")) << text;
  EXPECT_TRUE(contains(text, "\"format_version\": 3")) << text;
  const Metadata r = Metadata::from_json(text, "ck/metadata.json");
  const TensorInfo& x = r.tensors.at("optim/x");
  ASSERT_EQ(x.shards.size(), 2u);
  ASSERT_TRUE(x.shards[1].is_flat());
  EXPECT_EQ(*x.shards[1].flat, (FlatRange{200, 481}));
  EXPECT_TRUE(x.shards[1].offsets.empty() && x.shards[1].lengths.empty());
  EXPECT_EQ(x.shards[1].crc32, 4000000000u);
  EXPECT_EQ(x.shards[1].numel(), 281);
  EXPECT_EQ(x.shards[1].stored_dims(), (std::vector<int64_t>{281}));
  EXPECT_FALSE(r.tensors.at("model/b").shards[0].is_flat());
  Metadata boxes = r;
  boxes.tensors.erase("optim/x");
  EXPECT_EQ(boxes.version_needed(), kBoxFormatVersion);  // the lowest version that describes it

  auto refused = [](const std::string& bad, const std::string& part) {
    try {
      Metadata::from_json(bad, "ck/metadata.json");
      ADD_FAILURE() << "accepted; expected an error with: " << part;
    } catch (const CheckpointError& e) {
      EXPECT_TRUE(contains(e.what(), part) && contains(e.what(), "optim/x")) << e.what();
    }
  };
  auto edit = [&](const std::string& from, const std::string& to) {
    std::string s = text;
    s.replace(s.find(from), from.size(), to);
    return reseal(s);
  };
  EXPECT_NO_THROW(Metadata::from_json(reseal(text), "x"));  // reseal reproduces the checksum
  refused(edit("\"format_version\": 3", "\"format_version\": 2"), "need format version 3");
  refused(edit("\"flat\": [200, 481]", "\"flat\": [200, 482]"), "inside the tensor");
  refused(edit("\"flat\": [200, 481]", "\"flat\": [300, 200]"), "inside the tensor");
  refused(edit("\"flat\": [200, 481]", "\"flat\": [200, 481], \"offsets\": [0, 0]"), "not both");
  refused(edit("\"flat\": [200, 481]", "\"flat\": [201, 481]"), "480");  // a gap: 480 of 481
}

TEST(CheckpointFlatTest, TilingCheckAcceptsExactPiecesAndNamesOverlapsAndGaps) {
  // Flat ranges cutting rows, an empty one, a 0-d tensor.
  EXPECT_EQ(
      tiling_problem(tensor_of({37, 13}, {flat(1, 200, 481), flat(2, 200, 200), flat(0, 0, 200)})),
      "");
  EXPECT_EQ(tiling_problem(tensor_of({}, {flat(0, 0, 0), flat(1, 0, 1)})), "");
  EXPECT_EQ(tiling_problem(tensor_of({}, {box(0, {}, {})})), "");
  // A tensor of no elements: no pieces, or empty ones.
  EXPECT_EQ(tiling_problem(tensor_of({0, 4}, {})), "");
  EXPECT_EQ(tiling_problem(tensor_of({0, 4}, {flat(0, 0, 0), flat(1, 0, 0)})), "");
  EXPECT_EQ(tiling_problem(tensor_of({3, 0}, {box(0, {0, 0}, {3, 0}), flat(1, 0, 0)})), "");
  // Boxes and flat ranges mixed: rows [0, 3) as a box, the rest as two flat ranges.
  EXPECT_EQ(
      tiling_problem(tensor_of({9, 6}, {box(0, {0, 0}, {3, 6}), flat(1, 18, 31), flat(2, 31, 54)})),
      "");
  // Overlaps: two flat ranges; a flat range and a box (element 17 = row 2, column 5); 0-d.
  std::string p = tiling_problem(tensor_of({37, 13}, {flat(0, 0, 201), flat(1, 200, 481)}));
  EXPECT_TRUE(contains(p, "overlap") && contains(p, "rank_00000.h5 flat [0, 201)") &&
              contains(p, "rank_00001.h5 flat [200, 481)"))
      << p;
  p = tiling_problem(tensor_of({9, 6}, {box(0, {0, 0}, {3, 6}), flat(1, 17, 31), flat(2, 31, 54)}));
  EXPECT_TRUE(contains(p, "overlap") && contains(p, "rank_00000.h5 box [0, 0] + [3, 6]") &&
              contains(p, "rank_00001.h5 flat [17, 31)"))
      << p;
  p = tiling_problem(tensor_of({}, {flat(0, 0, 1), box(1, {}, {})}));
  EXPECT_TRUE(contains(p, "overlap") && contains(p, "rank_00000.h5") &&
              contains(p, "rank_00001.h5"))
      << p;
  // Gaps: the elements covered, and the pieces.
  p = tiling_problem(tensor_of({37, 13}, {flat(0, 0, 200), flat(1, 201, 481)}));
  EXPECT_TRUE(contains(p, "cover 480 of 481") && contains(p, "rank_00001.h5 flat [201, 481)")) << p;
  p = tiling_problem(tensor_of({9, 6}, {box(0, {0, 0}, {3, 6}), flat(1, 19, 54)}));
  EXPECT_TRUE(contains(p, "cover 53 of 54")) << p;
  // An overlap and a gap of the same size cancel in the element count: the overlap is still found.
  p = tiling_problem(tensor_of({9, 6}, {box(0, {0, 0}, {3, 6}), flat(1, 17, 53)}));
  EXPECT_TRUE(contains(p, "overlap")) << p;

  // No limit on the number of pieces (the check is a sort and a sweep): 4096 flat ranges of a
  // [4096, 3] tensor cutting rows, and a 64 x 64 grid of boxes with one duplicated at the end.
  std::mt19937_64 rng(ckpt_test::fresh_seed());
  const std::vector<int64_t> cuts = random_cuts(4096 * 3, 4096, rng, true);
  std::vector<ShardInfo> many;
  for (size_t i = 0; i + 1 < cuts.size(); ++i)
    many.push_back(flat(static_cast<int>(i), cuts[i], cuts[i + 1]));
  std::shuffle(many.begin(), many.end(), rng);
  EXPECT_EQ(tiling_problem(tensor_of({4096, 3}, many)), "");
  many.push_back(flat(9999, cuts[100], cuts[100] + 1));
  p = tiling_problem(tensor_of({4096, 3}, many));
  EXPECT_TRUE(contains(p, "overlap") && contains(p, "rank_09999.h5")) << p.substr(0, 300);
  std::vector<ShardInfo> grid;
  for (int64_t i = 0; i < 64; ++i) {
    for (int64_t j = 0; j < 64; ++j)
      grid.push_back(box(static_cast<int>(i * 64 + j), {i * 2, j * 3}, {2, 3}));
  }
  EXPECT_EQ(tiling_problem(tensor_of({128, 192}, grid)), "");
  grid.push_back(flat(5000, 7 * 192 + 100, 7 * 192 + 101));  // row 7, column 100: box (3, 33)
  p = tiling_problem(tensor_of({128, 192}, grid));
  EXPECT_TRUE(contains(p, "overlap") && contains(p, "rank_05000.h5") &&
              contains(p, fmt::format("{} box [6, 99] + [2, 3]", rank_file_name(3 * 64 + 33))))
      << p.substr(0, 300);
}

TEST(CheckpointFlatTest, SaveStateValidatesFlatEntries) {
  auto refused = [](const SaveState& s, const std::string& part) {
    try {
      select_owned(s, 0, 1);
      ADD_FAILURE() << "accepted; expected: " << part;
    } catch (const CheckpointError& e) {
      EXPECT_TRUE(contains(e.what(), part) && contains(e.what(), "'optim/x'")) << e.what();
    }
  };
  SaveState ok;
  ok.add_flat_shard("optim/x", at::zeros({20}), {37, 13}, 461);
  ok.add_flat_shard("optim/empty", at::zeros({0}), {37, 13}, 481);
  const auto owned = select_owned(ok, 0, 1);
  ASSERT_EQ(owned.size(), 2u);
  EXPECT_EQ(owned[1].name, "optim/x");
  EXPECT_EQ(*owned[1].flat, (FlatRange{461, 481}));
  SaveState outside;
  outside.add_flat_shard("optim/x", at::zeros({21}), {37, 13}, 461);
  refused(outside, "outside");
  SaveState negative;
  negative.add_flat_shard("optim/x", at::zeros({2}), {37, 13}, -1);
  refused(negative, "outside");
  SaveState not_1d;
  not_1d.add_flat_shard("optim/x", at::zeros({2, 2}), {37, 13}, 0);
  refused(not_1d, "1-D");
  SaveState pieces;  // a box and a flat range of one tensor, disjoint: two pieces (format v4)
  pieces.add_shard("optim/x", at::zeros({1, 13}), {37, 13}, {0, 0});
  pieces.add_flat_shard("optim/x", at::zeros({13}), {37, 13}, 13);
  const auto two = select_owned(pieces, 0, 1);
  ASSERT_EQ(two.size(), 2u);
  EXPECT_EQ(two[0].piece, 0);
  EXPECT_EQ(two[1].piece, 1);
  SaveState twice;  // ... that overlap (element 12): refused
  twice.add_shard("optim/x", at::zeros({1, 13}), {37, 13}, {0, 0});
  twice.add_flat_shard("optim/x", at::zeros({13}), {37, 13}, 12);
  refused(twice, "overlapping");
  SaveState complex;
  complex.add_flat_shard("optim/x", at::zeros({2}, at::kComplexFloat), {4}, 0);
  refused(complex, "optim/x");
}

// Flat ranges (and a box) saved by 2 and by 4 ranks read back bitwise as whole tensors, as random
// boxes (reading only the overlap) and as the flat ranges of other rank counts (through their
// boxes), with the checksums verified without extra reads when the same ranges are read back.
TEST(CheckpointFlatTest, TwoAndFourRanksReloadIntoWholeTensorsBoxesAndOtherFlatRanges) {
  const uint64_t seed = ckpt_test::fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937_64 rng(seed);
  for (const int world : {2, 4}) {
    SCOPED_TRACE(fmt::format("saved by {} ranks", world));
    ScratchDir tmp("flat_rt");
    const Layout lay(world, rng);
    const std::string dir = (tmp / "checkpoints").string();
    lay.save(dir);

    CheckpointReader reader(dir);
    EXPECT_EQ(reader.metadata().format_version, kFlatFormatVersion);
    const TensorInfo& w = reader.info("optim/w.exp_avg");
    ASSERT_EQ(static_cast<int>(w.shards.size()), world);
    for (const ShardInfo& s : w.shards) {
      ASSERT_TRUE(s.is_flat());
      const int r = std::stoi(s.file.substr(5, 5));
      EXPECT_EQ(*s.flat, (FlatRange{lay.cuts.at(w.name)[static_cast<size_t>(r)],
                                    lay.cuts.at(w.name)[static_cast<size_t>(r) + 1]}));
    }
    EXPECT_EQ(static_cast<int>(reader.info("model/mix").shards.size()), world);
    for (const auto& [n, t] : lay.g) EXPECT_TRUE(bitwise_equal(reader.read(n), t)) << n;
    EXPECT_GT(reader.verify_all(), 0);

    // Random boxes of every tensor: exactly the overlap is read (no verification), and with
    // verification the flat shards read in part are checked too.
    for (int trial = 0; trial < 30; ++trial) {
      for (const char* name : {"optim/w.exp_avg", "optim/c.exp_avg_sq", "model/mix"}) {
        const at::Tensor& g = lay.g.at(name);
        std::vector<int64_t> off, len;
        for (int64_t d = 0; d < g.dim(); ++d) {
          const uint64_t n = static_cast<uint64_t>(g.size(d));
          off.push_back(static_cast<int64_t>(rng() % n));
          len.push_back(1 + static_cast<int64_t>(rng() % (n - static_cast<uint64_t>(off.back()))));
        }
        at::Tensor want = g;
        for (int64_t d = 0; d < g.dim(); ++d) want = want.narrow(d, off[d], len[d]);
        CheckpointReader quick(dir);
        at::Tensor out = at::empty(len, g.options());
        quick.read(name, out, off, ReadOptions{false, false});
        ASSERT_TRUE(bitwise_equal(out, want)) << name << " box " << off << " + " << len;
        EXPECT_EQ(quick.stats().bytes_read, static_cast<int64_t>(out.nbytes()));
        EXPECT_EQ(quick.stats().extra_bytes, 0) << "read more than the overlap";
        CheckpointReader verifying(dir);
        at::Tensor out2 = at::empty(len, g.options());
        verifying.read(name, out2, off);
        ASSERT_TRUE(bitwise_equal(out2, want)) << name << " box " << off << " + " << len;
      }
    }

    // The flat ranges of other rank counts (a ZeRO resume under another dp size or bucket size),
    // each rank loading its range through flat_load_targets.
    for (const int other : {1, 3, world}) {
      const bool same = other == world;
      for (int r = 0; r < other; ++r) {
        CheckpointReader rr(dir);
        std::vector<LoadTarget> targets;
        std::map<std::string, at::Tensor> dest;
        for (const char* name : {"optim/w.exp_avg", "optim/c.exp_avg_sq", "optim/v"}) {
          const at::Tensor& g = lay.g.at(name);
          const std::vector<int64_t> c = same ? lay.cuts.at(name) : even_cuts(g.numel(), other);
          const size_t i = static_cast<size_t>(r);
          dest[name] = at::empty({c[i + 1] - c[i]}, g.options());
          for (auto& t : flat_load_targets(name, dest[name], g.sizes().vec(), c[i]))
            targets.push_back(std::move(t));
          dest[std::string(name) + "@"] = flat_part(g, c[i], c[i + 1]);
        }
        rr.load(targets);
        for (const char* name : {"optim/w.exp_avg", "optim/c.exp_avg_sq", "optim/v"}) {
          EXPECT_TRUE(bitwise_equal(dest[name], dest[std::string(name) + "@"]))
              << name << " as rank " << r << " of " << other;
        }
        if (same) {
          // Every saved range read whole (through several boxes): checked on the bytes read.
          EXPECT_EQ(rr.stats().extra_bytes, 0) << "rank " << r;
          EXPECT_EQ(rr.stats().bytes_verified, rr.stats().bytes_read) << "rank " << r;
        }
      }
    }
    // A 0-d tensor held as a flat range loads as a whole tensor and as its one box.
    at::Tensor s = at::empty({}, at::kDouble);
    CheckpointReader(dir).load(flat_load_targets("optim/s", s.view({1}), {}, 0));
    EXPECT_TRUE(bitwise_equal(s, lay.g.at("optim/s")));
  }
}

TEST(CheckpointFlatTest, CommitRefusesOverlapsAndGapsNamingTheTensorAndFiles) {
  ScratchDir tmp("flat_bad");
  const std::string dir = (tmp / "checkpoints").string();
  const at::Tensor g = at::randn({37, 13});
  auto two = [&](int64_t b0, int64_t e0, int64_t b1, int64_t e1) {
    std::vector<SaveState> s(2);
    s[0].add_flat_shard("optim/x", flat_part(g, b0, e0), {37, 13}, b0);
    s[1].add_flat_shard("optim/x", flat_part(g, b1, e1), {37, 13}, b1);
    return s;
  };
  auto expect_refused = [&](const std::vector<SaveState>& states,
                            const std::vector<std::string>& parts) {
    const std::vector<std::string> errors = try_save(dir, states);
    for (size_t r = 0; r < errors.size(); ++r) {
      for (const std::string& part : parts)
        EXPECT_TRUE(contains(errors[r], part))
            << "rank " << r << ": '" << part << "' not in: " << errors[r];
    }
    EXPECT_FALSE(fs::exists(fs::path(dir) / "latest"));
    EXPECT_FALSE(fs::exists(fs::path(dir) / "step_00000003"));
  };
  expect_refused(two(0, 250, 240, 481), {"'optim/x'", "overlap", "rank_00000.h5 flat [0, 250)",
                                         "rank_00001.h5 flat [240, 481)"});
  expect_refused(two(0, 240, 250, 481),
                 {"'optim/x'", "cover 471 of 481", "rank_00000.h5", "rank_00001.h5"});
  // A box on rank 0 (rows [0, 3)) and a flat range on rank 1 that starts inside it.
  std::vector<SaveState> mixed(2);
  mixed[0].add_shard("optim/x", g.narrow(0, 0, 3), {37, 13}, {0, 0});
  mixed[1].add_flat_shard("optim/x", flat_part(g, 38, 481), {37, 13}, 38);
  expect_refused(mixed, {"'optim/x'", "overlap", "rank_00000.h5 box [0, 0] + [3, 13]",
                         "rank_00001.h5 flat [38, 481)"});
  // Exactly tiling: commits.
  std::vector<SaveState> good(2);
  good[0].add_shard("optim/x", g.narrow(0, 0, 3), {37, 13}, {0, 0});
  good[1].add_flat_shard("optim/x", flat_part(g, 39, 481), {37, 13}, 39);
  EXPECT_EQ(try_save(dir, good), (std::vector<std::string>{"", ""}));
  EXPECT_TRUE(bitwise_equal(CheckpointReader(dir).read("optim/x"), g));
}

TEST(CheckpointFlatTest, CorruptOrNonFiniteFlatShardIsFoundByTheReaderAndInspect) {
  ScratchDir tmp("flat_corrupt");
  std::mt19937_64 rng(ckpt_test::fresh_seed());
  const Layout lay(2, rng);
  const std::string dir = (tmp / "checkpoints").string();
  lay.save(dir);
  const std::string ckpt = (fs::path(dir) / "step_00000001").string();
  std::ostringstream good;
  InspectOptions listing;
  listing.list_shards = true;
  inspect(dir, good, listing);
  EXPECT_TRUE(contains(good.str(), "2 flat")) << good.str();    // the shards column of optim/v
  EXPECT_TRUE(contains(good.str(), "1+1 flat")) << good.str();  // model/mix: a box and a range
  EXPECT_TRUE(contains(good.str(), "rank_00001.h5 flat [501, 1001) (500 elements)")) << good.str();
  EXPECT_TRUE(contains(good.str(), ": OK")) << good.str();

  // One byte of rank 1's range of optim/v (elements [501, 1001)).
  corrupt_dataset_byte((fs::path(ckpt) / "rank_00001.h5").string(), "optim/v", 4 * 123 + 1);
  auto checksum_error = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const CheckpointError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  for (const std::string& m :
       {checksum_error([&] { CheckpointReader(dir).read("optim/v"); }),
        checksum_error([&] {  // rank 1's range read back whole, through its box
          at::Tensor d = at::empty({500});
          CheckpointReader(dir).load(flat_load_targets("optim/v", d, {1001}, 501));
        }),
        checksum_error([&] {  // a part of it: the shard is streamed to check it
          at::Tensor d = at::empty({10});
          CheckpointReader(dir).read("optim/v", d, {700});
        }),
        checksum_error([&] {
          std::ostringstream out;
          inspect(dir, out);
        })}) {
    EXPECT_TRUE(contains(m, "checksum mismatch") && contains(m, "rank_00001.h5") &&
                contains(m, "optim/v") && contains(m, "flat [501, 1001)"))
        << m;
  }
  // Rank 0's range of the same tensor still loads.
  at::Tensor d = at::empty({501});
  CheckpointReader(dir).load(flat_load_targets("optim/v", d, {1001}, 0));
  EXPECT_TRUE(bitwise_equal(d, flat_part(lay.g.at("optim/v"), 0, 501)));

  // A NaN and an infinity in flat ranges (committed only because allow_nonfinite is set).
  ScratchDir tmp2("flat_nan");
  auto store = c10::make_intrusive<c10d::HashStore>();
  run_ranks(2, [&](int r) {
    SaveState s = lay.state(r);
    for (auto& e : s.entries()) {
      if (e.name == "optim/w.exp_avg" && e.tensor.numel() > 0)
        e.tensor[0] = r == 0 ? std::numeric_limits<float>::quiet_NaN() : INFINITY;
    }
    CheckpointerOptions o;
    o.allow_nonfinite = true;
    Checkpointer ck((tmp2 / "checkpoints").string(), o, CommitGroup{r, 2, store});
    ck.save(1, s);
  });
  std::ostringstream out;
  const std::string m = checksum_error([&] { inspect((tmp2 / "checkpoints").string(), out); });
  EXPECT_TRUE(contains(m, "optim/w.exp_avg")) << m;
  // Rank 0 wrote a NaN and rank 1 an infinity into the first element of its range, if not empty.
  const int64_t cut = lay.cuts.at("optim/w.exp_avg")[1];
  EXPECT_TRUE(contains(out.str(), "NOT OK")) << out.str();
  EXPECT_TRUE(contains(out.str(), fmt::format("non-finite: optim/w.exp_avg: {} NaN, {} inf",
                                              cut > 0 ? 1 : 0, cut < 481 ? 1 : 0)))
      << out.str();
}

// `export --format weights` of a checkpoint whose model tensors are flat ranges: whole tensors.
TEST(CheckpointFlatTest, ExportWritesWholeTensorsFromFlatRanges) {
  ScratchDir tmp("flat_export");
  std::mt19937_64 rng(ckpt_test::fresh_seed());
  auto gen = at::make_generator<at::CPUGeneratorImpl>(rng());
  const at::Tensor w = random_tensor(at::kFloat, {37, 13}, gen);
  const at::Tensor b = random_tensor(at::kFloat, {37}, gen);
  const std::vector<int64_t> cw = random_cuts(481, 4, rng, true),
                             cb = random_cuts(37, 4, rng, false);
  auto store = c10::make_intrusive<c10d::HashStore>();
  run_ranks(4, [&](int r) {
    const size_t i = static_cast<size_t>(r);
    SaveState s;
    s.add_flat_shard("model/weight", flat_part(w, cw[i], cw[i + 1]), {37, 13}, cw[i]);
    s.add_flat_shard("model/bias", flat_part(b, cb[i], cb[i + 1]), {37}, cb[i]);
    Checkpointer ck((tmp / "checkpoints").string(), CheckpointerOptions{},
                    CommitGroup{r, 4, store});
    ck.save(2, s);
  });
  const std::string out = (tmp / "weights.h5").string();
  EXPECT_EQ(export_weights((tmp / "checkpoints").string(), out, at::kFloat), 2);
  torch::nn::Linear fc(13, 37);  // parameters "weight" [37, 13] and "bias" [37]
  const WeightsReport rep = load_weights(*fc, out);
  EXPECT_TRUE(rep.clean()) << rep.summary();
  EXPECT_TRUE(bitwise_equal(fc->weight.detach(), w));
  EXPECT_TRUE(bitwise_equal(fc->bias.detach(), b));
}

// Several pieces of one tensor in one rank file (format version 4): a tensor-parallel rank's boxes
// of a fused qkv weight [3 D, in] (one per part: rows [k D + r D/2, +D/2) on rank r of 2) and a
// ZeRO-style flat range of another tensor cut into boxes, all saved by 2 ranks and read back whole,
// as random boxes, and into another layout; pieces that overlap on one rank are refused.
TEST(CheckpointFlatTest, SeveralPiecesOfATensorPerRankFileRoundTrip) {
  const uint64_t seed = ckpt_test::fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937_64 rng(seed);
  const int64_t d = 6, in = 5;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const at::Tensor qkv = at::randn({3 * d, in}, gen);
  const at::Tensor m = at::randn({7, 9}, gen);
  ScratchDir tmp("pieces");
  const std::string dir = (tmp / "checkpoints").string();
  auto store = c10::make_intrusive<c10d::HashStore>();
  run_ranks(2, [&](int r) {
    SaveState s;
    for (int64_t k = 0; k < 3; ++k) {
      const int64_t row = k * d + r * d / 2;
      s.add_shard("model/qkv.weight", qkv.narrow(0, row, d / 2).clone(), {3 * d, in}, {row, 0});
    }
    // Rank r holds rows [r 4, r 4 + 3) of m in two pieces: a flat range of its first row's tail
    // and a box of the rest.
    const int64_t first = r * 4;
    s.add_flat_shard("model/m", m[first].narrow(0, 0, 9).clone(), {7, 9}, first * 9);
    const int64_t rows = r == 0 ? 3 : 2;
    s.add_shard("model/m", m.narrow(0, first + 1, rows).clone(), {7, 9}, {first + 1, 0});
    CheckpointerOptions o;
    o.timeout_s = 60;
    Checkpointer ck(dir, o, CommitGroup{r, 2, store});
    ck.save(1, s);
  });
  CheckpointReader reader(dir);
  EXPECT_EQ(reader.metadata().format_version, kPieceFormatVersion);
  const TensorInfo& t = reader.info("model/qkv.weight");
  ASSERT_EQ(t.shards.size(), 6u);
  std::map<std::string, std::vector<int>> pieces;
  for (const ShardInfo& s : t.shards) pieces[s.file].push_back(s.piece);
  for (auto& [file, p] : pieces) {
    std::sort(p.begin(), p.end());
    EXPECT_EQ(p, (std::vector<int>{0, 1, 2})) << file;
  }
  EXPECT_TRUE(bitwise_equal(reader.read("model/qkv.weight"), qkv));
  EXPECT_TRUE(bitwise_equal(reader.read("model/m"), m));
  EXPECT_GT(reader.verify_all(), 0);
  // tp 3 of the same tensor: rank r's per-part boxes, each from pieces of both saved files.
  for (int r = 0; r < 3; ++r) {
    for (int64_t k = 0; k < 3; ++k) {
      const int64_t row = k * d + r * d / 3;
      at::Tensor out = at::empty({d / 3, in});
      CheckpointReader(dir).read("model/qkv.weight", out, {row, 0});
      EXPECT_TRUE(bitwise_equal(out, qkv.narrow(0, row, d / 3)))
          << "tp rank " << r << " part " << k;
    }
  }
  for (int trial = 0; trial < 20; ++trial) {
    const int64_t r0 = static_cast<int64_t>(rng() % 7), c0 = static_cast<int64_t>(rng() % 9);
    const int64_t nr = 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(7 - r0));
    const int64_t nc = 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(9 - c0));
    at::Tensor out = at::empty({nr, nc});
    CheckpointReader(dir).read("model/m", out, {r0, c0});
    EXPECT_TRUE(bitwise_equal(out, m.narrow(0, r0, nr).narrow(1, c0, nc)));
  }
  // Overlapping pieces of one tensor on one rank: one error naming the tensor and both pieces.
  SaveState bad;
  bad.add_shard("model/qkv.weight", qkv.narrow(0, 0, 4).clone(), {3 * d, in}, {0, 0});
  bad.add_shard("model/qkv.weight", qkv.narrow(0, 3, 4).clone(), {3 * d, in}, {3, 0});
  try {
    select_owned(bad, 0, 1);
    ADD_FAILURE() << "overlapping pieces accepted";
  } catch (const CheckpointError& e) {
    EXPECT_TRUE(contains(e.what(), "model/qkv.weight") && contains(e.what(), "overlapping") &&
                contains(e.what(), "[0, 0]") && contains(e.what(), "[3, 0]"))
        << e.what();
  }
}
