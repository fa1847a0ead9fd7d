// A checkpoint never commits NaN or infinity and protects its own metadata:
//   - the finiteness scan finds one non-finite element of any floating dtype at any position, on
//     contiguous and strided tensors, and ignores integer dtypes;
//   - a save whose state holds NaN or inf is refused (sync and async), naming the step, the tensor
//     and the rank; the previous checkpoint stays `latest` and keep_last=1 does not prune it;
//   - `inspect` lists non-finite tensors with a NOT OK verdict and an error; export refuses them
//     unless forced;
//   - metadata.json carries its own checksum: an edited step is refused naming the file, and a
//     step that is not its directory's is refused;
//   - the resolved config saved beside metadata.json reads back and is verified.
#include "checkpoint/checkpointer.h"
#include "checkpoint/files.h"
#include "checkpoint/finite.h"
#include "checkpoint/inspect.h"
#include "checkpoint/reader.h"
#include "checkpoint/weights.h"
#include "core/error.h"
#include "test_util.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <random>
#include <sstream>

using namespace parallax;
using namespace parallax::checkpoint;
using parallax::ckpt_test::contains;
using parallax::ckpt_test::random_tensor;
using parallax::ckpt_test::ScratchDir;
namespace fs = std::filesystem;

namespace {

template <class F>
std::string checkpoint_error(F&& f) {
  try {
    f();
  } catch (const CheckpointError& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
    return "";
  }
  ADD_FAILURE() << "no exception";
  return "";
}

const std::vector<at::ScalarType> kFloating = {at::kFloat,    at::kDouble,        at::kHalf,
                                               at::kBFloat16, at::kFloat8_e4m3fn, at::kFloat8_e5m2};

// A copy of `t` (any floating dtype) with element `i` set to `value` through float32.
at::Tensor with_value_at(const at::Tensor& t, int64_t i, float value) {
  at::Tensor f = t.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true).contiguous();
  f.view({-1})[i] = value;
  return f.to(t.scalar_type());
}

SaveState state_of(const std::map<std::string, at::Tensor>& tensors) {
  SaveState s;
  for (const auto& [n, t] : tensors) s.add_replicated(n, t);
  return s;
}

}  // namespace

TEST(CheckpointFiniteTest, FindsOneNonFiniteElementOfEveryFloatingDtypeAnywhere) {
  std::mt19937_64 rng(ckpt_test::fresh_seed());
  auto gen = at::make_generator<at::CPUGeneratorImpl>(rng());
  const float kInf = std::numeric_limits<float>::infinity();
  const float kNaN = std::numeric_limits<float>::quiet_NaN();
  for (const at::ScalarType dtype : kFloating) {
    // Sizes around the parallel grain (2^18) so that both the serial and the split scan run.
    for (const int64_t n : {int64_t{1}, int64_t{1000}, int64_t{(1 << 19) + 17}}) {
      const at::Tensor clean = random_tensor(at::kFloat, {n}, gen).clamp(-100, 100).to(dtype);
      for (const bool parallel : {false, true}) {
        EXPECT_TRUE(all_finite(clean.const_data_ptr(), n, dtype, parallel)) << dtype << " " << n;
      }
      for (const float bad : {kNaN, kInf, -kInf}) {
        // float8_e4m3fn has no infinity (an overflow saturates to its largest value).
        if (dtype == at::kFloat8_e4m3fn && std::isinf(bad)) continue;
        const int64_t at = static_cast<int64_t>(rng() % static_cast<uint64_t>(n));
        const at::Tensor t = with_value_at(clean, at, bad);
        for (const bool parallel : {false, true}) {
          EXPECT_FALSE(all_finite(t.const_data_ptr(), n, dtype, parallel))
              << dtype << " n=" << n << " value " << bad << " at " << at;
        }
        EXPECT_EQ(first_nonfinite({clean, t}, true), 1) << dtype;
      }
    }
  }
  // Largest finite values are finite.
  const at::Tensor big = at::full({7}, std::numeric_limits<float>::max());
  EXPECT_TRUE(all_finite(big.const_data_ptr(), 7, at::kFloat, false));
}

TEST(CheckpointFiniteTest, FirstNonFiniteOverMixedStridedAndIntegerTensors) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(ckpt_test::fresh_seed());
  const at::Tensor ints = random_tensor(at::kLong, {40}, gen);
  const at::Tensor a = random_tensor(at::kFloat, {16, 9}, gen);
  at::Tensor b = random_tensor(at::kFloat, {12, 10}, gen);
  b[3][7] = std::numeric_limits<float>::quiet_NaN();
  const at::Tensor strided = b.t();  // not contiguous: reduced with isfinite().all()
  ASSERT_FALSE(strided.is_contiguous());
  at::Tensor c = random_tensor(at::kBFloat16, {33}, gen);
  c[32] = -std::numeric_limits<float>::infinity();
  EXPECT_EQ(first_nonfinite({ints, a, strided, c}, true), 2);
  EXPECT_EQ(first_nonfinite({ints, a, c, strided}, false), 2);
  EXPECT_EQ(first_nonfinite({ints, a, at::Tensor(), at::empty({0})}, true), -1);
  const NonFiniteCount n = count_nonfinite(c);
  EXPECT_EQ(n.nan, 0);
  EXPECT_EQ(n.inf, 1);
  EXPECT_EQ(count_nonfinite(strided).nan, 1);
}

