// The planner's activation model against what a CPU forward really keeps (issue 23: within 15%),
// and its layout enumeration and rejection reasons. The exact parameter, gradient and optimizer
// bytes are checked against real runs under mpirun in test_planner.py.
//
// Measurement: a counting CPU allocator (c10::SetCPUAllocator) wraps the default one; the bytes
// alive after forward + loss, minus those alive before, are what autograd (and the predictions)
// keep for the backward of one micro-batch.
#include "train/planner.h"
#include "core/build_info.h"
#include "models/model.h"
#include "optim/precision.h"
#include "train/run_config.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <unordered_map>

using namespace parallax;

namespace {

// Data and context are the same pointer (raw_allocate needs it); sizes live in a map.
class CountingAllocator : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    void* p = c10::alloc_cpu(n);
    {
      std::lock_guard<std::mutex> lock(mu());
      sizes()[p] = n;
    }
    live() += static_cast<int64_t>(n);
    return {p, p, &CountingAllocator::release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  static std::atomic<int64_t>& live() {
    static std::atomic<int64_t> v{0};
    return v;
  }

 private:
  static std::mutex& mu() {
    static std::mutex m;
    return m;
  }
  static std::unordered_map<void*, size_t>& sizes() {
    static std::unordered_map<void*, size_t> s;
    return s;
  }
  static void release(void* p) {
    if (p == nullptr) return;
    size_t n = 0;
    {
      std::lock_guard<std::mutex> lock(mu());
      auto it = sizes().find(p);
      if (it != sizes().end()) {
        n = it->second;
        sizes().erase(it);
      }
    }
    live() -= static_cast<int64_t>(n);
    c10::free_cpu(p);
  }
};

train::RunConfig config(const std::vector<std::string>& overrides) {
  std::vector<std::string> o{"train.benchmark=true"};
  o.insert(o.end(), overrides.begin(), overrides.end());
  return train::load_run_config(core::source_dir() + "/configs/bev_tiny.yaml", o);
}

// Bytes one forward + loss of `batch` samples keeps, measured.
double measured_activations(const train::RunConfig& cfg, int64_t batch) {
  at::manual_seed(0);
  auto model = models::build_model(cfg.model, train::run_scene(cfg));
  model->train();
  core::TensorDict b = model->example_batch(batch);
  const optim::PrecisionPolicy policy = optim::make_precision_policy(cfg.precision, c10::kCPU);
  c10::Allocator* original = c10::GetCPUAllocator();
  static CountingAllocator* counting = new CountingAllocator();  // lives for the process
  c10::SetCPUAllocator(counting, /*priority=*/100);
  double bytes = 0;
  {
    const int64_t before = CountingAllocator::live().load();
    models::LossOutput loss;
    core::TensorDict pred;
    {
      optim::AutocastGuard guard(policy);
      pred = model->forward(b);
      loss = model->loss(b, pred);
    }
    bytes = static_cast<double>(CountingAllocator::live().load() - before);
    loss.total.backward();
  }
  c10::SetCPUAllocator(original, /*priority=*/100);
  return bytes;
}

void expect_within(const std::vector<std::string>& overrides, int64_t batch, double tol = 0.15) {
  const train::RunConfig cfg = config(overrides);
  const double measured = measured_activations(cfg, batch);
  const double predicted = train::planner::activation_bytes(cfg, 1, false, batch, false);
  std::string what;
  for (const auto& o : overrides) what += o + " ";
  std::printf("%s batch %lld: predicted %.3f MB, measured %.3f MB (%.3f)\n", what.c_str(),
              static_cast<long long>(batch), predicted / 1e6, measured / 1e6, predicted / measured);
  // Issue 23's bound: the activation model within 15% of what the forward keeps.
  EXPECT_NEAR(predicted / measured, 1.0, tol)
      << what << "batch " << batch << ": predicted " << predicted / 1e6 << " MB, measured "
      << measured / 1e6 << " MB";
}

}  // namespace

TEST(PlannerActivations, VitClassifierFp32) {
  expect_within({"model.name=vit_cls", "model.size=tiny", "model.num_classes=10"}, 4);
}

TEST(PlannerActivations, BevVitFp32) {
  expect_within({"model.backbone=vit"}, 2);
}

