// The format's pure parts: metadata.json round trip and validation, names, the block iterator,
// the size-balanced ownership.
#include "checkpoint/format.h"
#include "checkpoint/h5.h"
#include "checkpoint/save_state.h"
#include "checkpoint/tensor_io.h"
#include "core/error.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <map>
#include <numeric>
#include <random>

using namespace parallax;
using namespace parallax::checkpoint;

namespace {

Metadata sample_metadata(std::mt19937_64& rng) {
  Metadata m;
  m.step = static_cast<int64_t>(rng() % 100000);
  m.layout = {2, 2, 1};
  m.world = 4;
  m.config_hash = "0123456789abcdef";
  m.created = "2025-01-02T03:04:05Z";
  for (int r = 0; r < 4; ++r)
    m.files.push_back({rank_file_name(r), r, static_cast<int64_t>(rng() % 100000)});
  m.extra["loss_scaler.scale"] = 65536.0;
  m.extra["lr"] = 3.0e-4;
  m.extra["data.epoch"] = static_cast<int64_t>(rng() % 1000);
  m.extra["note"] = std::string("quote \" backslash \\ tab \t end");
  m.extra["numeric_string"] = std::string("123");
  TensorInfo t;
  t.name = "model/blocks.0.fc.weight";
  t.dtype = at::kBFloat16;
  t.shape = {8, 6};
  for (int r = 0; r < 2; ++r) {
    t.shards.push_back({rank_file_name(r), {0, 3 * r}, {8, 3}, static_cast<uint32_t>(rng()), {}});
  }
  m.tensors.emplace(t.name, t);
  TensorInfo s;
  s.name = "optim/step";
  s.dtype = at::kDouble;
  s.shards.push_back({rank_file_name(3), {}, {}, static_cast<uint32_t>(rng()), {}});
  m.tensors.emplace(s.name, s);
  return m;
}

}  // namespace

TEST(CheckpointFormatTest, MetadataJsonRoundTripsEveryField) {
  std::mt19937_64 rng(ckpt_test::fresh_seed());
  const Metadata m = sample_metadata(rng);
  const Metadata r = Metadata::from_json(m.to_json(), "test");
  EXPECT_EQ(r.format_version, kFormatVersion);
  EXPECT_EQ(r.step, m.step);
  EXPECT_EQ(r.layout.dp, 2);
  EXPECT_EQ(r.layout.tp, 2);
  EXPECT_EQ(r.world, 4);
  EXPECT_EQ(r.config_hash, m.config_hash);
  EXPECT_EQ(r.created, m.created);
  ASSERT_EQ(r.files.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(r.files[i].name, m.files[i].name);
    EXPECT_EQ(r.files[i].bytes, m.files[i].bytes);
  }
  EXPECT_EQ(r.extra_double("loss_scaler.scale"), 65536.0);
  EXPECT_EQ(r.extra_double("lr"), 3.0e-4);
  EXPECT_EQ(r.extra_int("data.epoch"), std::get<int64_t>(m.extra.at("data.epoch")));
  EXPECT_EQ(r.extra_string("note"), std::get<std::string>(m.extra.at("note")));
  EXPECT_EQ(r.extra_string("numeric_string"), "123");
  EXPECT_THROW(r.extra_int("loss_scaler.scale"), CheckpointError);
  EXPECT_THROW(r.extra_int("absent"), CheckpointError);
  ASSERT_EQ(r.tensors.size(), 2u);
  const TensorInfo& t = r.tensors.at("model/blocks.0.fc.weight");
  EXPECT_EQ(t.dtype, at::kBFloat16);
  EXPECT_EQ(t.shape, (std::vector<int64_t>{8, 6}));
  ASSERT_EQ(t.shards.size(), 2u);
  EXPECT_EQ(t.shards[1].offsets, (std::vector<int64_t>{0, 3}));
  EXPECT_EQ(t.shards[1].crc32, m.tensors.at(t.name).shards[1].crc32);
  EXPECT_TRUE(r.tensors.at("optim/step").shape.empty());
}

TEST(CheckpointFormatTest, RejectsNewerVersionForeignFormatAndBadShards) {
  std::mt19937_64 rng(ckpt_test::fresh_seed());
  Metadata m = sample_metadata(rng);
  m.format_version = kFormatVersion + 1;
  try {
    Metadata::from_json(m.to_json(), "ck/metadata.json");
    FAIL() << "newer version accepted";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("newer"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("ck/metadata.json"), std::string::npos) << e.what();
  }
  m.format_version = kFormatVersion;
  std::string text = m.to_json();
  const std::string foreign =
      std::string(text).replace(text.find(kFormatName), 19, "something-else-enti");
  EXPECT_THROW(Metadata::from_json(foreign, "x"), CheckpointError);
  // A shard that does not tile the tensor.
  m.tensors.at("model/blocks.0.fc.weight").shards.pop_back();
  EXPECT_THROW(Metadata::from_json(m.to_json(), "x"), CheckpointError);
  EXPECT_THROW(Metadata::from_json("{ not json", "x"), CheckpointError);
}

