// Save and load in one process: bitwise round trips of every dtype, metadata.json content,
// resharded reads of arbitrary boxes, several ranks simulated by threads sharing a c10d HashStore
// (the same commit protocol as under mpirun), keep_last pruning and leftover cleaning.
#include "checkpoint/checkpointer.h"
#include "checkpoint/files.h"
#include "checkpoint/reader.h"
#include "checkpoint/resume.h"
#include "core/error.h"
#include "core/strings.h"
#include "test_util.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <yaml-cpp/yaml.h>

#include <filesystem>
#include <fstream>

using namespace parallax;
using namespace parallax::checkpoint;
using parallax::ckpt_test::bitwise_equal;
using parallax::ckpt_test::random_tensor;
using parallax::ckpt_test::run_ranks;
using parallax::ckpt_test::ScratchDir;
namespace fs = std::filesystem;

namespace {

CommitGroup single() {
  return CommitGroup{};
}

std::vector<std::string> dir_names(const fs::path& p) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(p)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

TEST(CheckpointRoundTripTest, SingleRankEveryDtypeBitwiseAndMetadata) {
  ScratchDir tmp("rt1");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(ckpt_test::fresh_seed());
  std::map<std::string, at::Tensor> saved;
  SaveState s;
  const std::vector<std::pair<std::string, at::ScalarType>> kinds = {
      {"float32", at::kFloat}, {"float64", at::kDouble}, {"bfloat16", at::kBFloat16},
      {"float16", at::kHalf},  {"int64", at::kLong},     {"int32", at::kInt},
      {"int8", at::kChar},     {"uint8", at::kByte},     {"bool", at::kBool}};
  for (const auto& [n, dt] : kinds) {
    saved["model/" + n] = random_tensor(dt, {5, 7, 3}, gen);
    s.add_replicated("model/" + n, saved["model/" + n]);
  }
  saved["model/scalar"] = random_tensor(at::kFloat, {}, gen);
  s.add_replicated("model/scalar", saved["model/scalar"]);
  saved["model/empty"] = at::empty({0, 4});
  s.add_replicated("model/empty", saved["model/empty"]);
  // Non-contiguous source (a transposed view): stored in its logical C order.
  const at::Tensor base = random_tensor(at::kFloat, {6, 9}, gen);
  saved["model/transposed"] = base.t();
  s.add_replicated("model/transposed", base.t());
  // Special float values survive bitwise (non-finite ones only where explicitly allowed, below).
  saved["model/special"] = at::tensor({0.0f, -0.0f, INFINITY, -INFINITY, NAN, 1e-45f});
  s.add_replicated("model/special", saved["model/special"]);
  s.add_rank_local("rng/cpu", at::arange(10, at::kByte));
  s.set_extra("train.step", int64_t{42});
  s.set_extra("loss_scaler.scale", 32768.0);
  s.set_extra("run", "demo");

  CheckpointerOptions o;
  o.config_hash = "feedfacecafebeef";
  o.block_bytes = 4096;  // force several blocks per tensor
  o.allow_nonfinite = true;
  {
    Checkpointer ck((tmp / "checkpoints").string(), o, single());
    ck.save(42, s);
    ASSERT_TRUE(ck.last_save().has_value());
    EXPECT_EQ(ck.last_save()->path, (tmp / "checkpoints" / "step_00000042").string());
  }
  EXPECT_EQ(core::trim(files::read_text((tmp / "checkpoints" / "latest").string())),
            "step_00000042");
  EXPECT_EQ(dir_names(tmp / "checkpoints" / "step_00000042"),
            (std::vector<std::string>{"metadata.json", "rank_00000.h5"}));

  // metadata.json, read independently with yaml-cpp (a JSON parser).
  const YAML::Node j =
      YAML::LoadFile((tmp / "checkpoints" / "step_00000042" / "metadata.json").string());
  EXPECT_EQ(j["format"].as<std::string>(), "parallax-checkpoint");
  // Every shard is a box: written as version 2, which builds before flat shards read.
  EXPECT_EQ(j["format_version"].as<int>(), kBoxFormatVersion);
  EXPECT_EQ(j["step"].as<int>(), 42);
  EXPECT_EQ(j["config_hash"].as<std::string>(), "feedfacecafebeef");
  EXPECT_EQ(j["layout"]["world"].as<int>(), 1);
  EXPECT_EQ(j["layout"]["dp"].as<int>(), 1);
  EXPECT_EQ(j["extra"]["train.step"].as<int>(), 42);
  EXPECT_EQ(j["extra"]["loss_scaler.scale"].as<double>(), 32768.0);
  EXPECT_EQ(j["extra"]["run"].as<std::string>(), "demo");
  EXPECT_EQ(j["files"][0]["name"].as<std::string>(), "rank_00000.h5");
  EXPECT_EQ(j["files"][0]["bytes"].as<int64_t>(),
            files::file_size((tmp / "checkpoints" / "step_00000042" / "rank_00000.h5").string()));
  EXPECT_EQ(j["tensors"]["model/bfloat16"]["dtype"].as<std::string>(), "bfloat16");
  EXPECT_EQ(j["tensors"]["model/bfloat16"]["shape"].as<std::vector<int>>(),
            (std::vector<int>{5, 7, 3}));
  EXPECT_EQ(j["tensors"]["model/bfloat16"]["shards"].size(), 1u);
  EXPECT_EQ(j["tensors"]["model/transposed"]["shape"].as<std::vector<int>>(),
            (std::vector<int>{9, 6}));
  EXPECT_TRUE(j["tensors"]["rank/0/rng/cpu"].IsDefined());

  CheckpointReader reader((tmp / "checkpoints").string());  // via `latest`
  EXPECT_EQ(reader.metadata().step, 42);
  for (const auto& [name, t] : saved) {
    const at::Tensor back = reader.read(name);
    EXPECT_TRUE(bitwise_equal(back, t.contiguous())) << name;
  }
  EXPECT_TRUE(bitwise_equal(reader.read("rank/0/rng/cpu"), at::arange(10, at::kByte)));
  // Reading into an existing destination of another layout (non-contiguous) works too.
  at::Tensor dest = at::empty({3, 7, 5}).permute({2, 1, 0});
  reader.read("model/float32", dest);
  EXPECT_TRUE(bitwise_equal(dest.contiguous(), saved["model/float32"]));
  EXPECT_GT(reader.verify_all(), 0);
}

TEST(CheckpointRoundTripTest, FourThreadRanksReplicatedAndShardedThroughTheStore) {
  ScratchDir tmp("rt4");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(ckpt_test::fresh_seed());
  const int world = 4;
  // Global tensors; ranks hold replicas or slices of them.
  std::map<std::string, at::Tensor> global;
  for (int i = 0; i < 12; ++i) {
    global["model/p" + std::to_string(i)] =
        random_tensor(i % 3 ? at::kFloat : at::kBFloat16, {1 + 7 * i, 5}, gen);
  }
  global["optim/flat"] = random_tensor(at::kFloat, {1001}, gen);    // ZeRO-like, uneven chunks
  global["model/tp"] = random_tensor(at::kBFloat16, {6, 10}, gen);  // split along dim 1
  global["model/ids"] = random_tensor(at::kLong, {17}, gen);
  auto store = c10::make_intrusive<c10d::HashStore>();
  const auto chunk = [](int64_t n, int parts, int i) {
    const int64_t base = n / parts, rem = n % parts;
    return std::pair<int64_t, int64_t>{i * base + std::min<int64_t>(i, rem),
                                       base + (i < rem ? 1 : 0)};
  };
  const std::string dir = (tmp / "checkpoints").string();
  std::vector<int64_t> written(world, 0);
  for (int round = 0; round < 2; ++round) {  // two saves: instance/sequence keys must not collide
    run_ranks(world, [&](int r) {
      SaveState s;
      for (const auto& [n, t] : global) {
        if (n.rfind("model/p", 0) == 0 || n == "model/ids") s.add_replicated(n, t.clone());
      }
      const auto [off, len] = chunk(1001, world, r);
      s.add_shard("optim/flat", global["optim/flat"].narrow(0, off, len).clone(), {1001}, {off});
      const auto [c0, cl] = chunk(10, world, r);
      s.add_shard("model/tp", global["model/tp"].narrow(1, c0, cl), {6, 10}, {0, c0});
      s.add_rank_local("sampler", at::full({2}, r, at::kLong));
      s.set_extra("round", int64_t{round});
      CheckpointerOptions o;
      o.keep_last = 5;
      o.timeout_s = 60;
      Checkpointer ck(dir, o, CommitGroup{r, world, store});
      ck.save(10 + round, s);
      written[static_cast<size_t>(r)] = ck.last_save()->bytes;
      EXPECT_EQ(ck.last_save()->path, (fs::path(dir) / step_dir_name(10 + round)).string());
    });
  }
  CheckpointReader reader(dir);
  EXPECT_EQ(reader.metadata().step, 11);
  EXPECT_EQ(reader.metadata().world, 4);
  EXPECT_EQ(reader.metadata().layout.dp, 4);
  EXPECT_EQ(reader.metadata().files.size(), 4u);
  EXPECT_EQ(reader.metadata().extra_int("round"), 1);
  EXPECT_EQ(reader.info("optim/flat").shards.size(), 4u);
  EXPECT_EQ(reader.info("model/tp").shards.size(), 4u);
  EXPECT_EQ(reader.info("model/p3").shards.size(), 1u);  // replicated: written once
  for (const auto& [n, t] : global) EXPECT_TRUE(bitwise_equal(reader.read(n), t)) << n;
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(
        bitwise_equal(reader.read(rank_local_name(r, "sampler")), at::full({2}, r, at::kLong)));
  }
  // Replicated bytes are spread: no rank writes more than the average plus the largest tensor.
  int64_t total = 0, biggest = 0;
  for (const auto& [n, t] : global) {
    total += static_cast<int64_t>(t.nbytes());
    biggest = std::max<int64_t>(biggest, static_cast<int64_t>(t.nbytes()));
  }
  for (int64_t w : written) {
    EXPECT_GT(w, 0);
    EXPECT_LE(w, total / world + biggest + 64);
  }
}