TEST(PlannerActivations, BevConvFp32) {
  expect_within({"model.backbone=conv"}, 2);
}

// ResNet-50 (frozen batch norm, FPN) on bev/tiny's default scene, one sample (6 images of
// 128 x 224): the bottlenecks' norm inputs and ReLU outputs, the stem's max-pool indices.
TEST(PlannerActivations, BevResNet50Fp32) {
  expect_within({"model.backbone=resnet50"}, 1);
}

// Under autocast every convolution keeps its weight's bf16 copy for the backward: 2 bytes per
// parameter (47 MB for ResNet-50) whatever the batch, which the per-sample activation model leaves
// out. Measured at batch 1 and 3: 159 MB a sample (predicted 156) plus 48 MB independent of the
// batch; at batch 3 the copies are ~9% of what the forward keeps (predicted / measured 0.89).
TEST(PlannerActivations, BevResNet50Bf16) {
  expect_within({"model.backbone=resnet50", "precision.mode=bf16"}, 3);
}

TEST(PlannerActivations, VitClassifierBf16) {
  expect_within(
      {"model.name=vit_cls", "model.size=tiny", "model.num_classes=10", "precision.mode=bf16"}, 4);
}

TEST(PlannerActivations, BevVitBf16) {
  expect_within({"model.backbone=vit", "precision.mode=bf16"}, 2);
}

TEST(PlannerActivations, BevConvBf16) {
  expect_within({"model.backbone=conv", "precision.mode=bf16"}, 2);
}

TEST(PlannerActivations, ScalesWithTheMicroBatch) {
  const train::RunConfig cfg = config({"model.backbone=vit"});
  const double one = train::planner::activation_bytes(cfg, 1, false, 1, false);
  EXPECT_DOUBLE_EQ(train::planner::activation_bytes(cfg, 1, false, 3, false), 3 * one);
  // Column-parallel shards: tp 2 keeps less, sequence parallelism less again.
  const double tp2 = train::planner::activation_bytes(cfg, 2, false, 1, false);
  const double sp2 = train::planner::activation_bytes(cfg, 2, true, 1, false);
  EXPECT_LT(tp2, one);
  EXPECT_LT(sp2, tp2);
}

TEST(PlannerLayouts, RejectsWithReasonsAndRanksTheRest) {
  train::RunConfig cfg = config({"model.backbone=vit"});
  train::planner::Request req;
  req.hw.gpus = 8;
  req.hw.gpu_mem_gib = 80;
  const auto rows = train::planner::plan(cfg, req);
  ASSERT_FALSE(rows.empty());
  bool saw_fit = false, saw_rejected_after = false, heads = false;
  double last = 1e300;
  for (const auto& r : rows) {
    if (r.fits) {
      EXPECT_FALSE(saw_rejected_after) << "fitting layouts come first";
      EXPECT_LE(r.time.samples_per_s, last * (1 + 1e-12)) << "ranked by throughput";
      last = r.time.samples_per_s;
      saw_fit = true;
      EXPECT_EQ(r.layout.dp * r.layout.tp * r.layout.pp, 8);
      EXPECT_GT(r.peak.activations, 0);
    } else {
      saw_rejected_after = true;
      EXPECT_FALSE(r.reason.empty());
      // bev tiny's ViT has 4 heads: tp 8 does not divide them.
      if (r.layout.tp == 8 && r.reason.find("heads") != std::string::npos) heads = true;
    }
  }
  EXPECT_TRUE(saw_fit);
  EXPECT_TRUE(heads);
  // Too little memory: nothing fits, and the reason says how much each needs.
  req.hw.gpu_mem_gib = 1e-4;
  for (const auto& r : train::planner::plan(cfg, req)) {
    EXPECT_FALSE(r.fits);
    if (!r.ranks.empty()) {
      EXPECT_NE(r.reason.find("GiB"), std::string::npos) << r.reason;
    }
  }
}

