// Every failure mode gives a CheckpointError / IoError naming the file and the tensor, and leaves
// what was there intact: missing shard, checksum mismatch, truncated file, wrong format version,
// shape and dtype mismatch (destination untouched), full disk during save (previous checkpoint
// still `latest`), plus `inspect` on a good and a corrupted checkpoint.
#include "checkpoint/checkpointer.h"
#include "checkpoint/files.h"
#include "checkpoint/inspect.h"
#include "checkpoint/reader.h"
#include "core/error.h"
#include "test_util.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <hdf5.h>

#include <sys/resource.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <sstream>

using namespace parallax;
using namespace parallax::checkpoint;
using parallax::ckpt_test::bitwise_equal;
using parallax::ckpt_test::contains;
using parallax::ckpt_test::random_tensor;
using parallax::ckpt_test::ScratchDir;
namespace fs = std::filesystem;

namespace {

// A committed checkpoint of step 7 with a few tensors; returns its directory.
struct Fixture {
  ScratchDir tmp{"err"};
  std::map<std::string, at::Tensor> tensors;
  std::string ckpt;
  std::string file;  // its rank file

  Fixture() {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(ckpt_test::fresh_seed());
    tensors["model/a"] = random_tensor(at::kFloat, {64, 32}, gen);
    tensors["model/b"] = random_tensor(at::kBFloat16, {128}, gen);
    tensors["optim/c"] = random_tensor(at::kLong, {3, 3}, gen);
    SaveState s;
    for (const auto& [n, t] : tensors) s.add_replicated(n, t);
    Checkpointer ck((tmp / "checkpoints").string(), CheckpointerOptions{}, CommitGroup{});
    ck.save(7, s);
    ckpt = (tmp / "checkpoints" / "step_00000007").string();
    file = (fs::path(ckpt) / "rank_00000.h5").string();
  }

  // Flips one byte inside tensor `name`'s data in the rank file.
  void corrupt(const std::string& name) const {
    hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    hid_t d = H5Dopen2(f, name.c_str(), H5P_DEFAULT);
    const haddr_t off = H5Dget_offset(d);
    H5Dclose(d);
    H5Fclose(f);
    ASSERT_NE(off, HADDR_UNDEF);
    std::fstream io(file, std::ios::in | std::ios::out | std::ios::binary);
    io.seekg(static_cast<std::streamoff>(off) + 5);
    char c = 0;
    io.read(&c, 1);
    c = static_cast<char>(c ^ 0x5a);
    io.seekp(static_cast<std::streamoff>(off) + 5);
    io.write(&c, 1);
  }
};

template <class E, class F>
std::string expect_error(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
    return "";
  }
  ADD_FAILURE() << "no exception";
  return "";
}

}  // namespace

TEST(CheckpointErrorTest, MissingShardFileNamesFileAndTensor) {
  Fixture fx;
  fs::remove(fx.file);
  const std::string m = expect_error<CheckpointError>([&] {
    CheckpointReader r(fx.ckpt);
    r.read("model/a");
  });
  EXPECT_TRUE(contains(m, "rank_00000.h5") && contains(m, "missing") && contains(m, "model/a"))
      << m;
}

TEST(CheckpointErrorTest, ChecksumMismatchNamesFileAndTensorAndInspectFails) {
  Fixture fx;
  std::ostringstream good;
  inspect(fx.ckpt, good);
  EXPECT_TRUE(contains(good.str(), "step 7")) << good.str();
  EXPECT_TRUE(contains(good.str(), "model/b")) << good.str();
  EXPECT_TRUE(contains(good.str(), "bfloat16")) << good.str();
  EXPECT_TRUE(contains(good.str(), ": OK")) << good.str();

  fx.corrupt("model/b");
  const std::string m = expect_error<CheckpointError>([&] {
    CheckpointReader r(fx.ckpt);
    r.read("model/b");
  });
  EXPECT_TRUE(contains(m, "checksum mismatch") && contains(m, "rank_00000.h5") &&
              contains(m, "model/b"))
      << m;
  // Other tensors of the same file still load.
  CheckpointReader r(fx.ckpt);
  EXPECT_TRUE(bitwise_equal(r.read("model/a"), fx.tensors["model/a"]));
  std::ostringstream bad;
  const std::string mi = expect_error<CheckpointError>([&] { inspect(fx.ckpt, bad); });
  EXPECT_TRUE(contains(mi, "model/b") && contains(mi, "rank_00000.h5")) << mi;
  // Without verification the corruption goes unnoticed (it is the checksum that catches it).
  at::Tensor out = at::empty({128}, at::kBFloat16);
  CheckpointReader(fx.ckpt).read("model/b", out, {}, ReadOptions{false, false});
  EXPECT_FALSE(bitwise_equal(out, fx.tensors["model/b"]));
}

