// Async save (training continues, snapshot semantics, injected write errors surface on poll),
// weights-only loading (strict and non-strict), weights export, and exact resume of a model +
// AdamW + RNG through a checkpoint.
#include "checkpoint/checkpointer.h"
#include "checkpoint/checksum_error.h"
#include "checkpoint/reader.h"
#include "checkpoint/training_state.h"
#include "checkpoint/weights.h"
#include "core/error.h"
#include "core/rng.h"
#include "optim/optimizer.h"
#include "test_util.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <thread>

using namespace parallax;
using namespace parallax::checkpoint;
using parallax::ckpt_test::bitwise_equal;
using parallax::ckpt_test::random_tensor;
using parallax::ckpt_test::ScratchDir;
namespace fs = std::filesystem;

namespace {

struct Net : torch::nn::Module {
  explicit Net(int64_t hidden = 16, bool extra = false) {
    fc1 = register_module("fc1", torch::nn::Linear(8, hidden));
    bn = register_module("bn", torch::nn::BatchNorm1d(hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, 4));
    if (extra) head = register_module("head", torch::nn::Linear(4, 2));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = fc2(at::relu(bn(fc1(x))));
    return head ? head(y) : y;
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, head{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};

void randomize(torch::nn::Module& m, at::Generator gen) {
  at::NoGradGuard g;
  for (auto& p : m.parameters()) p.copy_(at::randn(p.sizes(), gen));
  for (auto& b : m.named_buffers()) {
    if (at::isFloatingType(b.value().scalar_type()))
      b.value().copy_(at::rand(b.value().sizes(), gen) + 0.5);
  }
}

std::string save_module(const ScratchDir& tmp, torch::nn::Module& m, int64_t step) {
  SaveState s;
  add_module(s, m);
  Checkpointer ck((tmp / "checkpoints").string(), CheckpointerOptions{}, CommitGroup{});
  ck.save(step, s);
  return ck.last_save()->path;
}

}  // namespace

TEST(CheckpointAsyncTest, TrainingContinuesWhileSavingAndTheSnapshotIsSaved) {
  ScratchDir tmp("async");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(ckpt_test::fresh_seed());
  std::vector<at::Tensor> params;
  SaveState s;
  for (int i = 0; i < 8; ++i) {
    params.push_back(random_tensor(at::kFloat, {1 << 20}, gen));  // 8 x 4 MiB
    s.add_replicated("model/p" + std::to_string(i), params.back());
  }
  std::vector<at::Tensor> at_save;
  for (const auto& p : params) at_save.push_back(p.clone());
  CheckpointerOptions o;
  o.async = true;
  o.block_bytes = 1 << 20;
  Checkpointer ck((tmp / "checkpoints").string(), o, CommitGroup{});
  ck.save(100, s);
  // "Training": keep updating the parameters in place while the writer runs.
  int steps_while_busy = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (ck.busy() && std::chrono::steady_clock::now() < deadline) {
    for (auto& p : params) p.add_(1.0f);
    ck.poll();
    ++steps_while_busy;
  }
  ck.wait();
  EXPECT_GT(steps_while_busy, 0) << "save() blocked until the write was done";
  ASSERT_TRUE(ck.last_save().has_value());
  EXPECT_EQ(ck.last_save()->step, 100);
  // total_s is the write's time plus blocking_s (checkpointer.cpp): adding a non-negative
  // duration never rounds below the other term, so the comparison is exact.
  EXPECT_LE(ck.last_save()->blocking_s, ck.last_save()->total_s);
  CheckpointReader r((tmp / "checkpoints").string());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(r.read("model/p" + std::to_string(i)), at_save[i])) << "param " << i;
  }
  // A second async save reuses the snapshot buffers and commits the new values.
  std::vector<at::Tensor> second;
  for (const auto& p : params) second.push_back(p.clone());
  ck.save(200, s);
  ck.wait();
  CheckpointReader r2((tmp / "checkpoints").string());
  EXPECT_EQ(r2.metadata().step, 200);
  EXPECT_TRUE(bitwise_equal(r2.read("model/p3"), second[3]));
}

TEST(CheckpointAsyncTest, InjectedWriteErrorSurfacesOnNextPoll) {
  ScratchDir tmp("asyncerr");
  const fs::path dir = tmp / "checkpoints";
  CheckpointerOptions o;
  o.async = true;
  Checkpointer ck(dir.string(), o, CommitGroup{});
  SaveState s;
  s.add_replicated("model/w", at::randn({256}));
  ck.save(1, s);
  ck.wait();
  // Make the checkpoints directory unwritable for anyone, root included: replace it by a file.
  fs::rename(dir, tmp / "moved");
  std::ofstream(dir) << "not a directory";
  ck.save(2, s);  // returns after the snapshot; the background write fails
  bool thrown = false;
  std::string message;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!thrown && std::chrono::steady_clock::now() < deadline) {
    try {
      ck.poll();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    } catch (const IoError& e) {
      thrown = true;
      message = e.what();
    }
  }
  ASSERT_TRUE(thrown) << "the background error never surfaced";
  EXPECT_NE(message.find(dir.string()), std::string::npos) << message;
  EXPECT_NO_THROW(ck.poll());  // reported once
  EXPECT_FALSE(ck.busy());
  // The next save works again once the directory is back.
  fs::remove(dir);
  fs::rename(tmp / "moved", dir);
  ck.save(3, s);
  ck.wait();
  EXPECT_EQ(CheckpointReader(dir.string()).metadata().step, 3);
}

