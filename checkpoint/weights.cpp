#include "checkpoint/weights.h"

#include "checkpoint/checksum_error.h"
#include "checkpoint/finite.h"
#include "checkpoint/h5.h"
#include "checkpoint/tensor_io.h"
#include "core/error.h"
#include "core/files.h"
#include "core/log.h"
#include "core/strings.h"
#include "models/model.h"

#include <ATen/ATen.h>
#include <fmt/ranges.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <set>

namespace fs = std::filesystem;

namespace parallax::checkpoint {
namespace {

// Parameters and buffers of `module` by their module path (undefined tensors skipped).
std::map<std::string, at::Tensor> module_tensors(torch::nn::Module& module) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : module.named_parameters(true)) {
    if (p.value().defined()) out.emplace(p.key(), p.value());
  }
  for (const auto& b : module.named_buffers(true)) {
    if (b.value().defined()) out.emplace(b.key(), b.value());
  }
  return out;
}

herr_t collect_dataset(hid_t, const char* name, const H5O_info_t* info, void* data) {
  if (info->type == H5O_TYPE_DATASET && std::string(name) != ".") {
    static_cast<std::vector<std::string>*>(data)->emplace_back(name);
  }
  return 0;
}

void finish(WeightsReport& report, const WeightsOptions& options, const std::string& source) {
  std::sort(report.missing.begin(), report.missing.end());
  std::sort(report.unexpected.begin(), report.unexpected.end());
  if (options.strict && !report.clean()) {
    throw_error<CheckpointError>(
        "'{}': the weights do not match the module (strict loading, nothing was loaded): {}",
        source, report.summary());
  }
}

}  // namespace

bool is_fp8_state(const std::string& name) {
  static const std::string kHistory = ".fp8.amax_history";
  return name.size() > kHistory.size() &&
         name.compare(name.size() - kHistory.size(), kHistory.size(), kHistory) == 0;
}

bool is_aux_tensor(const std::string& name) {
  const std::string aux = std::string(models::kAuxModule) + ".";
  return name.compare(0, aux.size(), aux) == 0 || is_fp8_state(name);
}

namespace {

// One box of saved tensor `name` (module path) read into `dest` (a module tensor or a view of it);
// empty `offsets`: `dest` is the whole tensor.
struct ReadBox {
  std::string name;
  at::Tensor dest;
  std::vector<int64_t> offsets;
};

// The saved shape module tensor `t` needs, and the boxes of it that `t` holds (boxes_of, or `t`
// whole).
std::vector<int64_t> wanted_shape(const std::string& name, const at::Tensor& t,
                                  const WeightsOptions& options) {
  const auto boxes = options.boxes_of ? options.boxes_of(name, t) : std::nullopt;
  return boxes ? boxes->shape : t.sizes().vec();
}
std::vector<ReadBox> boxes_for(const std::string& name, const at::Tensor& t,
                               const WeightsOptions& options) {
  const auto boxes = options.boxes_of ? options.boxes_of(name, t) : std::nullopt;
  if (!boxes) return {ReadBox{name, t, {}}};
  std::vector<ReadBox> out;
  for (const auto& [view, offsets] : boxes->boxes) out.push_back(ReadBox{name, view, offsets});
  return out;
}

// An open source of weights: a checkpoint (owned, or the caller's) or a weights .h5 file.
class WeightsSource {
 public:
  WeightsSource(CheckpointReader& reader, const WeightsOptions& options)
      : prefix_(options.prefix), verify_(options.verify) {
    use(reader);
  }
  WeightsSource(const std::string& path, const WeightsOptions& options)
      : prefix_(options.prefix), verify_(options.verify), where_(path) {
    std::error_code ec;
    if (is_tensor_source(path)) {
      mapped_ =
          std::make_unique<MappedTensors>(path, options.pretrained.value_or(PretrainedOptions{}));
      shapes_ = mapped_->shapes();
      format_ = mapped_->format();
      return;
    }
    if (!fs::is_regular_file(path, ec)) {
      owned_ = std::make_unique<CheckpointReader>(path);
      use(*owned_);
      return;
    }
    h5::quiet_errors();
    file_ = h5::Id(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT));
    if (!file_.valid())
      h5::fail<CheckpointError>(fmt::format("cannot open weights file '{}' (not HDF5?)", path));
    std::vector<std::string> names;
    if (H5Ovisit(file_, H5_INDEX_NAME, H5_ITER_INC, collect_dataset, &names) < 0)
      h5::fail<CheckpointError>(fmt::format("cannot list the datasets of weights file '{}'", path));
    std::vector<std::string> unrecorded;  // datasets without a checksum
    for (const std::string& name : names) {
      h5::Id d(H5Dopen2(file_, name.c_str(), H5P_DEFAULT));
      if (!d.valid())
        h5::fail<CheckpointError>(fmt::format("weights file '{}': cannot open '{}'", path, name));
      shapes_[name] = h5::dataset_dims(d, context(name));
      int64_t crc = 0;
      if (h5::read_int64_attr(d, kWeightsChecksumAttr, crc)) {
        crcs_[name] = static_cast<uint32_t>(crc);
      } else {
        unrecorded.push_back(name);
      }
    }
    if (verify_) check_recorded(unrecorded);
  }

