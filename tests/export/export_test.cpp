// ONNX export (checkpoint/export, models/onnx): initializer names against the module paths for
// every model family, external data, and the failures: a layer or model without an emitter (named),
// a linear layer of an unknown type from a LinearFactory, non-finite weights, opsets other than 17,
// an unwritable output folder, an output whose inferred shape disagrees with its declaration, and
// a parity gate that fails on one frame (the real ONNX Runtime tool, naming output and frame).
// None of them leaves a model file, a partial file or a staging folder behind.
#include "checkpoint/export/onnx_export.h"
#include "core/error.h"
#include "core/subprocess.h"
#include "models/mlp.h"
#include "models/model.h"
#include "models/onnx/ops.h"
#include "models/perception_model.h"

#include <onnx/onnx_pb.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <sstream>

namespace fs = std::filesystem;

namespace parallax::checkpoint::exporter {
namespace {

const std::vector<core::TensorDict> kNoFrames;  // export without the parity gate

struct ScratchDir {
  fs::path path;
  ScratchDir() {
    std::random_device rd;
    path = fs::temp_directory_path() / ("parallax_onnx_test_" + std::to_string(rd()));
    fs::create_directories(path);
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

::onnx::ModelProto load(const fs::path& file) {
  ::onnx::ModelProto m;
  std::ifstream in(file, std::ios::binary);
  EXPECT_TRUE(m.ParseFromIstream(&in)) << file;
  return m;
}

// Every entry of `dir`: nothing partial (a staging folder, a half-written file) may remain.
std::set<std::string> entries(const fs::path& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

template <class E, class F>
std::string expect_error(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "unexpected exception type: " << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no exception";
  return "";
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

models::ModelConfig config(const std::string& name, const std::string& size,
                           const std::string& backbone = "vit") {
  models::ModelConfig c;
  c.name = name;
  c.size = size;
  c.backbone = backbone;
  c.num_classes = 10;
  return c;
}

OnnxExportOptions no_gate() {
  return {};
}

TEST(OnnxExportTest, InitializersAreTheModuleTensorsByPathForEveryFamily) {
  at::manual_seed(20);
  for (const auto& cfg : {config("mlp", "tiny"), config("vit_cls", "tiny"),
                          config("bev", "tiny", "conv"), config("bev", "tiny", "vit")}) {
    SCOPED_TRACE(cfg.name + "/" + cfg.backbone);
    ScratchDir tmp;
    auto model = models::build_model(cfg, core::SceneSpec{});
    const auto r = export_onnx(*model, kNoFrames, (tmp.path / "model.onnx").string(), no_gate());
    const ::onnx::ModelProto m = load(r.model_file);
    std::set<std::string> init, want;
    for (const auto& t : m.graph().initializer()) {
      EXPECT_TRUE(init.insert(t.name()).second) << "duplicate initializer " << t.name();
      EXPECT_NE(t.data_location(), ::onnx::TensorProto::EXTERNAL) << t.name();
    }
    for (const auto& p : model->named_parameters(true)) want.insert(p.key());
    for (const auto& b : model->named_buffers(true)) want.insert(b.key());
    if (cfg.name == "mlp") want.erase("teacher");  // loss-only, declared not exported
    EXPECT_EQ(init, want);
    EXPECT_EQ(r.initializers, static_cast<int64_t>(want.size()));
    EXPECT_EQ(m.opset_import(0).version(), 17);
    // Every output has its full shape, the batch axis symbolic.
    for (const auto& o : m.graph().output()) {
      const auto& shape = o.type().tensor_type().shape();
      ASSERT_GE(shape.dim_size(), 2) << o.name();
      EXPECT_EQ(shape.dim(0).dim_param(), "batch") << o.name();
      for (int d = 1; d < shape.dim_size(); ++d) EXPECT_GT(shape.dim(d).dim_value(), 0) << o.name();
    }
    EXPECT_EQ(entries(tmp.path), std::set<std::string>{"model.onnx"});
  }
}

TEST(OnnxExportTest, ForcedExternalDataHoldsTheLargeInitializers) {
  // The >2 GB (3b) mechanism on a small model: every initializer of 1 KiB or more in
  // model.onnx.data at a 4 KiB-aligned offset, the rest inline; ONNX's checker resolved the file
  // (write()).
  at::manual_seed(21);
  ScratchDir tmp;
  auto model = models::build_model(config("bev", "tiny", "conv"), core::SceneSpec{});
  OnnxExportOptions o;
  o.external_data = "always";
  const auto r = export_onnx(*model, kNoFrames, (tmp.path / "model.onnx").string(), o);
  ASSERT_EQ(r.data_file, (tmp.path / "model.onnx.data").string());
  const ::onnx::ModelProto m = load(r.model_file);
  int64_t external = 0, external_bytes = 0;
  for (const auto& t : m.graph().initializer()) {
    int64_t numel = 1;
    for (int64_t d : t.dims()) numel *= d;
    if (numel * 4 < 1024) {
      EXPECT_NE(t.data_location(), ::onnx::TensorProto::EXTERNAL) << t.name();
      continue;
    }
    ASSERT_EQ(t.data_location(), ::onnx::TensorProto::EXTERNAL) << t.name();
    EXPECT_FALSE(t.has_raw_data()) << t.name();
    std::map<std::string, std::string> kv;
    for (const auto& e : t.external_data()) kv[e.key()] = e.value();
    EXPECT_EQ(kv["location"], "model.onnx.data");
    EXPECT_EQ(std::stoll(kv["offset"]) % 4096, 0) << t.name();
    EXPECT_EQ(std::stoll(kv["length"]), numel * 4) << t.name();
    // The bytes at that offset are the parameter.
    std::ifstream in(r.data_file, std::ios::binary);
    in.seekg(std::stoll(kv["offset"]));
    std::vector<float> v(static_cast<size_t>(numel));
    in.read(reinterpret_cast<char*>(v.data()), numel * 4);
    const at::Tensor saved = at::from_blob(v.data(), {numel}, at::kFloat);
    at::Tensor param;
    for (const auto& p : model->named_parameters(true)) {
      if (p.key() == t.name()) param = p.value().detach().reshape({-1});
    }
    ASSERT_TRUE(param.defined()) << t.name();
    EXPECT_TRUE(at::equal(saved, param)) << t.name();
    ++external;
    external_bytes += numel * 4;
  }
  EXPECT_GT(external, 10);
  EXPECT_GT(r.data_bytes, external_bytes - 1);
  EXPECT_LT(r.model_bytes, 200 * 1024);  // the graph without the weights
}

TEST(OnnxExportTest, OnlyModelsOver2GBUseExternalDataByDefault) {
  // From the analytic parameter counts (the 3b model is never allocated): 3b's weights pass 2 GB in
  // fp32 and fp16, large's (~0.3e9 parameters) do not.
  auto bytes = [](const std::string& size, int64_t elem) {
    int64_t n = 0;
    for (const auto& c :
         models::analytic_cost(config("bev", size, "vit"), models::benchmark_scene(size)))
      n += c.params;
    return n * elem;
  };
  EXPECT_TRUE(use_external_data("auto", bytes("3b", 4)));
  EXPECT_TRUE(use_external_data("auto", bytes("3b", 2)));
  EXPECT_FALSE(use_external_data("auto", bytes("large", 4)));
  EXPECT_FALSE(use_external_data("auto", bytes("base", 4)));
  EXPECT_TRUE(use_external_data("always", bytes("tiny", 4)));
}

// A model whose forward is a torch::nn::Sequential with a Tanh, which has no emitter.
class TanhModel : public models::Model {
 public:
  TanhModel() {
    net_ =
        register_module("net", torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::Tanh()));
  }
  core::TensorDict forward(const core::TensorDict& b) override {
    return {{"y", net_->forward(b.at("x"))}};
  }
  models::LossOutput loss(const core::TensorDict&, const core::TensorDict& p) override {
    return {p.at("y").sum(), {}};
  }
  double forward_flops_per_sample() const override { return 0; }
  int64_t batch_size(const core::TensorDict& b) const override { return b.at("x").size(0); }
  core::TensorDict example_batch(int64_t n) const override { return {{"x", at::randn({n, 4})}}; }
  void emit_onnx(models::onnx::Emitter& e) override {
    const auto x = e.input("x", at::kFloat, {models::onnx::kBatch, 4});
    e.output("y", models::onnx::module(e, "net", *net_, x), at::kFloat, {models::onnx::kBatch, 4});
  }

 private:
  torch::nn::Sequential net_{nullptr};
};

// The same without any emitter.
class SilentModel : public TanhModel {
 public:
  void emit_onnx(models::onnx::Emitter& e) override { models::Model::emit_onnx(e); }
};

// Declares its inputs but writes none of its units: the exporter's walk over Model::units() names
// the unit that has no emitter.
class InputsOnlyModel : public TanhModel {
 public:
  void emit_onnx(models::onnx::Emitter& e) override { models::Model::emit_onnx(e); }
  OnnxFlow emit_onnx_inputs(models::onnx::Emitter& e) override {
    const auto x = e.input("x", at::kFloat, {models::onnx::kBatch, 4});
    return {{x}, {{"x", x}}};
  }
};

TEST(OnnxExportTest, TheUnitWalkNamesAUnitWithoutAnEmitter) {
  ScratchDir tmp;
  InputsOnlyModel model;
  const std::string m = expect_error<Error>(
      [&] { export_onnx(model, kNoFrames, (tmp.path / "model.onnx").string(), {}); });
  EXPECT_TRUE(contains(m, "unit 0 ('model')") && contains(m, "no ONNX emitter")) << m;
  EXPECT_TRUE(entries(tmp.path).empty());
}

TEST(OnnxExportTest, ALayerWithoutAnEmitterIsNamedAndNothingIsWritten) {
  ScratchDir tmp;
  TanhModel model;
  const std::string m = expect_error<Error>(
      [&] { export_onnx(model, kNoFrames, (tmp.path / "model.onnx").string(), {}); });
  EXPECT_TRUE(contains(m, "layer 'net.1'") && contains(m, "TanhImpl") &&
              contains(m, "no ONNX emitter"))
      << m;
  EXPECT_TRUE(entries(tmp.path).empty());
  SilentModel silent;
  const std::string m2 = expect_error<Error>(
      [&] { export_onnx(silent, kNoFrames, (tmp.path / "model.onnx").string(), {}); });
  EXPECT_TRUE(contains(m2, "has no ONNX emitter")) << m2;
  EXPECT_TRUE(entries(tmp.path).empty());
}

// A linear layer type the exporter does not know (what a tensor-parallel factory would build).
class ShardedLinearImpl : public torch::nn::Module {
 public:
  explicit ShardedLinearImpl(const models::LinearSpec& s) {
    weight = register_parameter("weight", at::randn({s.out_features, s.in_features}) * 0.02);
    bias = register_parameter("bias", at::zeros({s.out_features}));
  }
  at::Tensor forward(const at::Tensor& x) { return at::linear(x, weight, bias); }
  at::Tensor weight, bias;
};
TORCH_MODULE(ShardedLinear);

TEST(OnnxExportTest, AnUnknownLinearFromTheFactoryIsNamedByItsPath) {
  ScratchDir tmp;
  auto model = models::build_model(
      config("bev", "tiny", "vit"), core::SceneSpec{},
      [](const models::LinearSpec& s) { return torch::nn::AnyModule(ShardedLinear(s)); });
  const std::string m = expect_error<Error>(
      [&] { export_onnx(*model, kNoFrames, (tmp.path / "model.onnx").string(), {}); });
  EXPECT_TRUE(contains(m, "layer 'encoder.vit.block0.attn.qkv'") &&
              contains(m, "ShardedLinearImpl"))
      << m;
  EXPECT_TRUE(entries(tmp.path).empty());
}

TEST(OnnxExportTest, NonFiniteWeightsAreNamedAndAnOlderModelStays) {
  ScratchDir tmp;
  models::MlpModel model(8, 16, 4, 2);
  {
    at::NoGradGuard g;
    for (auto& p : model.named_parameters(true)) {
      if (p.key() == "net.2.weight") {
        p.value()[3][5] = std::numeric_limits<float>::quiet_NaN();
        p.value()[0][0] = std::numeric_limits<float>::infinity();
      }
    }
  }
  const fs::path file = tmp.path / "model.onnx";
  {
    std::ofstream old(file);
    old << "an older export";
  }
  const std::string m =
      expect_error<Error>([&] { export_onnx(model, kNoFrames, file.string(), {}); });
  EXPECT_TRUE(contains(m, "weight 'net.2.weight' has 2 non-finite value(s)")) << m;
  EXPECT_EQ(entries(tmp.path), std::set<std::string>{"model.onnx"});
  std::ifstream in(file);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "an older export");
  OnnxExportOptions o;
  o.allow_non_finite = true;  // the explicit escape hatch exports them as they are
  EXPECT_NO_THROW(export_onnx(model, kNoFrames, file.string(), o));
}

TEST(OnnxExportTest, OnlyOpset17IsWritten) {
  OnnxExportOptions o;
  o.opset = 16;
  std::string m = expect_error<UsageError>([&] { validate(o); });
  EXPECT_TRUE(contains(m, "opset 16 is below 17")) << m;
  o.opset = 18;
  m = expect_error<UsageError>([&] { validate(o); });
  EXPECT_TRUE(contains(m, "opset 18")) << m;
  o.opset = 17;
  EXPECT_NO_THROW(validate(o));
}

TEST(OnnxExportTest, AnUnwritableOutputFolderIsAnIoError) {
  ScratchDir tmp;
  {
    std::ofstream f(tmp.path / "file");
    f << "x";
  }
  models::MlpModel model(8, 16, 4, 1);
  const std::string target = (tmp.path / "file" / "export" / "model.onnx").string();
  const std::string m = expect_error<IoError>([&] { export_onnx(model, kNoFrames, target, {}); });
  EXPECT_TRUE(contains(m, "cannot create the output folder") && contains(m, "file/export")) << m;
}

// Declares an output shape the graph does not compute.
class WrongShapeModel : public TanhModel {
 public:
  void emit_onnx(models::onnx::Emitter& e) override {
    const auto x = e.input("x", at::kFloat, {models::onnx::kBatch, 4});
    e.output("y", models::onnx::linear(e, x, "net.0", true), at::kFloat, {models::onnx::kBatch, 5});
  }
};

TEST(OnnxExportTest, AnOutputShapeThatInferenceDoesNotGiveIsAnError) {
  ScratchDir tmp;
  WrongShapeModel model;
  const std::string m = expect_error<Error>(
      [&] { export_onnx(model, kNoFrames, (tmp.path / "model.onnx").string(), {}); });
  EXPECT_TRUE(contains(m, "shape inference gives output 'y' the shape [batch, 4], expected [B, 5]"))
      << m;
  EXPECT_TRUE(entries(tmp.path).empty());
}

// y = 2 x in LibTorch; the graph adds 1 where x > 100: a wrong emitter that only some frames
// expose.
class OffByOneModel : public models::Model {
 public:
  core::TensorDict forward(const core::TensorDict& b) override { return {{"y", b.at("x") * 2}}; }
  models::LossOutput loss(const core::TensorDict&, const core::TensorDict& p) override {
    return {p.at("y").sum(), {}};
  }
  double forward_flops_per_sample() const override { return 0; }
  int64_t batch_size(const core::TensorDict& b) const override { return b.at("x").size(0); }
  core::TensorDict example_batch(int64_t n) const override { return {{"x", at::randn({n, 6})}}; }
  void emit_onnx(models::onnx::Emitter& e) override {
    const auto x = e.input("x", at::kFloat, {models::onnx::kBatch, 6});
    const auto big = e.cast(e.op("Greater", {x, e.scalar(100.0, at::kFloat)}), at::kFloat);
    e.output("y", e.add(e.mul(x, e.scalar(2.0, at::kFloat)), big), at::kFloat,
             {models::onnx::kBatch, 6});
  }
};

TEST(OnnxExportTest, AFailingGateNamesTheOutputAndFrameAndLeavesNoModel) {
  try {
    check_parity_runtime({});
  } catch (const Error& e) {
    GTEST_SKIP() << e.what();  // no ONNX Runtime in this Python (the CLI test covers that error)
  }
  ScratchDir tmp;
  OffByOneModel model;
  std::vector<core::TensorDict> frames;
  for (int i = 0; i < 6; ++i) {
    at::Tensor x = at::randn({1, 6});
    if (i == 3) x[0][2] = 150.0f;  // y = 300 here, so the bound is 1e-3 * 300: the +1 fails
    frames.push_back({{"x", x}});
  }
  const std::string m = expect_error<Error>(
      [&] { export_onnx(model, frames, (tmp.path / "model.onnx").string(), {}); });
  EXPECT_TRUE(contains(m, "parity gate failed") && contains(m, "output 'y' frame 3") &&
              contains(m, "max_abs 1 >"))
      << m;
  // The candidate is kept for inspection, the report and its frames published, no model.onnx.
  EXPECT_EQ(entries(tmp.path),
            (std::set<std::string>{"model.onnx.rejected", "parity.h5", "parity.json"}));
  EXPECT_TRUE(fs::exists(tmp.path / "model.onnx.rejected" / "model.onnx"));
  std::ifstream in(tmp.path / "parity.json");
  std::string json((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(contains(json, "\"verdict\": \"fail\"")) << json;

  // Without the frame that exposes it, the same graph passes; the rejected candidate goes.
  frames.erase(frames.begin() + 3);
  const auto r = export_onnx(model, frames, (tmp.path / "model.onnx").string(), {});
  EXPECT_TRUE(contains(r.parity_summary, "PASS")) << r.parity_summary;
  EXPECT_EQ(entries(tmp.path), (std::set<std::string>{"model.onnx", "parity.h5", "parity.json"}));
}

// Issue 35: a killed export leaves its staging folder; the next export into that folder removes it,
// but not the staging folder of an export that still runs (it holds the folder's flock).
TEST(OnnxExportTest, StaleStagingFoldersAreRemovedAndARunningExportsIsKept) {
  ScratchDir tmp;
  const fs::path dead = tmp.path / ".model.onnx.staging-deadbeef";
  const fs::path live = tmp.path / ".model.onnx.staging-0badf00d";
  const fs::path other = tmp.path / ".other.onnx.staging-12345678";  // another model's
  for (const auto& d : {dead, live, other}) {
    fs::create_directories(d);
    std::ofstream(d / "parity.h5") << "partial";
  }
  const int fd = ::open(live.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  models::MlpModel model(8, 16, 4, 1);
  export_onnx(model, kNoFrames, (tmp.path / "model.onnx").string(), {});
  EXPECT_EQ(entries(tmp.path), (std::set<std::string>{"model.onnx", live.filename().string(),
                                                      other.filename().string()}));
  ::close(fd);  // the "running" export ends without cleaning up: now it is stale too
  EXPECT_EQ(remove_stale_staging((tmp.path / "model.onnx").string()), 1);
  EXPECT_EQ(entries(tmp.path), (std::set<std::string>{"model.onnx", other.filename().string()}));
}

// Issue 35: the interruption callback (preemption) stops the parity frames, streamed one at a time,
// and the parity tool's process; nothing is left behind.
TEST(OnnxExportTest, AnInterruptionStopsTheFramesAndTheToolLeavingNothing) {
  struct Stop {};
  ScratchDir tmp;
  models::MlpModel model(8, 16, 4, 1);
  at::manual_seed(3);
  ParityFrames frames;
  frames.count = 10'000'000;  // never all made: they stream, and the export is stopped
  int64_t made = 0;
  frames.frame = [&](int64_t) {
    ++made;
    return model.example_batch(1);
  };
  ScratchDir aux;
  std::ofstream(aux.path / "tool.py") << "never run\n";
  OnnxExportOptions o;
  o.python = "/bin/true";  // the runtime probe passes; the tool is never reached
  o.tool = (aux.path / "tool.py").string();
  o.interruption = [&] {
    if (made >= 50) throw Stop{};
  };
  bool stopped = false;
  try {
    export_onnx(model, frames, (tmp.path / "model.onnx").string(), o);
  } catch (const Stop&) {
    stopped = true;
  } catch (const std::exception& e) {
    ADD_FAILURE() << e.what();
  }
  EXPECT_TRUE(stopped);
  EXPECT_EQ(made, 50);
  EXPECT_TRUE(entries(tmp.path).empty()) << *entries(tmp.path).begin();

  // The tool's process: stopped with the exception, not left running to its deadline.
  const auto start = std::chrono::steady_clock::now();
  const auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  stopped = false;
  try {
    core::run_process({"sleep", "30.5"}, 60, [&] {
      if (elapsed() > 0.3) throw Stop{};
    });
  } catch (const Stop&) {
    stopped = true;
  }
  EXPECT_TRUE(stopped);
  EXPECT_LT(elapsed(), 5.0);
  int running = 0;  // a `sleep 30.5` child of this process
  for (const auto& e : fs::directory_iterator("/proc")) {
    std::ifstream stat(e.path() / "stat");
    std::string line;
    if (!std::getline(stat, line)) continue;
    std::istringstream fields(line.substr(line.rfind(')') + 2));
    std::string state;
    int ppid = 0;
    fields >> state >> ppid;
    std::ifstream cmd(e.path() / "cmdline");
    std::string argv((std::istreambuf_iterator<char>(cmd)), std::istreambuf_iterator<char>());
    running += ppid == ::getpid() && contains(argv, "30.5") && state != "Z";
  }
  EXPECT_EQ(running, 0);
}

// The ties of a quantized model's parity reference (QuantTies): within the margin of a boundary
// between two levels of [-128, 127], with the level nearbyint takes there.
TEST(OnnxExportTest, RoundingTiesAreTheQuotientsNearABoundaryBetweenTwoLevels) {
  const at::Tensor q =
      at::tensor({0.5f, 0.504f, 0.511f, 1.5f, -127.5f, -128.5f, 126.5f, 127.5f, 3.2f, -0.497f},
                 at::kFloat)
          .reshape({2, 5});
  const auto [index, level] = rounding_ties(q, 0.01);
  ASSERT_EQ(index.scalar_type(), at::kInt);
  ASSERT_EQ(level.scalar_type(), at::kChar);
  EXPECT_TRUE(at::equal(index, at::tensor({0, 1, 3, 4, 6, 9}, at::kInt)));
  EXPECT_TRUE(at::equal(level, at::tensor({0, 1, 2, -128, 126, 0}, at::kChar)));
}

}  // namespace
}  // namespace parallax::checkpoint::exporter