TEST(CheckpointReshardTest, ArbitraryBoxesReadOnlyTheOverlap) {
  ScratchDir tmp("boxes");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(ckpt_test::fresh_seed());
  const at::Tensor g = random_tensor(at::kFloat, {9, 10, 4}, gen);
  auto store = c10::make_intrusive<c10d::HashStore>();
  // 2 x 2 grid of shards over dims 0 and 1, on 4 thread ranks.
  run_ranks(4, [&](int r) {
    const int64_t o0 = (r / 2) * 5, l0 = r / 2 ? 4 : 5, o1 = (r % 2) * 3, l1 = r % 2 ? 7 : 3;
    SaveState s;
    s.add_shard("w", g.narrow(0, o0, l0).narrow(1, o1, l1), {9, 10, 4}, {o0, o1, 0});
    Checkpointer ck((tmp / "ck").string(), CheckpointerOptions{}, CommitGroup{r, 4, store});
    ck.save(1, s);
  });
  std::mt19937_64 rng(ckpt_test::fresh_seed());
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<int64_t> off(3), len(3);
    for (int d = 0; d < 3; ++d) {
      const int64_t n = g.size(d);
      off[d] = static_cast<int64_t>(rng() % static_cast<uint64_t>(n));
      len[d] = 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(n - off[d]));
    }
    CheckpointReader reader((tmp / "ck").string());
    at::Tensor out = at::empty(len, at::kFloat);
    reader.read("w", out, off, ReadOptions{false, false});
    const at::Tensor want =
        g.narrow(0, off[0], len[0]).narrow(1, off[1], len[1]).narrow(2, off[2], len[2]);
    ASSERT_TRUE(bitwise_equal(out, want)) << "box " << off << " + " << len;
    EXPECT_EQ(reader.stats().bytes_read, out.nbytes());
    EXPECT_EQ(reader.stats().extra_bytes, 0);
    // With verification, partially read shards are checksummed too.
    CheckpointReader verifying((tmp / "ck").string());
    at::Tensor out2 = at::empty(len, at::kFloat);
    verifying.read("w", out2, off);
    EXPECT_TRUE(bitwise_equal(out2, want));
  }
}