  // Saved tensors by module path, with their (global) shapes.
  const std::map<std::string, std::vector<int64_t>>& shapes() const { return shapes_; }
  const std::string& where() const { return where_; }
  const std::string& format() const { return format_; }
  const MappedTensors* mapped() const { return mapped_.get(); }

  // Reads every box (converted to its destination's dtype and device).
  void read(const std::vector<ReadBox>& boxes) {
    at::NoGradGuard no_grad;
    if (mapped_) {
      // Every tensor read and checked before the first reaches the module (a refused file loads
      // nothing); a safetensors file is memory-mapped, so the second read costs no disk.
      if (boxes.size() > 1) {
        std::set<std::string> checked;
        for (const ReadBox& b : boxes) {
          if (checked.insert(b.name).second) check_dtype(b, mapped_->read(b.name));
        }
      }
      std::string name;
      at::Tensor whole;
      for (const ReadBox& b : boxes) {
        if (b.name != name) {
          whole = mapped_->read(b.name);
          check_dtype(b, whole);
          name = b.name;
        }
        at::Tensor part = whole;
        for (std::size_t d = 0; d < b.offsets.size(); ++d)
          part = part.narrow(static_cast<int64_t>(d), b.offsets[d], b.dest.size(d));
        b.dest.copy_(part);
      }
      return;
    }
    if (reader_ != nullptr) {
      std::vector<LoadTarget> targets;
      for (const ReadBox& b : boxes)
        targets.push_back(LoadTarget{prefix_ + b.name, b.dest, b.offsets});
      ReadOptions ro;
      ro.verify = verify_;
      ro.allow_cast = true;
      reader_->load(targets, ro);
      return;
    }
    for (const ReadBox& b : boxes) {
      const std::vector<int64_t> offsets =
          b.offsets.empty() ? std::vector<int64_t>(static_cast<std::size_t>(b.dest.dim()), 0)
                            : b.offsets;
      const at::Tensor stored = tensor_io::read_dataset_box(file_, b.name, offsets,
                                                            b.dest.sizes().vec(), context(b.name));
      // Verified before any of the tensor reaches the module.
      const bool whole =
          std::all_of(offsets.begin(), offsets.end(), [](int64_t o) { return o == 0; }) &&
          stored.sizes().vec() == shapes_.at(b.name);
      verify(b.name, whole ? &stored : nullptr);
      b.dest.copy_(stored);
    }
  }

