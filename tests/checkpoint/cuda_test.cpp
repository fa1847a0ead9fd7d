// GPU tensors (skipped where no CUDA device exists): a synchronous save streams them through one
// bounded staging buffer (host memory stays bounded), an async save snapshots them, loads go back
// into GPU tensors (whole and boxes), the CUDA generator state resumes exactly, and non-finite GPU
// state is found on the device and refused.
#include "checkpoint/checkpointer.h"
#include "checkpoint/finite.h"
#include "checkpoint/reader.h"
#include "checkpoint/training_state.h"
#include "test_util.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <string>

using namespace parallax;
using namespace parallax::checkpoint;
using parallax::ckpt_test::bitwise_equal;
using parallax::ckpt_test::random_tensor;
using parallax::ckpt_test::ScratchDir;

namespace {

bool has_cuda() {
  return at::hasCUDA() && at::detail::getCUDAHooks().deviceCount() > 0;
}

double status_mb(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) return std::stod(line.substr(std::string(key).size())) / 1024.0;
  }
  return -1;
}

}  // namespace

TEST(CheckpointCudaTest, SyncSaveStreamsGpuTensorsWithBoundedHostMemory) {
  if (!has_cuda()) GTEST_SKIP() << "no CUDA device";
  ScratchDir tmp("cuda");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(ckpt_test::fresh_seed());
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  std::map<std::string, at::Tensor> t;
  for (int i = 0; i < 8; ++i)
    t[fmt::format("model/w{}", i)] = random_tensor(at::kFloat, {4096, 2048}, gen).to(at::kCUDA);
  t["model/bf16"] = random_tensor(at::kBFloat16, {1000, 333}, gen).to(at::kCUDA);
  t["model/ids"] = random_tensor(at::kLong, {12345}, gen).to(at::kCUDA);
  t["model/strided"] = random_tensor(at::kFloat, {512, 256}, gen).to(at::kCUDA).t();
  SaveState s;
  for (const auto& [n, x] : t) s.add_replicated(n, x);
  CheckpointerOptions o;
  o.block_bytes = 4 << 20;
  Checkpointer ck((tmp / "checkpoints").string(), o, CommitGroup{});
  {  // warm-up (allocator, HDF5, pinned staging buffer)
    SaveState w;
    w.add_replicated("x", at::ones({1 << 20}, cuda));
    Checkpointer(tmp.str() + "/warm", o, CommitGroup{}).save(0, w);
  }
  const double rss_before = status_mb("VmRSS:");
  { std::ofstream("/proc/self/clear_refs") << "5"; }
  ck.save(1, s);
  const double peak = status_mb("VmHWM:");
  // 256 MiB of GPU tensors went through a 4 MiB staging buffer.
  EXPECT_LT(peak - rss_before, 64.0)
      << "host memory grew by " << peak - rss_before << " MiB during the save";
  CheckpointReader r((tmp / "checkpoints").string());
  for (const auto& [n, x] : t) {
    at::Tensor dest = at::empty(x.sizes(), x.options());
    r.read(n, dest);
    EXPECT_TRUE(dest.is_cuda());
    EXPECT_TRUE(bitwise_equal(dest, x)) << n;
  }
  at::Tensor box = at::empty({100, 50}, at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA));
  r.read("model/bf16", box, {900, 283});
  EXPECT_TRUE(bitwise_equal(box, t["model/bf16"].narrow(0, 900, 100).narrow(1, 283, 50)));
}

TEST(CheckpointCudaTest, AsyncSnapshotOfGpuTensors) {
  if (!has_cuda()) GTEST_SKIP() << "no CUDA device";
  ScratchDir tmp("cuda_async");
  at::Tensor w = at::randn({1 << 22}, at::TensorOptions().device(at::kCUDA));
  const at::Tensor at_save = w.clone();
  SaveState s;
  s.add_replicated("model/w", w);
  CheckpointerOptions o;
  o.async = true;
  Checkpointer ck((tmp / "checkpoints").string(), o, CommitGroup{});
  ck.save(1, s);
  w.add_(1.0f);  // training goes on on the GPU
  ck.wait();
  CheckpointReader r((tmp / "checkpoints").string());
  EXPECT_TRUE(bitwise_equal(r.read("model/w"), at_save));
}

