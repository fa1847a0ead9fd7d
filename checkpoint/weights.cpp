#include "checkpoint/weights.h"

#include "checkpoint/files.h"
#include "checkpoint/finite.h"
#include "checkpoint/h5.h"
#include "checkpoint/tensor_io.h"
#include "core/error.h"
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

std::string WeightsReport::summary() const {
  std::vector<std::string> parts{fmt::format("loaded {}", loaded.size())};
  if (!missing.empty()) parts.push_back("missing: " + core::join(missing, ", "));
  if (!unexpected.empty()) parts.push_back("unexpected: " + core::join(unexpected, ", "));
  if (!mismatched.empty()) {
    std::vector<std::string> m;
    for (const auto& x : mismatched)
      m.push_back(fmt::format("{} {} saved vs {} in the model", x.name, x.saved, x.model));
    parts.push_back("shape mismatch: " + core::join(m, ", "));
  }
  return core::join(parts, "; ");
}

bool is_aux_tensor(const std::string& name) {
  const std::string aux = std::string(models::kAuxModule) + ".";
  return name.compare(0, aux.size(), aux) == 0;
}

WeightsReport load_weights(CheckpointReader& reader, torch::nn::Module& module,
                           const WeightsOptions& options) {
  WeightsReport report;
  const auto model = module_tensors(module);
  std::set<std::string> saved;
  for (const std::string& n : reader.names(options.prefix))
    saved.insert(n.substr(options.prefix.size()));
  std::vector<LoadTarget> targets;
  for (const auto& [name, t] : model) {
    if (!saved.count(name)) {
      report.missing.push_back(name);
      continue;
    }
    const TensorInfo& info = reader.info(options.prefix + name);
    std::vector<int64_t> offsets =
        options.offsets_of ? options.offsets_of(name, t) : std::vector<int64_t>{};
    const std::vector<int64_t> local = t.sizes().vec();
    bool fits = info.shape.size() == local.size();
    if (fits && offsets.empty()) fits = info.shape == local;
    if (fits && !offsets.empty()) {
      fits = offsets.size() == local.size();
      for (size_t d = 0; fits && d < local.size(); ++d)
        fits = offsets[d] >= 0 && offsets[d] + local[d] <= info.shape[d];
    }
    if (!fits) {
      report.mismatched.push_back(ShapeMismatch{name, info.shape, local});
      continue;
    }
    targets.push_back(LoadTarget{options.prefix + name, t, std::move(offsets)});
    report.loaded.push_back(name);
  }
  for (const auto& n : saved) {
    if (!model.count(n) && !is_aux_tensor(n)) report.unexpected.push_back(n);
  }
  finish(report, options, reader.dir());
  ReadOptions ro;
  ro.verify = options.verify;
  ro.allow_cast = true;
  reader.load(targets, ro);
  return report;
}

WeightsReport load_weights(torch::nn::Module& module, const std::string& path,
                           const WeightsOptions& options) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) {
    CheckpointReader reader(path);
    return load_weights(reader, module, options);
  }
  h5::quiet_errors();
  h5::Id file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT));
  if (!file.valid())
    h5::fail<CheckpointError>(fmt::format("cannot open weights file '{}' (not HDF5?)", path));
  std::vector<std::string> names;
  if (H5Ovisit(file, H5_INDEX_NAME, H5_ITER_INC, collect_dataset, &names) < 0) {
    h5::fail<CheckpointError>(fmt::format("cannot list the datasets of weights file '{}'", path));
  }
  WeightsReport report;
  const auto model = module_tensors(module);
  const std::set<std::string> saved(names.begin(), names.end());
  std::vector<std::string> load;
  for (const auto& [name, t] : model) {
    if (!saved.count(name)) {
      report.missing.push_back(name);
      continue;
    }
    h5::Id d(H5Dopen2(file, name.c_str(), H5P_DEFAULT));
    if (!d.valid())
      h5::fail<CheckpointError>(fmt::format("weights file '{}': cannot open '{}'", path, name));
    const std::vector<int64_t> dims =
        h5::dataset_dims(d, fmt::format("weights file '{}', tensor '{}'", path, name));
    if (dims != t.sizes().vec()) {
      report.mismatched.push_back(ShapeMismatch{name, dims, t.sizes().vec()});
      continue;
    }
    load.push_back(name);
    report.loaded.push_back(name);
  }
  for (const auto& n : saved) {
    if (!model.count(n) && !is_aux_tensor(n)) report.unexpected.push_back(n);
  }
  finish(report, options, path);
  at::NoGradGuard no_grad;
  for (const std::string& name : load) {
    const at::Tensor host = tensor_io::read_dataset(
        file, name, fmt::format("weights file '{}', tensor '{}'", path, name));
    model.at(name).copy_(host);
  }
  return report;
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
  const fs::path out(out_file);
  std::error_code ec;
  if (!out.parent_path().empty()) {
    fs::create_directories(out.parent_path(), ec);
    if (ec)
      throw_error<IoError>("cannot create '{}': {}", out.parent_path().string(), ec.message());
  }
  const std::string tmp = out_file + ".tmp-" + files::random_hex(4);
  h5::quiet_errors();
  try {
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
      tensor_io::write_dataset(file, flat, t, 64 << 20, staging,
                               fmt::format("writing tensor '{}' to weights file '{}'", flat, tmp));
    }
    if (H5Fclose(file.release()) < 0)
      h5::fail<IoError>(fmt::format("cannot write weights file '{}'", tmp));
    files::fsync_path(tmp, false);
    if (std::rename(tmp.c_str(), out_file.c_str()) != 0) {
      throw_error<IoError>("cannot rename '{}' to '{}': {}", tmp, out_file, std::strerror(errno));
    }
    files::fsync_path(out.parent_path().empty() ? "." : out.parent_path().string(), true);
  } catch (...) {
    fs::remove(tmp, ec);
    throw;
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