TEST(CheckpointWeightsTest, StrictListsEveryProblemNonStrictLoadsTheRest) {
  ScratchDir tmp("weights");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(ckpt_test::fresh_seed());
  Net saved(16);
  randomize(saved, gen);
  const std::string ckpt = save_module(tmp, saved, 5);

  Net same(16);
  const WeightsReport ok = load_weights(same, tmp.str() + "/checkpoints");
  EXPECT_TRUE(ok.clean()) << ok.summary();
  for (const auto& p : saved.named_parameters()) {
    EXPECT_TRUE(bitwise_equal(same.named_parameters()[p.key()], p.value())) << p.key();
  }
  EXPECT_TRUE(bitwise_equal(same.bn->running_var, saved.bn->running_var));

  Net other(16, /*extra=*/true);  // has head.* (missing in the checkpoint)
  other.fc1 = other.replace_module("fc1", torch::nn::Linear(8, 16));
  Net wider(32);
  randomize(other, gen);
  const at::Tensor head_before = other.head->weight.clone();
  try {
    load_weights(other, ckpt);
    FAIL() << "strict loading accepted missing tensors";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("missing: head.bias, head.weight"), std::string::npos)
        << e.what();
  }
  try {
    load_weights(wider, ckpt);
    FAIL() << "strict loading accepted mismatched shapes";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("fc1.weight [16, 8] saved vs [32, 8]"), std::string::npos)
        << e.what();
  }
  WeightsOptions lax;
  lax.strict = false;
  const WeightsReport rep = load_weights(other, ckpt, lax);
  EXPECT_EQ(rep.missing, (std::vector<std::string>{"head.bias", "head.weight"}));
  EXPECT_TRUE(rep.unexpected.empty());
  EXPECT_TRUE(bitwise_equal(other.fc2->weight, saved.fc2->weight));
  EXPECT_TRUE(bitwise_equal(other.head->weight, head_before));
  const WeightsReport rep2 = load_weights(wider, ckpt, lax);
  EXPECT_EQ(rep2.mismatched.size(), 7u) << rep2.summary();  // fc1.w/b, bn.w/b/mean/var, fc2.weight
}

TEST(CheckpointWeightsTest, ExportFp32AndBf16LoadBack) {
  ScratchDir tmp("export");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(ckpt_test::fresh_seed());
  Net saved(16);
  randomize(saved, gen);
  const std::string ckpt = save_module(tmp, saved, 9);
  const std::string f32 = (tmp / "export" / "weights.h5").string();
  EXPECT_EQ(export_weights(ckpt, f32, at::kFloat),
            static_cast<int64_t>(saved.named_parameters().size() + saved.named_buffers().size()));
  EXPECT_TRUE(is_weights_file(f32));
  EXPECT_FALSE(is_weights_file(ckpt + "/rank_00000.h5"));
  Net a(16);
  EXPECT_TRUE(load_weights(a, f32).clean());
  for (const auto& p : saved.named_parameters())
    EXPECT_TRUE(bitwise_equal(a.named_parameters()[p.key()], p.value()));
  EXPECT_TRUE(bitwise_equal(a.bn->num_batches_tracked, saved.bn->num_batches_tracked));
  const std::string b16 = (tmp / "export" / "weights_bf16.h5").string();
  export_weights(ckpt, b16, at::kBFloat16);
  Net b(16);
  EXPECT_TRUE(load_weights(b, b16).clean());
  for (const auto& p : saved.named_parameters()) {
    EXPECT_TRUE(
        bitwise_equal(b.named_parameters()[p.key()], p.value().to(at::kBFloat16).to(at::kFloat)))
        << p.key();
  }
}