TEST(CheckpointAtomicTest, KeepLastPrunesOnlyAfterCommitAndLeftoversAreCleaned) {
  ScratchDir tmp("keep");
  const fs::path dir = tmp / "checkpoints";
  CheckpointerOptions o;
  o.keep_last = 2;
  Checkpointer ck(dir.string(), o, single());
  auto gen = at::make_generator<at::CPUGeneratorImpl>(ckpt_test::fresh_seed());
  std::map<int64_t, at::Tensor> values;
  for (int64_t step = 1; step <= 3; ++step) {
    SaveState s;
    values[step] = random_tensor(at::kFloat, {16}, gen);
    s.add_replicated("model/w", values[step]);
    ck.save(step * 10, s);
  }
  EXPECT_EQ(dir_names(dir), (std::vector<std::string>{"latest", "step_00000020", "step_00000030"}));
  // Leftovers of killed saves and prunes, and of a killed `latest` update.
  fs::create_directories(dir / ".tmp-step_00000040-deadbeef");
  std::ofstream(dir / ".tmp-step_00000040-deadbeef" / "rank_00000.h5") << "partial";
  fs::create_directories(dir / ".tmp-prune-step_00000005-ab");
  std::ofstream(dir / "latest.tmp-0123") << "step_00000040";
  SaveState s;
  values[4] = random_tensor(at::kFloat, {16}, gen);
  s.add_replicated("model/w", values[4]);
  ck.save(40, s);
  EXPECT_EQ(dir_names(dir), (std::vector<std::string>{"latest", "step_00000030", "step_00000040"}));
  // Saving the same step again replaces it (atomically exchanged).
  SaveState again;
  values[5] = random_tensor(at::kFloat, {16}, gen);
  again.add_replicated("model/w", values[5]);
  ck.save(40, again);
  EXPECT_EQ(dir_names(dir), (std::vector<std::string>{"latest", "step_00000030", "step_00000040"}));
  CheckpointReader latest(dir.string());
  EXPECT_TRUE(bitwise_equal(latest.read("model/w"), values[5]));
  CheckpointReader older((dir / "step_00000030").string());
  EXPECT_TRUE(bitwise_equal(older.read("model/w"), values[3]));
  // The trainer's resume policy.
  EXPECT_EQ(resume_checkpoint("auto", dir.string()), (dir / "step_00000040").string());
  EXPECT_EQ(resume_checkpoint((dir / "step_00000030").string(), dir.string()),
            (dir / "step_00000030").string());
  EXPECT_EQ(resume_checkpoint(tmp.str(), dir.string()),
            (dir / "step_00000040").string());  // a run directory
  EXPECT_FALSE(resume_checkpoint("", dir.string()));
  EXPECT_FALSE(resume_checkpoint("auto", (tmp / "nothing_yet").string()));
  EXPECT_THROW(resume_checkpoint((tmp / "nothing_yet").string(), dir.string()), CheckpointError);
}