 private:
  void use(CheckpointReader& reader) {
    reader_ = &reader;
    where_ = reader.dir();
    format_ = "checkpoint";
    for (const std::string& n : reader.names(prefix_))
      shapes_[n.substr(prefix_.size())] = reader.info(n).shape;
  }
  std::string context(const std::string& name) const {
    return fmt::format("weights file '{}', tensor '{}'", where_, name);
  }
  // A foreign tensor must be floating for a floating module tensor, and integral for an integral
  // one (a bool or integer tensor is no weight; a float is no step count).
  void check_dtype(const ReadBox& b, const at::Tensor& v) const {
    const bool want = at::isFloatingType(b.dest.scalar_type());
    PARALLAX_CHECK(at::isFloatingType(v.scalar_type()) == want, CheckpointError,
                   "'{}': tensor '{}' is {}, which the model's {} '{}' cannot take; nothing was "
                   "loaded",
                   where_, b.name, c10::toString(v.scalar_type()),
                   c10::toString(b.dest.scalar_type()), b.name);
  }
  // Files of format version 2 and later record a checksum for every tensor; older ones none (one
  // warning, then they load unverified).
  void check_recorded(const std::vector<std::string>& unrecorded) const {
    if (unrecorded.empty()) return;
    int64_t version = 0;
    h5::read_int64_attr(file_, "format_version", version);
    if (version >= 2) {
      throw_error<CheckpointError>(
          "weights file '{}' (format version {}): tensor '{}' has no '{}' attribute, which this "
          "version records for every tensor; the file was altered: export it again",
          where_, version, unrecorded.front(), kWeightsChecksumAttr);
    }
    core::log::warn(
        "weights file '{}' holds no checksums (format version {}, written before they were "
        "added): its tensors load without verification; export it again to add them",
        where_, version);
  }
  // Checks tensor `name` against its recorded crc32, once: on `whole` (the dataset as just read,
  // in its stored dtype) when given, else by streaming the dataset. Throws ChecksumError.
  void verify(const std::string& name, const at::Tensor* whole) {
    const auto it = crcs_.find(name);
    if (!verify_ || it == crcs_.end() || verified_.count(name)) return;
    const uint32_t got =
        whole ? tensor_io::crc32_update(0, whole->const_data_ptr(),
                                        static_cast<int64_t>(whole->nbytes()), /*parallel=*/true)
              : tensor_io::dataset_crc32(file_, name, 64 << 20, context(name));
    if (got != it->second) {
      throw_error<ChecksumError>(
          "weights file '{}': checksum mismatch for tensor '{}': crc32 {:08x} recorded, {:08x} "
          "read; the file is corrupt (export it again)",
          where_, name, it->second, got);
    }
    verified_.insert(name);
  }
  std::unique_ptr<CheckpointReader> owned_;
  std::unique_ptr<MappedTensors> mapped_;
  std::string format_ = "weights.h5";
  CheckpointReader* reader_ = nullptr;
  h5::Id file_;
  std::string prefix_;
  bool verify_ = true;
  std::string where_;
  std::map<std::string, std::vector<int64_t>> shapes_;
  std::map<std::string, uint32_t> crcs_;  // a weights file's recorded checksums
  std::set<std::string> verified_;
};