TEST(CheckpointFormatTest, NamesAndStepDirectories) {
  EXPECT_EQ(step_dir_name(100), "step_00000100");
  EXPECT_EQ(step_dir_name(123456789), "step_123456789");
  EXPECT_EQ(parse_step_dir_name("step_00000100"), 100);
  EXPECT_EQ(parse_step_dir_name("step_123456789"), 123456789);
  EXPECT_FALSE(parse_step_dir_name("step_100"));
  EXPECT_FALSE(parse_step_dir_name(".tmp-step_00000100-ab"));
  EXPECT_FALSE(parse_step_dir_name("step_0000010x"));
  EXPECT_EQ(rank_file_name(3), "rank_00003.h5");
  EXPECT_EQ(rank_local_name(3, "rng/cpu"), "rank/3/rng/cpu");
  EXPECT_NO_THROW(validate_tensor_name("model/blocks.0.fc.weight"));
  EXPECT_THROW(validate_tensor_name(""), CheckpointError);
  EXPECT_THROW(validate_tensor_name("a//b"), CheckpointError);
  EXPECT_THROW(validate_tensor_name("/a"), CheckpointError);
  EXPECT_THROW(validate_tensor_name("a/../b"), CheckpointError);
  EXPECT_THROW(validate_tensor_name("a\nb"), CheckpointError);
}

TEST(CheckpointFormatTest, BlocksTileBoxesInCOrderWithinBudget) {
  std::mt19937_64 rng(ckpt_test::fresh_seed());
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<int64_t> dims(rng() % 5);
    int64_t numel = 1;
    for (auto& d : dims) {
      d = 1 + static_cast<int64_t>(rng() % 7);
      numel *= d;
    }
    const int64_t esize = int64_t{1} << (rng() % 4);
    const int64_t budget = 1 + static_cast<int64_t>(rng() % 200);
    int64_t next = 0;
    h5::for_each_block(dims, esize, budget, [&](const h5::Block& b) {
      ASSERT_EQ(b.byte_offset, next);
      int64_t vol = 1, lin = 0;
      for (size_t d = 0; d < dims.size(); ++d) {
        vol *= static_cast<int64_t>(b.count[d]);
        lin = lin * dims[d] + static_cast<int64_t>(b.start[d]);
      }
      EXPECT_EQ(vol * esize, b.bytes);
      EXPECT_EQ(lin * esize, b.byte_offset);
      EXPECT_LE(b.bytes, std::max(budget, esize)) << "block over budget";
      next += b.bytes;
    });
    EXPECT_EQ(next, numel * esize);
  }
}

TEST(CheckpointOwnershipTest, BalancedDeterministicAndExactlyOnce) {
  std::mt19937_64 rng(ckpt_test::fresh_seed());
  std::vector<int64_t> bytes;
  std::vector<std::string> names;
  for (int i = 0; i < 200; ++i) {
    bytes.push_back(static_cast<int64_t>(1 + rng() % 100000));
    names.push_back(fmt::format("t{}", i));
  }
  const int members = 4;
  const auto owner = balance_owners(bytes, names, members);
  std::vector<int64_t> load(members, 0);
  for (size_t i = 0; i < owner.size(); ++i) load[static_cast<size_t>(owner[i])] += bytes[i];
  const int64_t total = std::accumulate(bytes.begin(), bytes.end(), int64_t{0});
  const int64_t biggest = *std::max_element(bytes.begin(), bytes.end());
  for (int64_t l : load) EXPECT_LE(l, total / members + biggest) << "greedy bound violated";
  EXPECT_EQ(balance_owners(bytes, names, members), owner);

  // select_owned over a simulated world: every replicated tensor owned by exactly one rank, with
  // the entries added in a different order on each rank.
  const int world = 3;
  std::map<std::string, int> owners;
  for (int r = 0; r < world; ++r) {
    SaveState s;
    std::vector<int> order(20);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    for (int i : order) s.add_replicated(fmt::format("p{}", i), at::zeros({1 + i % 5}));
    s.add_rank_local("rng", at::zeros({3}));
    for (const auto& e : select_owned(s, r, world)) {
      if (e.name.rfind("rank/", 0) == 0) {
        EXPECT_EQ(e.name, rank_local_name(r, "rng"));
        continue;
      }
      EXPECT_TRUE(owners.emplace(e.name, r).second) << e.name << " owned twice";
    }
  }
  EXPECT_EQ(owners.size(), 20u);
}

TEST(CheckpointOwnershipTest, RejectsBadEntries) {
  SaveState dup;
  dup.add_replicated("a", at::zeros({2}));
  dup.add_replicated("a", at::zeros({2}));
  EXPECT_THROW(select_owned(dup, 0, 1), CheckpointError);
  SaveState outside;
  outside.add_shard("a", at::zeros({3}), {4}, {2});
  EXPECT_THROW(select_owned(outside, 0, 1), CheckpointError);
  SaveState not_member;
  not_member.add_replicated("a", at::zeros({2}), {1, 2});
  EXPECT_THROW(select_owned(not_member, 0, 3), CheckpointError);
  SaveState complex;
  complex.add_replicated("c", at::zeros({2}, at::kComplexFloat));
  EXPECT_THROW(select_owned(complex, 0, 1), CheckpointError);
  SaveState nonfinite;
  EXPECT_THROW(nonfinite.set_extra("x", std::nan("")), CheckpointError);
}

TEST(CheckpointFormatTest, ParallelCrc32EqualsZlibSequential) {
  std::mt19937_64 rng(ckpt_test::fresh_seed());
  std::vector<uint8_t> buf((20 << 20) + 12345);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  const int64_t n = static_cast<int64_t>(buf.size());
  const uint32_t seq = tensor_io::crc32_update(0, buf.data(), n, false);
  EXPECT_EQ(tensor_io::crc32_update(0, buf.data(), n, true), seq);
  const int64_t half = n / 3;
  const uint32_t first = tensor_io::crc32_update(0, buf.data(), half, true);
  EXPECT_EQ(tensor_io::crc32_update(first, buf.data() + half, n - half, true), seq);
  EXPECT_EQ(tensor_io::crc32_update(0, "123456789", 9, false),
            0xCBF43926u);  // the CRC-32 check value
}
