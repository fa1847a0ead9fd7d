#include "checkpoint/export/onnx_export.h"

#include "checkpoint/export/onnx_graph.h"
#include "checkpoint/files.h"
#include "checkpoint/h5.h"
#include "checkpoint/tensor_io.h"
#include "core/build_info.h"
#include "core/error.h"
#include "core/files.h"
#include "core/log.h"
#include "core/progress.h"
#include "core/strings.h"
#include "core/subprocess.h"
#include "core/timer.h"

#include <onnx/common/version.h>

#include <ATen/ATen.h>
#include <fcntl.h>
#include <unistd.h>

#include <sys/file.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>

namespace fs = std::filesystem;

namespace parallax::checkpoint::exporter {

using core::last_line;
using core::ProcessResult;
using core::run_process;

namespace {

// The levels below the boundaries rounding_ties() looks at (k + 0.5 for k in [-128, 126]).
constexpr double kQuantTieMin = -128, kQuantTieMax = 126;

std::string strip_prefix(const std::string& s, const std::string& prefix) {
  return s.rfind(prefix, 0) == 0 ? s.substr(prefix.size()) : s;
}

const char* dtype_label(at::ScalarType t) {
  return t == at::kHalf ? "fp16" : "fp32";
}

// The prefix of the staging folders of exports to `name` (".model.onnx.staging-").
std::string staging_prefix(const std::string& name) {
  return "." + name + ".staging-";
}

// An open descriptor, closed on scope exit (closing releases its flock).
struct LockFd {
  int fd = -1;
  LockFd() = default;
  LockFd(const LockFd&) = delete;
  LockFd& operator=(const LockFd&) = delete;
  ~LockFd() {
    if (fd >= 0) ::close(fd);
  }
  // Opens directory `dir` and takes an exclusive flock on it: blocking up to `wait_s`, or not at
  // all (0). False when it cannot (held elsewhere, or a file system without flock on
  // directories).
  bool lock(const fs::path& dir, double wait_s) {
    fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return false;
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::milliseconds(static_cast<int64_t>(wait_s * 1000));
    while (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      if ((errno != EWOULDBLOCK && errno != EINTR) || std::chrono::steady_clock::now() >= deadline)
        return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return true;
  }
};

// The staging folder of this export: locked (flock on the folder) while the export runs, so that
// another export's remove_stale_staging() leaves it alone; removed on scope exit unless released
// (path cleared), then unlocked.
struct StagingDir {
  fs::path path;
  LockFd lock;
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

// parity.h5, written one frame at a time: each graph input and LibTorch output is a dataset
// [frames, ...] (native uint8 / float32 / ...), created at the first frame and filled row by row,
// so memory holds one frame whatever the frame count.
class ParityFile {
 public:
  ParityFile(const std::string& path, int64_t frames, const std::string& config_json)
      : path_(path), frames_(frames) {
    h5::quiet_errors();
    h5::Id fapl(H5Pcreate(H5P_FILE_ACCESS));
    H5Pset_fclose_degree(fapl, H5F_CLOSE_STRONG);
    file_ = h5::Id(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl));
    if (!file_.valid())
      h5::fail<IoError>(fmt::format("ONNX export: cannot create parity file '{}'", path));
    h5::write_string_attr(file_, "format", "parallax-onnx-parity");
    h5::write_int64_attr(file_, "format_version", 1);
    h5::write_string_attr(file_, "config", config_json);
  }