TEST(CheckpointCudaTest, CudaGeneratorStateResumesExactly) {
  if (!has_cuda()) GTEST_SKIP() << "no CUDA device";
  ScratchDir tmp("cuda_rng");
  at::manual_seed(static_cast<uint64_t>(ckpt_test::fresh_seed() % 100000));
  (void)at::rand({10}, at::TensorOptions().device(at::kCUDA));
  SaveState s;
  add_rng(s);
  Checkpointer((tmp / "ck").string(), CheckpointerOptions{}, CommitGroup{}).save(1, s);
  const at::Tensor a = at::rand({1000}, at::TensorOptions().device(at::kCUDA));
  const at::Tensor b = at::rand({1000});
  (void)at::rand({77}, at::TensorOptions().device(at::kCUDA));
  CheckpointReader r((tmp / "ck").string());
  EXPECT_TRUE(r.contains(rank_local_name(0, "rng/cuda/0")));
  ASSERT_TRUE(load_rng(r, 0));
  EXPECT_TRUE(bitwise_equal(at::rand({1000}, at::TensorOptions().device(at::kCUDA)), a));
  EXPECT_TRUE(bitwise_equal(at::rand({1000}), b));
}

// GPU tensors are checked on their device (one isfinite().all() each, chunked above 64 Mi elements,
// one copy of the flags): a NaN in a large GPU tensor, in a strided one or in a float8 one is
// found, and a mix of CPU and GPU tensors reports the first culprit in order; a sync save refuses
// it.
TEST(CheckpointCudaTest, NonFiniteGpuStateIsFoundOnTheDeviceAndRefused) {
  if (!has_cuda()) GTEST_SKIP() << "no CUDA device";
  auto gen = at::make_generator<at::CPUGeneratorImpl>(ckpt_test::fresh_seed());
  at::Tensor big = random_tensor(at::kFloat, {(int64_t{64} << 20) + 4097}, gen).to(at::kCUDA);
  at::Tensor strided = random_tensor(at::kBFloat16, {300, 200}, gen).to(at::kCUDA).t();
  at::Tensor fp8 =
      random_tensor(at::kFloat, {999}, gen).clamp(-100, 100).to(at::kCUDA).to(at::kFloat8_e4m3fn);
  const at::Tensor cpu = random_tensor(at::kFloat, {77}, gen);
  EXPECT_EQ(first_nonfinite({cpu, big, strided, fp8}, true), -1);
  big[(int64_t{64} << 20) + 11] = std::numeric_limits<float>::infinity();  // in the second chunk
  strided[5][7] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(first_nonfinite({cpu, strided, big}, true), 1);
  EXPECT_EQ(first_nonfinite({cpu, big, strided}, true), 1);
  EXPECT_EQ(count_nonfinite(big).inf, 1);
  at::Tensor fp8_bits = fp8.view(at::kByte);
  fp8_bits[500] = 0x7f;  // float8_e4m3fn's NaN
  EXPECT_EQ(first_nonfinite({cpu, fp8}, false), 1);
  ScratchDir tmp("cuda_nan");
  SaveState s;
  s.add_replicated("model/cpu", cpu);
  s.add_replicated("model/strided", strided);
  Checkpointer ck((tmp / "checkpoints").string(), CheckpointerOptions{}, CommitGroup{});
  try {
    ck.save(3, s);
    ADD_FAILURE() << "a NaN GPU tensor was committed";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("'model/strided' holds 1 NaN"), std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(std::filesystem::exists(tmp / "checkpoints" / "step_00000003"));
}
