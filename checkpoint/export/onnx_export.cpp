// The ONNX export (onnx_export.h) end to end: options checked, a staging folder opened
// (staging.h), the graph emitted and checked, the parity gate run on it (parity.h), and the files
// published, the model last.
#include "checkpoint/export/onnx_export.h"

#include "checkpoint/export/onnx_graph.h"
#include "checkpoint/export/parity.h"
#include "checkpoint/export/staging.h"
#include "checkpoint/files.h"
#include "core/error.h"
#include "core/log.h"
#include "core/strings.h"
#include "core/timer.h"

#include <onnx/common/version.h>

#include <ATen/ATen.h>

#include <filesystem>
#include <functional>
#include <utility>

namespace fs = std::filesystem;

namespace parallax::checkpoint::exporter {

namespace {

// Bytes the model's tensors take as initializers in `dtype` (floating tensors cast).
int64_t weight_bytes(torch::nn::Module& model, at::ScalarType dtype) {
  int64_t n = 0;
  auto count = [&](const at::Tensor& t) {
    if (!t.defined()) return;
    n += t.numel() * static_cast<int64_t>(at::isFloatingType(t.scalar_type())
                                              ? c10::elementSize(dtype)
                                              : t.element_size());
  };
  for (const auto& p : model.parameters()) count(p);
  for (const auto& b : model.buffers()) count(b);
  return n;
}

}  // namespace

bool use_external_data(const std::string& mode, int64_t weight_bytes) {
  return mode == "always" || weight_bytes > kInlineWeightLimit;
}

void validate(const OnnxExportOptions& o) {
  PARALLAX_CHECK(
      o.opset >= kOnnxOpset, UsageError,
      "ONNX export: opset {} is below 17, the lowest this exporter writes (the graph uses "
      "LayerNormalization, new in opset 17, and GridSample, new in opset 16)",
      o.opset);
  PARALLAX_CHECK(o.opset == kOnnxOpset, UsageError,
                 "ONNX export: opset {}: the emitters write opset-17 operator signatures (e.g. "
                 "ReduceMean's axes "
                 "attribute) and this build's libonnx {} validates opsets up to 17",
                 o.opset, ::onnx::LAST_RELEASE_VERSION);
  PARALLAX_CHECK(o.dtype == at::kFloat || o.dtype == at::kHalf, UsageError,
                 "ONNX export: dtype must be fp32 or fp16, got {}", c10::toString(o.dtype));
  PARALLAX_CHECK(o.batch >= 0, UsageError,
                 "ONNX export: batch must be a positive size or dynamic, got {}", o.batch);
  PARALLAX_CHECK(o.external_data == "auto" || o.external_data == "always", UsageError,
                 "ONNX export: external_data must be auto or always, got '{}'", o.external_data);
  PARALLAX_CHECK(o.parity_batch >= 1 && o.parity_timeout_s > 0, UsageError,
                 "ONNX export: parity batch {} and timeout {} s must be positive", o.parity_batch,
                 o.parity_timeout_s);
}

OnnxExportResult export_onnx(models::Model& model, const std::vector<core::TensorDict>& frames,
                             const std::string& model_file, const OnnxExportOptions& o) {
  ParityFrames source;
  source.count = static_cast<int64_t>(frames.size());
  source.frame = [&frames](int64_t i) { return frames.at(static_cast<size_t>(i)); };
  return export_onnx(model, source, model_file, o);
}

namespace {

// The graph of `model` written to `staged_model` (weights beside it when `external`), checked by
// libonnx; fills the result's initializers and graph_s. Returns the graph's (inputs, outputs).
std::pair<std::vector<std::string>, std::vector<std::string>> write_graph(
    models::Model& model, const OnnxExportOptions& o, const fs::path& staged_model, bool external,
    OnnxExportResult& result) {
  core::Stopwatch clock;
  const std::string data_name = staged_model.filename().string() + ".data";
  OnnxGraphOptions go;
  go.opset = o.opset;
  go.batch = o.batch;
  if (external) {
    go.data_file = (staged_model.parent_path() / data_name).string();
    go.data_location = data_name;
  }
  OnnxGraph graph(go);
  models::onnx::EmitOptions eo;
  eo.dtype = o.dtype;
  eo.batch = o.batch;
  eo.allow_non_finite = o.allow_non_finite;
  eo.hooks = o.hooks;
  models::onnx::Emitter emitter(graph, model, eo);
  model.emit_onnx(emitter);
  const std::vector<std::string> missed = emitter.unaccounted();
  PARALLAX_CHECK(missed.empty(), Error,
                 "ONNX export: model tensors {} were neither exported nor declared unused by the "
                 "emitters (a layer "
                 "without an emitter, or an emitter that skips weights)",
                 core::join(missed, ", "));
  std::vector<std::string> skipped;
  for (const auto& [n, why] : emitter.not_exported_names()) skipped.push_back(n + ": " + why);
  graph.add_metadata("parallax.dtype", export_dtype_label(o.dtype));
  graph.add_metadata("parallax.batch", o.batch > 0 ? std::to_string(o.batch) : "dynamic");
  graph.add_metadata("parallax.not_exported", core::join(skipped, "; "));
  for (const auto& [k, v] : o.metadata) graph.add_metadata(k, v);
  graph.infer_and_check_shapes();
  graph.write(staged_model.string());
  result.initializers = static_cast<int64_t>(emitter.weight_names().size());
  result.graph_s = clock.elapsed_s();
  core::log::info(
      "ONNX export: {} nodes, {} initializers ({:.1f} MB{}), checked by libonnx {} in {:.2f} s",
      graph.model().graph().node_size(), result.initializers, graph.initializer_bytes() / 1e6,
      external ? ", external data" : "", ::onnx::LAST_RELEASE_VERSION, result.graph_s);
  return {graph.input_names(), graph.output_names()};
}

// Publishes the staged export in `dir`: everything but the model, then the model (the rename that
// makes the export visible); removes what older exports left that no longer describes it.
void publish(const StagingDir& staging, const fs::path& target, bool external, bool parity,
             OnnxExportResult& result) {
  const fs::path dir = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  const std::string name = target.filename().string();
  const fs::path data_target = dir / (name + ".data");
  std::error_code ec;
  if (external) rename_or_throw(staging.path / (name + ".data"), data_target);
  for (const char* f : {"parity.h5", "parity.json"}) {
    if (fs::exists(staging.path / f)) {
      rename_or_throw(staging.path / f, dir / f);
    } else {
      fs::remove(dir / f, ec);  // an older export's report describes another model
    }
  }
  rename_or_throw(staging.path / name, target);
  if (!external) fs::remove(data_target, ec);      // an older export's weights
  fs::remove_all(dir / (name + ".rejected"), ec);  // an older export's rejected candidate
  files::fsync_path(dir.string(), true);
  result.model_file = target.string();
  result.model_bytes = files::file_size(result.model_file);
  if (external) {
    result.data_file = data_target.string();
    result.data_bytes = files::file_size(result.data_file);
  }
  if (parity) result.parity_json = (dir / "parity.json").string();
}

}  // namespace

OnnxExportResult export_onnx(models::Model& model, const ParityFrames& frames,
                             const std::string& model_file, const OnnxExportOptions& o) {
  validate(o);
  prepare_output_dir(model_file);
  PARALLAX_CHECK(frames.count >= 0 && (frames.count == 0 || frames.frame), Error,
                 "ONNX export: {} parity frames without a source", frames.count);
  const std::function<void()> interruption_point = [&o] {
    if (o.interruption) o.interruption();
  };
  if (frames.count > 0) check_parity_runtime(o);
  PARALLAX_CHECK(o.batch == 0 || frames.count % o.batch == 0, UsageError,
                 "ONNX export: {} parity frames do not fill batches of the fixed batch size {}",
                 frames.count, o.batch);

  const fs::path target(model_file);
  const fs::path dir = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  const std::string name = target.filename().string();
  remove_stale_staging(model_file);
  StagingDir staging;
  open_staging(dir, name, staging);
  interruption_point();

  OnnxExportResult result;
  const bool external = use_external_data(o.external_data, weight_bytes(model, o.dtype));
  const auto [inputs, outputs] = write_graph(model, o, staging.path / name, external, result);
  if (frames.count > 0) {
    const std::string config = parity_config(o, name, frames.count, inputs, outputs);
    // LibTorch's outputs, frame by frame (batch 1 each), streamed into parity.h5 with the inputs.
    result.reference_s =
        write_parity_reference(model, frames, o, inputs, outputs, config,
                               staging.path / "parity.h5", dir, interruption_point);
    run_parity_tool(o, staging, dir, name, frames.count, result, interruption_point);
  }
  publish(staging, target, external, frames.count > 0, result);
  return result;
}

}  // namespace parallax::checkpoint::exporter