  // Writes `t` (one frame, leading dimension 1) as row `index` of dataset `name`.
  void write(const std::string& name, int64_t index, const at::Tensor& t) {
    const std::string context =
        fmt::format("writing '{}' of frame {} to parity file '{}'", name, index, path_);
    const at::Tensor row = t.detach().to(at::kCPU).contiguous();
    PARALLAX_CHECK(row.dim() >= 1 && row.size(0) == 1, Error,
                   "ONNX export: parity frame {}: '{}' has shape {}, expected a batch of 1", index,
                   name, fmt::format("{}", row.sizes()));
    std::vector<int64_t> dims = row.sizes().vec();
    auto it = sets_.find(name);
    if (it == sets_.end()) {
      dims[0] = frames_;
      h5::Id lcpl(H5Pcreate(H5P_LINK_CREATE));
      if (!lcpl.valid() || H5Pset_create_intermediate_group(lcpl, 1) < 0)
        h5::fail<IoError>(context);
      const h5::Id dcpl = h5::dataset_create_plist();
      h5::Id space = h5::make_space(h5::to_hsize(dims));
      h5::Id dset(H5Dcreate2(file_, name.c_str(), h5::storage_type(row.scalar_type(), name), space,
                             lcpl, dcpl, H5P_DEFAULT));
      if (!dset.valid()) h5::fail<IoError>(context);
      it = sets_.emplace(name, Set{std::move(dset), row.sizes().vec(), row.scalar_type()}).first;
    }
    const Set& set = it->second;
    PARALLAX_CHECK(set.row == row.sizes().vec() && set.dtype == row.scalar_type(), Error,
                   "ONNX export: parity frame {}: '{}' is {} {}, frame 0's was {} {}", index, name,
                   c10::toString(row.scalar_type()), fmt::format("{}", row.sizes()),
                   c10::toString(set.dtype), fmt::format("{}", set.row));
    std::vector<hsize_t> start(dims.size(), 0), count = h5::to_hsize(row.sizes().vec());
    start[0] = static_cast<hsize_t>(index);
    h5::Id fspace(H5Dget_space(set.dset));
    h5::Id mspace = h5::make_space(count);
    if (!fspace.valid() ||
        H5Sselect_hyperslab(fspace, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr) <
            0 ||
        H5Dwrite(set.dset, h5::storage_type(set.dtype, name), mspace, fspace, H5P_DEFAULT,
                 row.const_data_ptr()) < 0) {
      h5::fail<IoError>(context);
    }
  }

  // Appends 1-D `values` to the extendible 1-D dataset `name` (created empty on the first call).
  void append(const std::string& name, const at::Tensor& values) {
    const std::string context = fmt::format("appending to '{}' of parity file '{}'", name, path_);
    const at::Tensor v = values.detach().to(at::kCPU).contiguous().reshape({-1});
    auto it = sets_.find(name);
    if (it == sets_.end()) {
      h5::Id lcpl(H5Pcreate(H5P_LINK_CREATE));
      h5::Id dcpl(H5Pcreate(H5P_DATASET_CREATE));
      const hsize_t chunk = 1 << 16, zero = 0, unlimited = H5S_UNLIMITED;
      if (!lcpl.valid() || H5Pset_create_intermediate_group(lcpl, 1) < 0 || !dcpl.valid() ||
          H5Pset_chunk(dcpl, 1, &chunk) < 0 || H5Pset_obj_track_times(dcpl, 0) < 0)
        h5::fail<IoError>(context);
      h5::Id space(H5Screate_simple(1, &zero, &unlimited));
      h5::Id dset(H5Dcreate2(file_, name.c_str(), h5::storage_type(v.scalar_type(), name), space,
                             lcpl, dcpl, H5P_DEFAULT));
      if (!space.valid() || !dset.valid()) h5::fail<IoError>(context);
      it = sets_.emplace(name, Set{std::move(dset), {0}, v.scalar_type()}).first;
    }
    Set& set = it->second;
    const hsize_t n = static_cast<hsize_t>(v.numel());
    if (n == 0) return;
    const hsize_t start = static_cast<hsize_t>(set.row[0]), total = start + n;
    if (H5Dset_extent(set.dset, &total) < 0) h5::fail<IoError>(context);
    h5::Id fspace(H5Dget_space(set.dset));
    h5::Id mspace(H5Screate_simple(1, &n, nullptr));
    if (!fspace.valid() || !mspace.valid() ||
        H5Sselect_hyperslab(fspace, H5S_SELECT_SET, &start, nullptr, &n, nullptr) < 0 ||
        H5Dwrite(set.dset, h5::storage_type(set.dtype, name), mspace, fspace, H5P_DEFAULT,
                 v.const_data_ptr()) < 0)
      h5::fail<IoError>(context);
    set.row[0] = static_cast<int64_t>(total);  // an appended set's `row` is its length
  }