TEST(CheckpointErrorTest, TruncatedFileIsDetected) {
  Fixture fx;
  fs::resize_file(fx.file, fs::file_size(fx.file) / 2);
  const std::string m = expect_error<CheckpointError>([&] {
    CheckpointReader r(fx.ckpt);
    r.read("optim/c");
  });
  EXPECT_TRUE(contains(m, "truncated") && contains(m, "rank_00000.h5") && contains(m, "optim/c"))
      << m;
}

TEST(CheckpointErrorTest, WrongFormatVersionAndMissingMetadata) {
  Fixture fx;
  const std::string mpath = (fs::path(fx.ckpt) / "metadata.json").string();
  std::string text = files::read_text(mpath);
  // The fixture holds boxes only: written as version 2 (format.h).
  const std::string current = fmt::format("\"format_version\": {}", kBoxFormatVersion);
  const auto pos = text.find(current);
  ASSERT_NE(pos, std::string::npos);
  text.replace(pos, current.size(), "\"format_version\": 9");
  files::write_durable(mpath, text);
  const std::string m = expect_error<CheckpointError>([&] { CheckpointReader r(fx.ckpt); });
  EXPECT_TRUE(contains(m, "version 9") && contains(m, "metadata.json")) << m;
  fs::remove(mpath);
  const std::string m2 = expect_error<CheckpointError>([&] { CheckpointReader r(fx.ckpt); });
  EXPECT_TRUE(contains(m2, "metadata.json")) << m2;
  // `latest` now points at an incomplete checkpoint.
  const std::string m3 =
      expect_error<CheckpointError>([&] { CheckpointReader r(fx.tmp.str() + "/checkpoints"); });
  EXPECT_TRUE(contains(m3, "latest")) << m3;
}

TEST(CheckpointErrorTest, ShapeAndDtypeMismatchLeaveDestinationsUntouched) {
  Fixture fx;
  CheckpointReader r(fx.ckpt);
  at::Tensor a = at::full({64, 31}, 1.5f);  // wrong shape
  at::Tensor c = at::full({3, 3}, 7, at::kLong);
  const std::string m = expect_error<CheckpointError>([&] {
    r.load({{"optim/c", c, {}}, {"model/a", a, {}}});
  });
  EXPECT_TRUE(contains(m, "model/a") && contains(m, "[64, 32]") &&
              contains(m, "nothing was loaded"))
      << m;
  EXPECT_TRUE(at::equal(c, at::full({3, 3}, 7, at::kLong)))
      << "a destination was written before the error";
  at::Tensor b = at::zeros({128}, at::kFloat);  // bf16 saved, fp32 destination
  const std::string m2 = expect_error<CheckpointError>([&] { r.read("model/b", b); });
  EXPECT_TRUE(contains(m2, "bfloat16") && contains(m2, "float32")) << m2;
  r.read("model/b", b, {}, ReadOptions{true, true});  // explicit cast allowed
  EXPECT_TRUE(at::equal(b, fx.tensors["model/b"].to(at::kFloat)));
  const std::string m3 = expect_error<CheckpointError>([&] { r.read("model/aa"); });
  EXPECT_TRUE(contains(m3, "did you mean 'model/a'")) << m3;
}

TEST(CheckpointErrorTest, FullDiskDuringSaveKeepsPreviousCheckpoint) {
  Fixture fx;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(ckpt_test::fresh_seed());
  SaveState big;
  big.add_replicated("model/a", random_tensor(at::kFloat, {1024, 1024}, gen));  // 4 MiB
  // The file size limit makes writes past 1 MiB fail with EFBIG, as a full disk fails them with
  // ENOSPC: the same code path (a failed write inside HDF5).
  rlimit old{};
  getrlimit(RLIMIT_FSIZE, &old);
  auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit lim = old;
  lim.rlim_cur = 1 << 20;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &lim), 0);
  std::string m;
  {
    Checkpointer ck((fx.tmp / "checkpoints").string(), CheckpointerOptions{}, CommitGroup{});
    m = expect_error<IoError>([&] { ck.save(8, big); });
  }
  setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_TRUE(contains(m, "rank_00000.h5") && contains(m, "model/a")) << m;
  EXPECT_TRUE(contains(m, "File too large") || contains(m, "write failed")) << m;
  // Nothing of step 8 remains; `latest` still names step 7, which loads and verifies.
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(fx.tmp / "checkpoints"))
    names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"latest", "step_00000007"}));
  CheckpointReader r((fx.tmp / "checkpoints").string());
  EXPECT_EQ(r.metadata().step, 7);
  EXPECT_GT(r.verify_all(), 0);
  EXPECT_TRUE(bitwise_equal(r.read("model/a"), fx.tensors["model/a"]));
}

TEST(CheckpointErrorTest, NotACheckpointPath) {
  ScratchDir tmp("nock");
  const std::string m = expect_error<CheckpointError>([&] { CheckpointReader r(tmp.str()); });
  EXPECT_TRUE(contains(m, tmp.str())) << m;
  EXPECT_FALSE(is_checkpoint_path(tmp.str()));
  EXPECT_THROW(CheckpointReader r(tmp.str() + "/nope"), CheckpointError);
}