TEST(CheckpointFiniteTest, NonFiniteSaveIsRefusedAndKeepLastKeepsTheNewestFinite) {
  for (const bool async : {false, true}) {
    ScratchDir tmp("finite");
    auto gen = at::make_generator<at::CPUGeneratorImpl>(ckpt_test::fresh_seed());
    std::map<std::string, at::Tensor> t;
    t["model/a"] = random_tensor(at::kFloat, {64, 8}, gen);
    t["model/b"] = random_tensor(at::kBFloat16, {100}, gen);
    t["optim/a.exp_avg_sq"] = random_tensor(at::kFloat, {64, 8}, gen).abs();
    t["optim/step"] = at::full({1}, 2.0, at::kDouble);
    CheckpointerOptions o;
    o.keep_last = 1;
    o.async = async;
    const std::string dir = (tmp / "checkpoints").string();
    Checkpointer ck(dir, o, CommitGroup{});
    ck.save(2, state_of(t));
    ck.wait();
    // The optimizer state overflows: the save of step 4 must not commit, nor prune step 2.
    t["optim/a.exp_avg_sq"][5][3] = std::numeric_limits<float>::infinity();
    t["optim/a.exp_avg_sq"][9][1] = std::numeric_limits<float>::quiet_NaN();
    const std::string m = checkpoint_error([&] {
      ck.save(4, state_of(t));
      ck.wait();
    });
    EXPECT_TRUE(contains(m, "step 4") && contains(m, "refused") &&
                contains(m, "optim/a.exp_avg_sq") && contains(m, "rank 0") &&
                contains(m, "1 NaN") && contains(m, "1 infinite"))
        << m;
    EXPECT_EQ(CheckpointReader(dir).metadata().step, 2) << "async=" << async;
    EXPECT_TRUE(fs::exists(fs::path(dir) / "step_00000002"));
    EXPECT_FALSE(fs::exists(fs::path(dir) / "step_00000004"));
    for (const auto& e : fs::directory_iterator(dir))
      EXPECT_FALSE(contains(e.path().filename().string(), ".tmp-")) << e.path();
    // A NaN in a bf16 parameter as well.
    t["optim/a.exp_avg_sq"] = t["optim/a.exp_avg_sq"].nan_to_num(0, 0, 0);
    t["model/b"][17] = std::numeric_limits<float>::quiet_NaN();
    const std::string m2 = checkpoint_error([&] {
      ck.save(6, state_of(t));
      ck.wait();
    });
    EXPECT_TRUE(contains(m2, "step 6") && contains(m2, "model/b")) << m2;
    // Finite again: the next save commits and only then prunes step 2.
    t["model/b"][17] = 1.0f;
    ck.save(8, state_of(t));
    ck.wait();
    EXPECT_EQ(CheckpointReader(dir).metadata().step, 8);
    EXPECT_FALSE(fs::exists(fs::path(dir) / "step_00000002"));
  }
}

TEST(CheckpointFiniteTest, InspectReportsNonFiniteTensorsAndExportRefusesUnlessForced) {
  ScratchDir tmp("inspect_nan");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(ckpt_test::fresh_seed());
  std::map<std::string, at::Tensor> t;
  t["model/fc.weight"] = random_tensor(at::kFloat, {6, 5}, gen);
  t["model/fc.bias"] = random_tensor(at::kFloat, {6}, gen);
  t["model/fc.weight"][1][2] = std::numeric_limits<float>::quiet_NaN();
  t["model/fc.weight"][4][0] = std::numeric_limits<float>::quiet_NaN();
  t["model/fc.bias"][0] = -std::numeric_limits<float>::infinity();
  CheckpointerOptions o;
  o.allow_nonfinite = true;  // a checkpoint as an older Parallax could commit it
  Checkpointer((tmp / "checkpoints").string(), o, CommitGroup{}).save(3, state_of(t));
  const std::string ckpt = (tmp / "checkpoints").string();

  std::ostringstream out;
  const std::string m = checkpoint_error([&] { inspect(ckpt, out); });
  EXPECT_TRUE(contains(m, "2 tensor(s)") && contains(m, "model/fc.weight") &&
              contains(m, "model/fc.bias") && contains(m, "step 3"))
      << m;
  EXPECT_TRUE(contains(out.str(), "non-finite: model/fc.weight: 2 NaN, 0 inf (in rank_00000.h5)"))
      << out.str();
  EXPECT_TRUE(contains(out.str(), "non-finite: model/fc.bias: 0 NaN, 1 inf")) << out.str();
  EXPECT_TRUE(contains(out.str(), "NOT OK")) << out.str();

  const std::string weights = (tmp / "weights.h5").string();
  const std::string e = checkpoint_error([&] { export_weights(ckpt, weights, at::kFloat); });
  EXPECT_TRUE(contains(e, "model/fc.bias") && contains(e, "--force")) << e;
  EXPECT_FALSE(fs::exists(weights));
  EXPECT_EQ(export_weights(ckpt, weights, at::kFloat, /*allow_nonfinite=*/true), 2);
  EXPECT_TRUE(fs::exists(weights));
}