  // Writes `t` whole as dataset `name`.
  void put(const std::string& name, const at::Tensor& t) {
    tensor_io::Staging staging;
    tensor_io::write_dataset(file_, name, t.contiguous(), 64 << 20, staging,
                             fmt::format("writing '{}' to parity file '{}'", name, path_));
  }

  void close() {
    sets_.clear();
    if (H5Fclose(file_.release()) < 0)
      h5::fail<IoError>(fmt::format("ONNX export: cannot write parity file '{}'", path_));
  }

 private:
  struct Set {
    h5::Id dset;
    std::vector<int64_t> row;
    at::ScalarType dtype;
  };
  std::string path_;
  int64_t frames_;
  h5::Id file_;
  std::map<std::string, Set> sets_;
};

// LibTorch's outputs of one frame (batch 1), float32 on the CPU, by graph output name.
std::map<std::string, at::Tensor> reference_output(models::Model& model, c10::Device device,
                                                   const core::TensorDict& frame, int64_t index,
                                                   const std::vector<std::string>& inputs,
                                                   const std::vector<std::string>& outputs) {
  core::TensorDict batch;
  for (const auto& name : inputs) {
    auto it = frame.find(name);
    PARALLAX_CHECK(it != frame.end() && it->second.defined() && it->second.dim() >= 1 &&
                       it->second.size(0) == 1,
                   Error, "ONNX export: parity frame {} has no graph input '{}' with a batch of 1",
                   index, name);
    batch.emplace(name, it->second.to(device));
  }
  const core::TensorDict pred = model.forward(batch);
  std::map<std::string, at::Tensor> out;
  for (const auto& name : outputs) {
    auto it = pred.find(name);
    PARALLAX_CHECK(
        it != pred.end(), Error,
        "ONNX export: graph output '{}' is not a key of the model's forward() (emitter bug)", name);
    out.emplace(name, it->second.detach().to(at::kCPU, at::kFloat));
  }
  return out;
}

std::string gigabytes(double bytes) {
  return fmt::format("{:.2f} GB", bytes / 1e9);
}

}  // namespace

std::pair<at::Tensor, at::Tensor> rounding_ties(const at::Tensor& quotient, double margin) {
  at::NoGradGuard no_grad;
  const at::Tensor q = quotient.detach().to(at::kCPU, at::kFloat).reshape({-1});
  // A boundary between levels k and k + 1 lies at k + 0.5 for k in [-128, 126]; beyond them the
  // clamp gives one level either way.
  const at::Tensor lower = at::floor(q);
  const at::Tensor tie = (q - lower - 0.5)
                             .abs()
                             .lt(margin)
                             .logical_and(lower.ge(kQuantTieMin))
                             .logical_and(lower.le(kQuantTieMax));
  const at::Tensor index = tie.nonzero().reshape({-1});
  const at::Tensor level = at::round(q.index_select(0, index)).clamp_(-128, 127).to(at::kChar);
  return {index.to(at::kInt), level};
}

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
  // docs/export.md ("QAT models"). The fake quantization and the Q/DQ graph compute the same
  // function (both divide by the scale and round half to even), and the parity tool imposes
  // LibTorch's rounding on the values within kQuantTieMargin of a boundary (QuantTies), so what
  // remains is the float32 difference of the layers between the quantizers: measured 1.0000000
  // cosine and max-abs <= 2.4e-7 on bev_tiny ViT after 4 QAT steps. The gate stays where the
  // issue found it (an empirical one from before the ties were imposed); one activation scale off
  // by 2% fails it (cosine 0.998 on box_reg).
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
  return core::python_exe();
}

std::string parity_tool(const OnnxExportOptions& o) {
  if (!o.tool.empty()) return o.tool;
  return (fs::path(core::source_dir()) / "tools" / "onnx_parity.py").string();
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
  // Nothing named from the model file's path lands beside a device node, FIFO or folder, and no
  // rename replaces one (core/files.h).
  const fs::path dir = fs::path(model_file).parent_path().empty()
                           ? fs::path(".")
                           : fs::path(model_file).parent_path();
  for (const fs::path& f : {fs::path(model_file), fs::path(model_file + ".data"), dir / "parity.h5",
                            dir / "parity.json"}) {
    core::check_output_file("ONNX export: output", f.string(), core::OutputRule::kFile,
                            "the export writes a regular file there, renamed into place");
  }
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

int remove_stale_staging(const std::string& model_file) {
  const fs::path target(model_file);
  const fs::path dir = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  const std::string prefix = staging_prefix(target.filename().string());
  // The folder's lock orders this scan after any export's create-and-lock of its staging folder
  // (a folder never appears unlocked to the scan).
  LockFd dir_lock;
  if (!dir_lock.lock(dir, 10)) return 0;
  int removed = 0;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string entry = it->path().filename().string();
    if (entry.rfind(prefix, 0) != 0 || !it->is_directory(ec)) continue;
    LockFd l;
    if (!l.lock(it->path(), 0)) continue;  // its export runs (or no flock here: keep it)
    std::error_code rm;
    fs::remove_all(it->path(), rm);
    if (rm) {
      core::log::warn("ONNX export: cannot remove the stale staging folder '{}': {}",
                      it->path().string(), rm.message());
    } else {
      core::log::info("ONNX export: removed '{}', left by an export that did not finish",
                      it->path().string());
      ++removed;
    }
  }
  return removed;
}

OnnxExportResult export_onnx(models::Model& model, const std::vector<core::TensorDict>& frames,
                             const std::string& model_file, const OnnxExportOptions& o) {
  ParityFrames source;
  source.count = static_cast<int64_t>(frames.size());
  source.frame = [&frames](int64_t i) { return frames.at(static_cast<size_t>(i)); };
  return export_onnx(model, source, model_file, o);
}

OnnxExportResult export_onnx(models::Model& model, const ParityFrames& frames,
                             const std::string& model_file, const OnnxExportOptions& o) {
  validate(o);
  prepare_output_dir(model_file);
  PARALLAX_CHECK(frames.count >= 0 && (frames.count == 0 || frames.frame), Error,
                 "ONNX export: {} parity frames without a source", frames.count);
  auto interruption_point = [&o] {
    if (o.interruption) o.interruption();
  };
  if (frames.count > 0) check_parity_runtime(o);
  const int64_t ort_batch = o.batch > 0 ? o.batch : o.parity_batch;
  PARALLAX_CHECK(o.batch == 0 || frames.count % o.batch == 0, UsageError,
                 "ONNX export: {} parity frames do not fill batches of the fixed batch size {}",
                 frames.count, o.batch);

  const fs::path target(model_file);
  const fs::path dir = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  const std::string name = target.filename().string(), data_name = name + ".data";
  remove_stale_staging(model_file);
  StagingDir staging;
  std::error_code ec;
  {
    LockFd dir_lock;
    dir_lock.lock(dir, 10);  // best effort: see remove_stale_staging()
    staging.path = dir / (staging_prefix(name) + files::random_hex(4));
    fs::create_directory(staging.path, ec);
    PARALLAX_CHECK(!ec, IoError, "ONNX export: cannot create '{}': {}", staging.path.string(),
                   ec.message());
    staging.lock.lock(staging.path, 0);
  }
  interruption_point();

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
  if (frames.count > 0) {
    clock.reset();
    const std::vector<std::string> inputs = graph.input_names(), outputs = graph.output_names();
    // A quantized model's ties: dataset group ties/<k> for the k-th of these graph tensors.
    const std::vector<std::string> tie_tensors =
        o.quant_ties ? o.quant_ties->tensors() : std::vector<std::string>{};
    const std::string config = fmt::format(
        "{{\"model\": {}, \"opset\": {}, \"dtype\": \"{}\", \"batch\": {}, \"ort_batch\": {}, "
        "\"frames\": {}, "
        "\"frames_source\": {}, \"inputs\": {}, \"outputs\": {}, \"gate\": {{\"min_cosine\": {}, "
        "\"max_abs_rel\": {}, "
        "\"rule\": \"per output and frame: cosine >= min_cosine and max_abs <= max_abs_rel * "
        "max(1, max|torch|)\"}}, "
        "\"reference\": \"LibTorch forward, float32, eval mode, batch 1 per frame\", "
        "\"ties\": {}}}",
        core::json_quote(name), o.opset, dtype_label(o.dtype),
        o.batch > 0 ? std::to_string(o.batch) : "\"dynamic\"", ort_batch, frames.count,
        core::json_quote(o.frames_source), core::json_strings(inputs), core::json_strings(outputs),
        gate.min_cosine, gate.max_abs_rel,
        tie_tensors.empty() ? std::string("null")
                            : fmt::format("{{\"margin\": {}, \"tensors\": {}}}", kQuantTieMargin,
                                          core::json_strings(tie_tensors)));
    // LibTorch's outputs, frame by frame (batch 1 each), streamed into parity.h5 with the inputs.
    const bool was_training = model.is_training();
    model.eval();
    c10::Device device(c10::kCPU);
    for (const auto& p : model.parameters()) {
      device = p.device();
      break;
    }
    double forward_s = 0;
    {
      at::NoGradGuard no_grad;
      ParityFile file(staged_h5.string(), frames.count, config);
      // A line at the first frame, then every 5 s with the rate and the ETA (core/progress.h).
      core::Progress progress("export: parity reference frames", frames.count);
      for (int64_t f = 0; f < frames.count; ++f) {
        interruption_point();
        const core::TensorDict frame = frames.frame(f);
        core::Stopwatch fwd;
        if (o.quant_ties) o.quant_ties->begin_frame();
        const auto ref = reference_output(model, device, frame, f, inputs, outputs);
        forward_s += fwd.elapsed_s();
        int64_t tie_bytes = 0;
        if (o.quant_ties) {
          auto ties = o.quant_ties->end_frame();
          for (std::size_t k = 0; k < tie_tensors.size(); ++k) {
            auto it = ties.find(tie_tensors[k]);
            PARALLAX_CHECK(it != ties.end(), Error,
                           "ONNX export: the parity reference of frame {} recorded no rounding "
                           "ties for graph tensor '{}'",
                           f, tie_tensors[k]);
            const QuantTies::Frame& t = it->second;
            const std::string group = fmt::format("ties/{}/", k);
            if (f == 0) file.put(group + "shape", at::tensor(t.shape, at::kLong));
            file.write(group + "count", f, at::full({1}, t.index.numel(), at::kLong));
            file.append(group + "index", t.index.to(at::kInt));
            file.append(group + "level", t.level.to(at::kChar));
            tie_bytes += t.index.numel() * 5;
          }
        }
        if (f == 0) {
          // parity.h5 holds every frame: refuse a count the disk cannot hold before writing it.
          int64_t frame_bytes = 0;
          for (const auto& n : inputs) frame_bytes += frame.at(n).nbytes();
          for (const auto& [n, t] : ref) frame_bytes += t.nbytes();
          frame_bytes += tie_bytes;
          const double need = static_cast<double>(frame_bytes) * static_cast<double>(frames.count);
          const fs::space_info space = fs::space(staging.path, ec);
          PARALLAX_CHECK(ec || need <= 0.95 * static_cast<double>(space.available), IoError,
                         "ONNX export: {} parity frames (--parity-frames / export.parity_frames) "
                         "need {} for parity.h5 ({} bytes per frame), but '{}' has {} free; use "
                         "fewer frames",
                         frames.count, gigabytes(need), frame_bytes, dir.string(),
                         gigabytes(static_cast<double>(space.available)));
        }
        for (const auto& n : inputs) file.write("inputs/" + n, f, frame.at(n));
        for (const auto& [n, t] : ref) file.write("outputs/" + n, f, t);
        progress.update(f + 1);
      }
      file.close();
    }
    if (was_training) model.train();
    result.reference_s = forward_s;
    clock.reset();
    const std::string py = parity_python(o);
    core::log::info("export: ONNX Runtime runs the {} parity frames ({})", frames.count,
                    parity_tool(o));
    const ProcessResult r =
        run_process({py, parity_tool(o), "--model", staged_model.string(), "--frames",
                     staged_h5.string(), "--out", staged_json.string()},
                    o.parity_timeout_s, interruption_point);
    result.parity_s = clock.elapsed_s();
    interruption_point();  // e.g. a SIGINT to the process group also ended the tool
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
  if (frames.count > 0) result.parity_json = (dir / "parity.json").string();
  return result;
}

}  // namespace parallax::checkpoint::exporter
