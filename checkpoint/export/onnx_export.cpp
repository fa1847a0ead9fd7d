#include "checkpoint/export/onnx_export.h"

#include "checkpoint/export/onnx_graph.h"
#include "checkpoint/export/subprocess.h"
#include "checkpoint/files.h"
#include "checkpoint/h5.h"
#include "checkpoint/tensor_io.h"
#include "core/error.h"
#include "core/log.h"
#include "core/strings.h"
#include "core/timer.h"

#include <onnx/common/version.h>

#include <ATen/ATen.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

namespace fs = std::filesystem;

namespace parallax::checkpoint::exporter {

namespace {

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += fmt::format("\\u{:04x}", static_cast<int>(c));
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

std::string json_strings(const std::vector<std::string>& v) {
  std::vector<std::string> q;
  for (const auto& s : v) q.push_back(json_string(s));
  return fmt::format("[{}]", core::join(q, ", "));
}

std::string strip_prefix(const std::string& s, const std::string& prefix) {
  return s.rfind(prefix, 0) == 0 ? s.substr(prefix.size()) : s;
}

const char* dtype_label(at::ScalarType t) {
  return t == at::kHalf ? "fp16" : "fp32";
}

// Removes a staging folder on scope exit unless released.
struct StagingDir {
  fs::path path;
  ~StagingDir() {
    if (path.empty()) return;
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

void rename_or_throw(const fs::path& from, const fs::path& to) {
  if (std::rename(from.c_str(), to.c_str()) != 0) {
    throw_error<IoError>("ONNX export: cannot rename '{}' to '{}': {}", from.string(), to.string(),
                         std::strerror(errno));
  }
}

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

// LibTorch's outputs on every frame (batch 1 each), stacked over frames: name -> [F, ...].
std::map<std::string, at::Tensor> reference_outputs(models::Model& model,
                                                    const std::vector<core::TensorDict>& frames,
                                                    const std::vector<std::string>& inputs,
                                                    const std::vector<std::string>& outputs) {
  const bool was_training = model.is_training();
  model.eval();
  at::NoGradGuard no_grad;
  c10::Device device(c10::kCPU);
  for (const auto& p : model.parameters()) {
    device = p.device();
    break;
  }
  std::map<std::string, std::vector<at::Tensor>> per_output;
  for (size_t f = 0; f < frames.size(); ++f) {
    core::TensorDict batch;
    for (const auto& name : inputs) {
      auto it = frames[f].find(name);
      PARALLAX_CHECK(
          it != frames[f].end() && it->second.defined() && it->second.dim() >= 1 &&
              it->second.size(0) == 1,
          Error, "ONNX export: parity frame {} has no graph input '{}' with a batch of 1", f, name);
      batch.emplace(name, it->second.to(device));
    }
    const core::TensorDict pred = model.forward(batch);
    for (const auto& name : outputs) {
      auto it = pred.find(name);
      PARALLAX_CHECK(
          it != pred.end(), Error,
          "ONNX export: graph output '{}' is not a key of the model's forward() (emitter bug)",
          name);
      per_output[name].push_back(it->second.detach().to(at::kCPU, at::kFloat));
    }
  }
  if (was_training) model.train();
  std::map<std::string, at::Tensor> out;
  for (auto& [name, v] : per_output) out.emplace(name, at::cat(v, 0));
  return out;
}

void write_parity_file(const std::string& path, const std::vector<core::TensorDict>& frames,
                       const std::vector<std::string>& inputs,
                       const std::map<std::string, at::Tensor>& outputs,
                       const std::string& config_json) {
  h5::quiet_errors();
  h5::Id fapl(H5Pcreate(H5P_FILE_ACCESS));
  H5Pset_fclose_degree(fapl, H5F_CLOSE_STRONG);
  h5::Id file(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl));
  if (!file.valid())
    h5::fail<IoError>(fmt::format("ONNX export: cannot create parity file '{}'", path));
  h5::write_string_attr(file, "format", "parallax-onnx-parity");
  h5::write_int64_attr(file, "format_version", 1);
  h5::write_string_attr(file, "config", config_json);
  tensor_io::Staging staging;
  for (const auto& name : inputs) {
    std::vector<at::Tensor> v;
    for (const auto& f : frames) v.push_back(f.at(name).to(at::kCPU));
    tensor_io::write_dataset(file, "inputs/" + name, at::cat(v, 0), 64 << 20, staging,
                             fmt::format("writing input '{}' to parity file '{}'", name, path));
  }
  for (const auto& [name, t] : outputs) {
    tensor_io::write_dataset(file, "outputs/" + name, t, 64 << 20, staging,
                             fmt::format("writing output '{}' to parity file '{}'", name, path));
  }
  if (H5Fclose(file.release()) < 0)
    h5::fail<IoError>(fmt::format("ONNX export: cannot write parity file '{}'", path));
}

}  // namespace

bool use_external_data(const std::string& mode, int64_t weight_bytes) {
  return mode == "always" || weight_bytes > kInlineWeightLimit;
}

ParityGate parity_gate(at::ScalarType dtype) {
  // docs/export.md derives both: float32 differs from LibTorch by summation order only; float16
  // rounds every weight and activation to 11 significant bits.
  if (dtype == at::kHalf) return {0.999, 5e-2};
  return {0.9999, 1e-3};
}

ParityGate qat_parity_gate() {
  // docs/export.md ("QAT models"). LibTorch's fake quantization rounds x * (1 / s), ONNX Runtime
  // x / s, and the convolutions sum in other orders: where that moves a value across a rounding
  // boundary the graphs differ by one step s there, and the next quantized layer spreads the step
  // to its neighbours, where more values cross boundaries. Over the ~20 quantized layers of
  // bev_tiny (PTQ of a 2-step run) the outputs differ by up to 4.6% of their range (box_reg; cosine
  // >= 0.99972). Not a derived bound: an empirical gate with ~2x margin for other CPUs' summation
  // orders (the flips are where they land, not how many). The same graph without its Q/DQ nodes
  // is 2-4x further from the fake-quantized model per output channel (max-abs 0.18 of a range of
  // 1.55 on box_reg) and fails it.
  return {0.9995, 0.1};
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

std::string parity_python(const OnnxExportOptions& o) {
  if (!o.python.empty()) return o.python;
  const char* py = std::getenv("PARALLAX_PYTHON");
  return py && *py ? py : PARALLAX_PYTHON_EXE;
}

std::string parity_tool(const OnnxExportOptions& o) {
  if (!o.tool.empty()) return o.tool;
  const char* src = std::getenv("PARALLAX_SOURCE_DIR");
  return (fs::path(src && *src ? src : PARALLAX_SOURCE_DIR) / "tools" / "onnx_parity.py").string();
}

void check_parity_runtime(const OnnxExportOptions& o) {
  const std::string py = parity_python(o), tool = parity_tool(o);
  std::error_code ec;
  PARALLAX_CHECK(fs::is_regular_file(tool, ec), Error,
                 "ONNX export: the parity tool '{}' does not exist (set PARALLAX_SOURCE_DIR to the "
                 "Parallax sources)",
                 tool);
  static const char* kProbe =
      "import importlib, sys\n"
      "missing = []\n"
      "for m in ('onnxruntime', 'onnx', 'numpy', 'h5py'):\n"
      "    try:\n"
      "        importlib.import_module(m)\n"
      "    except Exception as e:\n"
      "        missing.append(f'{m} ({type(e).__name__}: {e})')\n"
      "print('; '.join(missing))\n"
      "sys.exit(1 if missing else 0)\n";
  ProcessResult r;
  try {
    r = run_process({py, "-c", kProbe}, 120);
  } catch (const Error& e) {
    throw_error<Error>(
        "ONNX export: the parity gate runs ONNX Runtime in Python, but {} (set PARALLAX_PYTHON to "
        "an interpreter with onnxruntime, or skip the gate with --parity-frames 0)",
        e.what());
  }
  PARALLAX_CHECK(r.exit_code == 0, Error,
                 "ONNX export: the parity gate needs ONNX Runtime, but '{}' cannot import {}; "
                 "install them (pip "
                 "install onnxruntime onnx numpy h5py, or scripts/setup.sh), set PARALLAX_PYTHON "
                 "to an interpreter "
                 "that has them, or skip the gate with --parity-frames 0",
                 py, r.timed_out ? std::string("them within 120 s") : last_line(r.output));
}

void prepare_output_dir(const std::string& model_file) {
  const fs::path dir = fs::path(model_file).parent_path().empty()
                           ? fs::path(".")
                           : fs::path(model_file).parent_path();
  std::error_code ec;
  fs::create_directories(dir, ec);
  PARALLAX_CHECK(!ec, IoError, "ONNX export: cannot create the output folder '{}': {}",
                 dir.string(), ec.message());
  const fs::path probe = dir / (".parallax-write-test-" + files::random_hex(4));
  const int fd = ::open(probe.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
  PARALLAX_CHECK(fd >= 0, IoError, "ONNX export: cannot write to the output folder '{}': {}",
                 dir.string(), std::strerror(errno));
  ::close(fd);
  fs::remove(probe, ec);
}

OnnxExportResult export_onnx(models::Model& model, const std::vector<core::TensorDict>& frames,
                             const std::string& model_file, const OnnxExportOptions& o) {
  validate(o);
  prepare_output_dir(model_file);
  if (!frames.empty()) check_parity_runtime(o);
  const int64_t ort_batch = o.batch > 0 ? o.batch : o.parity_batch;
  PARALLAX_CHECK(o.batch == 0 || frames.size() % static_cast<size_t>(o.batch) == 0, UsageError,
                 "ONNX export: {} parity frames do not fill batches of the fixed batch size {}",
                 frames.size(), o.batch);

  const fs::path target(model_file);
  const fs::path dir = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  const std::string name = target.filename().string(), data_name = name + ".data";
  StagingDir staging{dir / ("." + name + ".staging-" + files::random_hex(4))};
  std::error_code ec;
  fs::create_directory(staging.path, ec);
  PARALLAX_CHECK(!ec, IoError, "ONNX export: cannot create '{}': {}", staging.path.string(),
                 ec.message());

  OnnxExportResult result;
  core::Stopwatch clock;
  const bool external = use_external_data(o.external_data, weight_bytes(model, o.dtype));
  OnnxGraphOptions go;
  go.opset = o.opset;
  go.batch = o.batch;
  if (external) {
    go.data_file = (staging.path / data_name).string();
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
  const ParityGate gate = o.gate ? *o.gate : parity_gate(o.dtype);
  graph.add_metadata("parallax.dtype", dtype_label(o.dtype));
  graph.add_metadata("parallax.batch", o.batch > 0 ? std::to_string(o.batch) : "dynamic");
  graph.add_metadata("parallax.not_exported", core::join(skipped, "; "));
  for (const auto& [k, v] : o.metadata) graph.add_metadata(k, v);
  graph.infer_and_check_shapes();
  const fs::path staged_model = staging.path / name;
  graph.write(staged_model.string());
  result.initializers = static_cast<int64_t>(emitter.weight_names().size());
  result.graph_s = clock.elapsed_s();
  core::log::info(
      "ONNX export: {} nodes, {} initializers ({:.1f} MB{}), checked by libonnx {} in {:.2f} s",
      graph.model().graph().node_size(), result.initializers, graph.initializer_bytes() / 1e6,
      external ? ", external data" : "", ::onnx::LAST_RELEASE_VERSION, result.graph_s);

  const fs::path staged_h5 = staging.path / "parity.h5", staged_json = staging.path / "parity.json";
  if (!frames.empty()) {
    clock.reset();
    const std::vector<std::string> inputs = graph.input_names(), outputs = graph.output_names();
    const auto ref = reference_outputs(model, frames, inputs, outputs);
    result.reference_s = clock.elapsed_s();
    const std::string config = fmt::format(
        "{{\"model\": {}, \"opset\": {}, \"dtype\": \"{}\", \"batch\": {}, \"ort_batch\": {}, "
        "\"frames\": {}, "
        "\"frames_source\": {}, \"inputs\": {}, \"outputs\": {}, \"gate\": {{\"min_cosine\": {}, "
        "\"max_abs_rel\": {}, "
        "\"rule\": \"per output and frame: cosine >= min_cosine and max_abs <= max_abs_rel * "
        "max(1, max|torch|)\"}}, "
        "\"reference\": \"LibTorch forward, float32, eval mode, batch 1 per frame\"}}",
        json_string(name), o.opset, dtype_label(o.dtype),
        o.batch > 0 ? std::to_string(o.batch) : "\"dynamic\"", ort_batch, frames.size(),
        json_string(o.frames_source), json_strings(inputs), json_strings(outputs), gate.min_cosine,
        gate.max_abs_rel);
    write_parity_file(staged_h5.string(), frames, inputs, ref, config);
    clock.reset();
    const std::string py = parity_python(o);
    const ProcessResult r =
        run_process({py, parity_tool(o), "--model", staged_model.string(), "--frames",
                     staged_h5.string(), "--out", staged_json.string()},
                    o.parity_timeout_s);
    result.parity_s = clock.elapsed_s();
    result.parity_summary = last_line(r.output);
    PARALLAX_CHECK(!r.timed_out, Error,
                   "ONNX export: the parity tool did not finish within {} s ('{}')",
                   o.parity_timeout_s, parity_tool(o));
    if (r.exit_code == 1) {
      // The gate failed: keep the candidate for inspection, publish its numbers, leave model.onnx.
      const fs::path rejected = dir / (name + ".rejected");
      fs::remove_all(rejected, ec);
      for (const char* f : {"parity.json", "parity.h5"}) {
        fs::copy_file(staging.path / f, dir / f, fs::copy_options::overwrite_existing, ec);
      }
      rename_or_throw(staging.path, rejected);
      staging.path.clear();
      throw_error<Error>(
          "ONNX export: parity gate failed: {}; the rejected model is in '{}', every number in "
          "'{}'",
          strip_prefix(result.parity_summary, "FAIL: "), rejected.string(),
          (dir / "parity.json").string());
    }
    PARALLAX_CHECK(r.exit_code == 0, Error,
                   "ONNX export: the parity tool '{}' failed (exit {}): {}", parity_tool(o),
                   r.exit_code,
                   result.parity_summary.empty() ? "no output" : result.parity_summary);
  }

  // Commit: everything but the model, then the model (the rename that makes the export visible).
  const fs::path data_target = dir / data_name;
  if (external) rename_or_throw(staging.path / data_name, data_target);
  for (const char* f : {"parity.h5", "parity.json"}) {
    if (fs::exists(staging.path / f)) {
      rename_or_throw(staging.path / f, dir / f);
    } else {
      fs::remove(dir / f, ec);  // an older export's report describes another model
    }
  }
  rename_or_throw(staged_model, target);
  if (!external) fs::remove(data_target, ec);      // an older export's weights
  fs::remove_all(dir / (name + ".rejected"), ec);  // an older export's rejected candidate
  files::fsync_path(dir.string(), true);
  result.model_file = target.string();
  result.model_bytes = files::file_size(result.model_file);
  if (external) {
    result.data_file = data_target.string();
    result.data_bytes = files::file_size(result.data_file);
  }
  if (!frames.empty()) result.parity_json = (dir / "parity.json").string();
  return result;
}

}  // namespace parallax::checkpoint::exporter