// weights.h5 records each tensor's crc32 (attribute "crc32", the algorithm of the checkpoint
// shards) and every load verifies it: a tensor read whole on the bytes read, one read as boxes
// (tensor parallelism) by streaming the dataset. A flipped byte is a ChecksumError naming the file
// and the tensor. Non-strict loading that matches nothing is refused, naming keys of both sides.
TEST(CheckpointWeightsTest, WeightsFileChecksumsAreVerifiedOnEveryLoad) {
  ScratchDir tmp("crc");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(ckpt_test::fresh_seed());
  Net saved(16);
  randomize(saved, gen);
  const std::string f = (tmp / "weights.h5").string();
  export_weights(save_module(tmp, saved, 3), f, at::kFloat);
  // fc1.weight [16, 8] read as two boxes of rows, as a tensor-parallel rank reads its slice.
  WeightsOptions boxes;
  boxes.boxes_of = [](const std::string& name,
                      const at::Tensor& local) -> std::optional<TensorBoxes> {
    if (name != "fc1.weight") return std::nullopt;
    TensorBoxes b;
    b.shape = local.sizes().vec();
    b.boxes.emplace_back(local.narrow(0, 0, 8), std::vector<int64_t>{0, 0});
    b.boxes.emplace_back(local.narrow(0, 8, 8), std::vector<int64_t>{8, 0});
    return b;
  };
  Net clean(16);
  EXPECT_TRUE(load_weights(clean, f, boxes).clean());
  EXPECT_TRUE(bitwise_equal(clean.fc1->weight, saved.fc1->weight));

  // One byte in the middle of fc1.weight's data, found by its bytes (a contiguous dataset).
  std::string bytes;
  {
    std::ifstream in(f, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  const at::Tensor w = saved.fc1->weight.detach().contiguous();
  const std::string image(static_cast<const char*>(w.const_data_ptr()), w.nbytes());
  const std::size_t at = bytes.find(image);
  ASSERT_NE(at, std::string::npos);
  bytes[at + image.size() / 2] ^= 0x5A;
  std::ofstream(f, std::ios::binary | std::ios::trunc) << bytes;
  for (const WeightsOptions& o : {WeightsOptions{}, boxes}) {
    Net a(16);
    try {
      load_weights(a, f, o);
      ADD_FAILURE() << "a corrupt weights file loaded";
    } catch (const ChecksumError& e) {
      EXPECT_NE(std::string(e.what()).find("weights file '" + f +
                                           "': checksum mismatch for tensor 'fc1.weight'"),
                std::string::npos)
          << e.what();
    }
  }

  struct Other : torch::nn::Module {
    Other() { register_module("enc", torch::nn::Linear(3, 3)); }
  } other;
  WeightsOptions lax;
  lax.strict = false;
  try {
    load_weights(other, (tmp / "checkpoints").string(), lax);
    ADD_FAILURE() << "non-strict loading of nothing was accepted";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("nothing matched the module (non-strict loading would "
                                         "load 0 of its 2 tensors): it holds bn.bias, "
                                         "bn.num_batches_tracked, bn.running_mean, "
                                         "bn.running_var, ... (9 in all); the module has enc.bias, "
                                         "enc.weight (2 in all)"),
              std::string::npos)
        << e.what();
  }
}

TEST(CheckpointResumeTest, ModelAdamWAndRngResumeBitExactly) {
  ScratchDir tmp("resume");
  const uint64_t seed = ckpt_test::fresh_seed();
  auto make = [&](std::shared_ptr<Net>& net, std::unique_ptr<optim::Optimizer>& opt) {
    at::manual_seed(seed);
    net = std::make_shared<Net>(16);
    optim::OptimConfig cfg;
    cfg.name = "adamw";
    std::vector<optim::ParamGroup> groups(1);
    for (const auto& p : net->named_parameters()) {
      groups[0].params.push_back(p.value());
      groups[0].names.push_back(p.key());
    }
    groups[0].weight_decay = 0.01;
    opt = optim::build_optimizer(cfg, std::move(groups));
  };
  // One training step with dropout-like randomness drawn from the default generator.
  auto step = [](Net& net, optim::Optimizer& opt) {
    const at::Tensor x = at::randn({32, 8});
    const at::Tensor mask = at::rand({32, 4}) > 0.2;
    opt.zero_grad(true);
    (net.forward(x) * mask).pow(2).mean().backward();
    opt.step(1e-2);
  };
  std::shared_ptr<Net> net;
  std::unique_ptr<optim::Optimizer> opt;
  make(net, opt);
  for (int i = 0; i < 3; ++i) step(*net, *opt);
  {
    SaveState s;
    add_module(s, *net);
    add_optimizer(s, *opt);
    add_rng(s);
    Checkpointer ck((tmp / "checkpoints").string(), CheckpointerOptions{}, CommitGroup{});
    ck.save(3, s);
  }
  for (int i = 0; i < 4; ++i) step(*net, *opt);
  // Fresh model and optimizer (different initial values), restored from the checkpoint.
  std::shared_ptr<Net> net2;
  std::unique_ptr<optim::Optimizer> opt2;
  make(net2, opt2);
  randomize(*net2, at::make_generator<at::CPUGeneratorImpl>(ckpt_test::fresh_seed()));
  (void)at::rand({77});  // disturb the default generator
  CheckpointReader r((tmp / "checkpoints").string());
  EXPECT_TRUE(load_weights(r, *net2).clean());
  load_optimizer(r, *opt2);
  EXPECT_TRUE(load_rng(r, 0));
  EXPECT_FALSE(load_rng(r, 1));
  EXPECT_EQ(opt2->steps(), 3);
  for (int i = 0; i < 4; ++i) step(*net2, *opt2);
  for (const auto& p : net->named_parameters()) {
    EXPECT_TRUE(bitwise_equal(net2->named_parameters()[p.key()], p.value())) << p.key();
  }
}