TEST(CheckpointMetadataTest, EditedMetadataIsRefusedNamingTheFile) {
  ScratchDir tmp("meta_edit");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(ckpt_test::fresh_seed());
  std::map<std::string, at::Tensor> t{{"model/w", random_tensor(at::kFloat, {5, 3}, gen)}};
  Checkpointer((tmp / "checkpoints").string(), CheckpointerOptions{}, CommitGroup{})
      .save(15, state_of(t));
  const std::string ckpt = (tmp / "checkpoints" / "step_00000015").string();
  const std::string mpath = ckpt + "/metadata.json";
  const std::string good = files::read_text(mpath);
  EXPECT_EQ(CheckpointReader(ckpt).metadata().step, 15);

  std::string edited = good;
  const size_t pos = edited.find("\"step\": 15,");
  ASSERT_NE(pos, std::string::npos);
  edited.replace(pos, 11, "\"step\": 999,");
  files::write_durable(mpath, edited);
  for (const std::string& path : {ckpt, (tmp / "checkpoints").string()}) {
    const std::string m = checkpoint_error([&] { CheckpointReader r(path); });
    EXPECT_TRUE(contains(m, "metadata.json") && contains(m, "checksum mismatch")) << m;
  }
  std::ostringstream out;
  EXPECT_TRUE(contains(checkpoint_error([&] { inspect(ckpt, out); }), "checksum mismatch"));

  // Without the checksum line (as a version 2 file) it is refused too.
  std::string stripped = good;
  stripped.erase(2, stripped.find('\n', 2) - 1);
  ASSERT_EQ(stripped.rfind("{\n  \"format\"", 0), 0u) << stripped.substr(0, 40);
  files::write_durable(mpath, stripped);
  EXPECT_TRUE(contains(checkpoint_error([&] { CheckpointReader r(ckpt); }), "checksum line"));

  // A consistent metadata.json in a directory named for another step (copied or renamed by hand).
  files::write_durable(mpath, good);
  fs::rename(ckpt, tmp / "checkpoints" / "step_00000016");
  const std::string m = checkpoint_error(
      [&] { CheckpointReader r((tmp / "checkpoints" / "step_00000016").string()); });
  EXPECT_TRUE(contains(m, "step 15") && contains(m, "step 16")) << m;
}

TEST(CheckpointMetadataTest, VersionOneMetadataWithoutChecksumStillReads) {
  std::mt19937_64 rng(ckpt_test::fresh_seed());
  Metadata m;
  m.format_version = 1;
  m.step = static_cast<int64_t>(rng() % 100000);
  m.files.push_back({rank_file_name(0), 0, 1234});
  TensorInfo t;
  t.name = "model/w";
  t.shape = {4};
  t.shards.push_back({rank_file_name(0), {0}, {4}, static_cast<uint32_t>(rng()), {}});
  m.tensors.emplace(t.name, t);
  std::string text = m.to_json();
  text.erase(2, text.find('\n', 2) - 1);  // what version 1 wrote: no checksum line
  const Metadata r = Metadata::from_json(text, "v1/metadata.json");
  EXPECT_EQ(r.step, m.step);
  EXPECT_EQ(r.format_version, 1);
  EXPECT_FALSE(r.config.has_value());
}

TEST(CheckpointMetadataTest, ResolvedConfigIsSavedBesideAndVerified) {
  ScratchDir tmp("config");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(ckpt_test::fresh_seed());
  std::map<std::string, at::Tensor> t{{"model/w", random_tensor(at::kFloat, {5, 3}, gen)}};
  CheckpointerOptions o;
  o.config_text = "optim:\n  lr: 0.003\nmodel:\n  size: tiny\n# seed " +
                  std::to_string(ckpt_test::fresh_seed()) + "\n";
  Checkpointer((tmp / "checkpoints").string(), o, CommitGroup{}).save(1, state_of(t));
  const std::string ckpt = (tmp / "checkpoints" / "step_00000001").string();
  CheckpointReader r(ckpt);
  ASSERT_TRUE(r.metadata().config.has_value());
  EXPECT_EQ(r.config_text(), o.config_text);
  EXPECT_GT(r.verify_all(), 0);
  files::write_durable(ckpt + "/config.yaml", "optim:\n  lr: 0.1\n");
  CheckpointReader r2(ckpt);
  const std::string m = checkpoint_error([&] { r2.config_text(); });
  EXPECT_TRUE(contains(m, "config.yaml") && contains(m, "does not match")) << m;
  EXPECT_TRUE(contains(checkpoint_error([&] { r2.verify_all(); }), "config.yaml"));
  // A checkpoint saved without a config has none.
  Checkpointer((tmp / "other").string(), CheckpointerOptions{}, CommitGroup{}).save(2, state_of(t));
  EXPECT_FALSE(CheckpointReader((tmp / "other").string()).config_text().has_value());
}