TEST(PlannerLayouts, PipelineKeepsTheScheduleInFlightMicroBatches) {
  // 1F1B keeps at most pp micro-batches on the first stage; GPipe keeps all of them.
  train::RunConfig cfg = config({"model.backbone=vit"});
  train::planner::Hardware hw;
  hw.gpus = 2;
  hw.cuda = false;
  train::planner::Candidate l;
  l.pp = 2;
  l.micro_batch = 1;
  l.micro_batches = 8;
  l.schedule = "1f1b";
  const auto f1b = train::planner::predict(cfg, l, hw);
  l.schedule = "gpipe";
  const auto gp = train::planner::predict(cfg, l, hw);
  ASSERT_TRUE(f1b.reason.empty()) << f1b.reason;
  ASSERT_TRUE(gp.reason.empty()) << gp.reason;
  EXPECT_NEAR(gp.ranks[0].activations / f1b.ranks[0].activations, 8.0 / 2.0, 1e-9);
}

TEST(PlannerMemory, Fp8SavesTheBlocksLinearInputsAndWeightsAsFp8) {
  // precision.mode=fp8 (kernels/fp8.h): each of a ViT block's four linear layers saves its input as
  // an FP8 copy (1 byte per element instead of bf16's 2) and casts its fp32 weight to FP8 itself
  // (no autocast bf16 copy; one FP8 copy per micro-batch). Against bf16, on the same layout:
  // activations shrink by exactly micro-batch x tokens x blocks x (3 dim + hidden) bytes (the
  // inputs of qkv, proj and fc1 are dim wide, fc2's hidden wide) and the weight copies by one byte
  // per FP8 weight element; nothing else changes.
  const std::vector<std::string> vit{"model.name=vit_cls", "model.size=tiny",
                                     "model.num_classes=16"};
  std::vector<std::string> bf = vit, f8 = vit;
  bf.push_back("precision.mode=bf16");
  f8.push_back("precision.mode=fp8");
  const train::RunConfig cbf = config(bf), cf8 = config(f8);
  // The shapes, from the model itself.
  auto model = models::build_model(cbf.model, train::run_scene(cbf));
  double tokens = 0, dim = 0, hidden = 0, blocks = 0, fp8_weights = 0;
  for (const auto& item : model->named_parameters()) {
    const std::string& n = item.key();
    const auto ends = [&](const std::string& s) {
      return n.size() > s.size() && n.compare(n.size() - s.size(), s.size(), s) == 0;
    };
    const at::Tensor& t = item.value();
    if (ends("pos_embed"))
      tokens = static_cast<double>(t.size(1)), dim = static_cast<double>(t.size(2));
    if (ends("mlp.fc1.weight")) hidden = static_cast<double>(t.size(0)), ++blocks;
    if (ends("attn.qkv.weight") || ends("attn.proj.weight") || ends("mlp.fc1.weight") ||
        ends("mlp.fc2.weight"))
      fp8_weights += static_cast<double>(t.numel());
  }
  ASSERT_GT(tokens * dim * hidden * blocks, 0);
  train::planner::Hardware hw;
  hw.gpus = 1;
  train::planner::Candidate l;
  l.micro_batch = 4;
  l.micro_batches = 2;
  const auto a = train::planner::predict(cbf, l, hw);
  const auto b = train::planner::predict(cf8, l, hw);
  ASSERT_TRUE(a.reason.empty()) << a.reason;
  ASSERT_TRUE(b.reason.empty()) << b.reason;
  EXPECT_DOUBLE_EQ(a.ranks[0].activations - b.ranks[0].activations,
                   4 * tokens * blocks * (3 * dim + hidden));
  EXPECT_DOUBLE_EQ(a.ranks[0].autocast_copies - b.ranks[0].autocast_copies, fp8_weights);
  EXPECT_DOUBLE_EQ(a.ranks[0].params, b.ranks[0].params);
  EXPECT_DOUBLE_EQ(a.ranks[0].optimizer, b.ranks[0].optimizer);
  // The trainer's refusals: a model without ViT blocks, and CPU ranks (no FP8 tensor cores).
  std::vector<std::string> conv{"model.backbone=conv", "precision.mode=fp8"};
  const auto c = train::planner::predict(config(conv), l, hw);
  EXPECT_NE(c.reason.find("precision.mode"), std::string::npos) << c.reason;
  hw.cuda = false;
  EXPECT_THROW((void)train::planner::predict(cf8, l, hw), ConfigError);
}