// Issue 35, item 4: train.resume=auto when `latest` is lost or names a step that does not verify.
TEST(CheckpointResumeTest, LostOrBrokenLatestFallsBackToTheNewestStepThatVerifies) {
  ScratchDir tmp("resume_fallback");
  const fs::path dir = tmp / "checkpoints";
  CheckpointerOptions o;
  o.keep_last = 0;
  Checkpointer ck(dir.string(), o, single());
  auto gen = at::make_generator<at::CPUGeneratorImpl>(ckpt_test::fresh_seed());
  for (int64_t step = 10; step <= 40; step += 10) {
    SaveState s;
    s.add_replicated("model/w", random_tensor(at::kFloat, {16}, gen));
    ck.save(step, s);
  }
  const auto step_dir = [&](int64_t step) { return (dir / step_dir_name(step)).string(); };
  // `latest` verifies: it is used, without a warning.
  auto p = find_resume_point("auto", dir.string());
  ASSERT_TRUE(p);
  EXPECT_EQ(p->path, step_dir(40));
  EXPECT_EQ(p->step, 40);
  EXPECT_TRUE(p->warnings.empty());
  EXPECT_EQ(checkpoint_problem(step_dir(40)), "");
  // `latest` lost: the newest step that verifies, with a warning naming it.
  fs::remove(dir / kLatestFile);
  p = find_resume_point("auto", dir.string());
  ASSERT_TRUE(p);
  EXPECT_EQ(p->path, step_dir(40));
  ASSERT_EQ(p->warnings.size(), 1u);
  EXPECT_NE(p->warnings[0].find("latest' is missing"), std::string::npos) << p->warnings[0];
  EXPECT_NE(p->warnings[0].find("step 40"), std::string::npos) << p->warnings[0];
  // The newest one truncated as well: skipped, with its problem in the warning.
  const fs::path rank_file = fs::path(step_dir(40)) / rank_file_name(0);
  fs::resize_file(rank_file, fs::file_size(rank_file) / 2);
  EXPECT_NE(checkpoint_problem(step_dir(40)).find("truncated"), std::string::npos);
  p = find_resume_point("auto", dir.string());
  ASSERT_TRUE(p);
  EXPECT_EQ(p->path, step_dir(30));
  ASSERT_EQ(p->warnings.size(), 1u);
  EXPECT_NE(p->warnings[0].find("skipped: step 40"), std::string::npos) << p->warnings[0];
  // `latest` names a broken step: the newest older step that verifies, never a newer one.
  files::write_atomic((dir / kLatestFile).string(), step_dir_name(30) + "\n");
  fs::remove(fs::path(step_dir(30)) / kMetadataFile);
  fs::resize_file(rank_file, 0);
  p = find_resume_point("auto", dir.string());
  ASSERT_TRUE(p);
  EXPECT_EQ(p->path, step_dir(20));
  ASSERT_EQ(p->warnings.size(), 1u);
  EXPECT_NE(p->warnings[0].find("names step_00000030, which cannot be resumed from"),
            std::string::npos)
      << p->warnings[0];
  // An edited metadata.json (its checksum no longer matches) does not verify either.
  {
    const fs::path meta = fs::path(step_dir(20)) / kMetadataFile;
    std::string text = files::read_text(meta.string());
    text.replace(text.find("\"step\": 20"), 10, "\"step\": 21");
    std::ofstream(meta) << text;
  }
  p = find_resume_point("auto", dir.string());
  ASSERT_TRUE(p);
  EXPECT_EQ(p->path, step_dir(10));
  // Garbage in `latest`: the newest step that verifies.
  std::ofstream(dir / kLatestFile) << "not a step\n";
  p = find_resume_point("auto", dir.string());
  ASSERT_TRUE(p);
  EXPECT_EQ(p->path, step_dir(10));
  EXPECT_NE(p->warnings[0].find("not a checkpoint directory name"), std::string::npos);
  // Nothing verifies: an error naming each step's problem, never a fresh start.
  fs::remove(fs::path(step_dir(10)) / rank_file_name(0));
  try {
    find_resume_point("auto", dir.string());
    ADD_FAILURE() << "no checkpoint verifies, yet a resume point was found";
  } catch (const CheckpointError& e) {
    const std::string m = e.what();
    for (const char* part : {"Not starting over", "step 10: ", "is missing", "step 40: "})
      EXPECT_NE(m.find(part), std::string::npos) << part << " not in: " << m;
  }
  fs::remove(dir / kLatestFile);
  EXPECT_THROW(find_resume_point("auto", dir.string()), CheckpointError);
  // Only a checkpoints directory that never held a step is a fresh start.
  EXPECT_FALSE(find_resume_point("auto", (tmp / "empty").string()));
  fs::create_directories(tmp / "empty");
  EXPECT_FALSE(find_resume_point("auto", (tmp / "empty").string()));
}