// Module tensors against the saved ones: the report (CheckpointError when strict and not clean),
// its `loaded` the tensors to read.
WeightsReport match_weights(const std::map<std::string, at::Tensor>& all,
                            const WeightsSource& source, const WeightsOptions& options) {
  WeightsReport report;
  report.format = source.format();
  // model.pretrained.target=backbone: only the module's tensors under the root.
  const std::string root = options.pretrained ? options.pretrained->root : std::string();
  const auto under = [&](const std::string& n) { return n.rfind(root, 0) == 0; };
  std::map<std::string, at::Tensor> model;
  for (const auto& [name, t] : all) {
    if (under(name)) model.emplace(name, t);
  }
  if (const MappedTensors* m = source.mapped()) {
    report.ignored = m->ignored();
    report.adapted = m->adapted();
    report.notes = m->notes();
    for (const std::string& n : m->unplaced()) report.unexpected.push_back(n);
  }
  for (const auto& [name, t] : model) {
    const auto it = source.shapes().find(name);
    if (it == source.shapes().end()) {
      // A run switched to precision.fp8.recipe=delayed starts its histories empty.
      if (!is_fp8_state(name)) report.missing.push_back(name);
      continue;
    }
    const std::vector<int64_t> want = wanted_shape(name, t, options);
    if (it->second != want) {
      report.mismatched.push_back(ShapeMismatch{name, it->second, want});
      continue;
    }
    report.loaded.push_back(name);
  }
  for (const auto& [n, shape] : source.shapes()) {
    if (model.count(n) || is_aux_tensor(n)) continue;
    // A Parallax source read for its backbone: the rest of its model is not for this load.
    if (!under(n)) {
      report.ignored.push_back(n);
      continue;
    }
    report.unexpected.push_back(n);
  }
  finish(report, options, source.where());
  if (!options.strict && report.loaded.empty() && !model.empty()) {
    // Non-strict loading of nothing leaves the module as it was built: never what was meant.
    const auto few = [](const std::vector<std::string>& names) {
      const std::size_t n = std::min<std::size_t>(names.size(), 4);
      return fmt::format(
          "{}{} ({} in all)",
          core::join(std::vector<std::string>(names.begin(), names.begin() + n), ", "),
          names.size() > n ? ", ..." : "", names.size());
    };
    std::vector<std::string> saved, wanted;
    for (const auto& [n, shape] : source.shapes()) saved.push_back(n);
    for (const auto& [n, t] : model) wanted.push_back(n);
    throw_error<CheckpointError>(
        "'{}': nothing matched the module (non-strict loading would load 0 of its {} tensors): "
        "it holds {}; the module has {}{}",
        source.where(), model.size(), saved.empty() ? "no tensors" : few(saved), few(wanted),
        report.mismatched.empty()
            ? ""
            : fmt::format("; {} name(s) match with another shape", report.mismatched.size()));
  }
  return report;
}

WeightsReport load_from_source(WeightsSource& source, torch::nn::Module& module,
                               const WeightsOptions& options) {
  const auto model = module_tensors(module);
  WeightsReport report = match_weights(model, source, options);
  std::vector<ReadBox> boxes;
  for (const std::string& name : report.loaded) {
    for (ReadBox& b : boxes_for(name, model.at(name), options)) boxes.push_back(std::move(b));
  }
  source.read(boxes);
  return report;
}

}  // namespace

WeightsReport load_weights(CheckpointReader& reader, torch::nn::Module& module,
                           const WeightsOptions& options) {
  WeightsSource source(reader, options);
  return load_from_source(source, module, options);
}

WeightsReport load_weights(torch::nn::Module& module, const std::string& path,
                           const WeightsOptions& options) {
  WeightsSource source(path, options);
  return load_from_source(source, module, options);
}

DeferredWeights defer_weights(torch::nn::Module& module, const std::string& path,
                              const WeightsOptions& options) {
  auto source = std::make_shared<WeightsSource>(path, options);
  const auto model = module_tensors(module);
  DeferredWeights out;
  out.report = match_weights(model, *source, options);
  for (const std::string& name : out.report.loaded) {
    const at::Tensor& t = model.at(name);
    out.readers[name] = [source, options, name, shape = t.sizes().vec(),
                         dtype = t.scalar_type()]() {
      at::Tensor value = at::empty(shape, at::TensorOptions().dtype(dtype));
      source->read(boxes_for(name, value, options));
      return value;
    };
  }
  return out;
}

namespace {

int64_t write_weights(const std::string& checkpoint_path, const std::string& out_file,
                      at::ScalarType dtype, bool allow_nonfinite,
                      const std::vector<std::pair<std::string, at::Tensor>>* given) {
  PARALLAX_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, CheckpointError,
                 "export dtype must be float32 or bfloat16, got {}", dtype_name(dtype));
  CheckpointReader reader(checkpoint_path);
  std::vector<std::string> names;
  if (given) {
    for (const auto& [n, t] : *given)
      if (!is_aux_tensor(n)) names.push_back(kModelPrefix + n);
  } else {
    for (auto& n : reader.names(kModelPrefix))
      if (!is_aux_tensor(n.substr(std::string(kModelPrefix).size()))) names.push_back(std::move(n));
  }
  PARALLAX_CHECK(!names.empty(), CheckpointError,
                 "checkpoint '{}' holds no model tensors (prefix '{}')", reader.dir(),
                 kModelPrefix);
  // An HDF5 file is written by name, at random offsets: never through a device node or a FIFO,
  // and published in one rename (core/files.h); the temporary file goes on every error.
  core::StagedFile staged("export: the weights file", out_file,
                          "an HDF5 file is written at random offsets and renamed into place");
  const std::string& tmp = staged.temp_path();
  h5::quiet_errors();
  {
    h5::Id fapl(H5Pcreate(H5P_FILE_ACCESS));
    H5Pset_fclose_degree(fapl, H5F_CLOSE_STRONG);
    h5::Id file(H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl));
    if (!file.valid()) h5::fail<IoError>(fmt::format("cannot create weights file '{}'", tmp));
    const Metadata& m = reader.metadata();
    h5::write_string_attr(file, "format", kWeightsFormat);
    h5::write_int64_attr(file, "format_version", kWeightsFormatVersion);
    h5::write_int64_attr(file, "step", m.step);
    h5::write_string_attr(file, "config_hash", m.config_hash);
    h5::write_string_attr(file, "source", reader.dir());
    tensor_io::Staging staging;
    for (std::size_t i = 0; i < names.size(); ++i) {
      const std::string& n = names[i];
      at::Tensor t = given ? (*given)[i].second.detach().to(at::kCPU) : reader.read(n);
      const std::string flat = n.substr(std::string(kModelPrefix).size());
      if (first_nonfinite({t}, /*parallel=*/true) >= 0) {
        const NonFiniteCount c = count_nonfinite(t);
        if (!allow_nonfinite) {
          throw_error<CheckpointError>(
              "checkpoint '{}' (step {}): tensor '{}' holds {} NaN and {} infinite value(s) of "
              "{}; refusing to export non-finite weights (--force exports them anyway)",
              reader.dir(), m.step, n, c.nan, c.inf, t.numel());
        }
        core::log::warn(
            "export: tensor '{}' of checkpoint '{}' holds {} NaN and {} infinite "
            "value(s); exported anyway (--force)",
            n, reader.dir(), c.nan, c.inf);
      }
      if (at::isFloatingType(t.scalar_type()) && t.scalar_type() != dtype) t = t.to(dtype);
      const std::string what = fmt::format("writing tensor '{}' to weights file '{}'", flat, tmp);
      const uint32_t crc = tensor_io::write_dataset(file, flat, t, 64 << 20, staging, what);
      h5::Id d(H5Dopen2(file, flat.c_str(), H5P_DEFAULT));
      if (!d.valid()) h5::fail<IoError>(what);
      h5::write_int64_attr(d, kWeightsChecksumAttr, crc);
    }
    if (H5Fclose(file.release()) < 0)
      h5::fail<IoError>(fmt::format("cannot write weights file '{}'", tmp));
    staged.commit();
  }
  core::log::info("export: wrote {} tensors of step {} to '{}' ({})", names.size(),
                  reader.metadata().step, out_file, dtype_name(dtype));
  return static_cast<int64_t>(names.size());
}

}  // namespace

int64_t export_weights(const std::string& checkpoint_path, const std::string& out_file,
                       at::ScalarType dtype, bool allow_nonfinite) {
  return write_weights(checkpoint_path, out_file, dtype, allow_nonfinite, nullptr);
}

int64_t export_weights(const std::string& checkpoint_path, const std::string& out_file,
                       at::ScalarType dtype, bool allow_nonfinite,
                       const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  return write_weights(checkpoint_path, out_file, dtype, allow_nonfinite, &tensors);
}

bool is_weights_file(const std::string& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return false;
  h5::quiet_errors();
  if (H5Fis_hdf5(path.c_str()) <= 0) {
    h5::error_message();
    return false;
  }
  h5::Id file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT));
  if (!file.valid()) {
    h5::error_message();
    return false;
  }
  std::string format;
  return h5::read_string_attr(file, "format", format) && format == kWeightsFormat;
}

}  // namespace parallax::checkpoint