// Issue 35, item 5: the `latest` pointer is a checkpoint path wherever one is accepted.
TEST(CheckpointResumeTest, TheLatestPointerIsACheckpointPath) {
  ScratchDir tmp("latest_path");
  const fs::path dir = tmp / "checkpoints";
  Checkpointer ck(dir.string(), CheckpointerOptions{}, single());
  auto gen = at::make_generator<at::CPUGeneratorImpl>(ckpt_test::fresh_seed());
  const at::Tensor w = random_tensor(at::kFloat, {8}, gen);
  SaveState s;
  s.add_replicated("model/w", w);
  ck.save(7, s);
  const std::string latest = (dir / kLatestFile).string();
  EXPECT_TRUE(is_checkpoint_path(latest));
  EXPECT_EQ(resolve_checkpoint(latest), (dir / step_dir_name(7)).string());
  EXPECT_TRUE(bitwise_equal(CheckpointReader(latest).read("model/w"), w));
  EXPECT_EQ(find_resume_point(latest, "")->step, 7);
  // A symbolic link named latest, to a step directory.
  fs::create_directories(tmp / "linked");
  fs::create_directory_symlink(fs::absolute(dir / step_dir_name(7)), tmp / "linked" / kLatestFile);
  EXPECT_TRUE(is_checkpoint_path((tmp / "linked" / kLatestFile).string()));
  EXPECT_TRUE(bitwise_equal(CheckpointReader((tmp / "linked").string()).read("model/w"), w));
  // Any other file is still refused, naming what is expected.
  std::ofstream(tmp / "notes.txt") << "step_00000007\n";
  try {
    resolve_checkpoint((tmp / "notes.txt").string());
    ADD_FAILURE() << "a plain file was taken for a checkpoint";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("not a checkpoint directory"), std::string::npos);
  }
  // A `latest` naming a missing step is an error naming both.
  std::ofstream(latest) << "step_00000009\n";
  EXPECT_FALSE(is_checkpoint_path(latest));
  EXPECT_THROW(resolve_checkpoint(latest), CheckpointError);
}
