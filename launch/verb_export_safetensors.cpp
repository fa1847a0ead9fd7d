// `parallax export --format safetensors`: a run's model as one .safetensors file, with Parallax's
// names, or its backbone with timm's / torchvision's (--convention), for PyTorch code to load
// (docs/pretrained.md "Weights out").
#include "launch/verb_export_safetensors.h"

#include "checkpoint/finite.h"
#include "checkpoint/format.h"
#include "checkpoint/pretrained.h"
#include "checkpoint/reader.h"
#include "checkpoint/tensor_source.h"
#include "checkpoint/weights.h"
#include "core/error.h"
#include "core/files.h"
#include "core/log.h"
#include "train/extension.h"
#include "train/run.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cstdio>
#include <filesystem>

namespace fs = std::filesystem;

namespace parallax::launch {

namespace {

// Where a config's model keeps its image backbone and what kind it is (models' backbone_site(),
// known here from the config alone: the model is not built).
std::pair<std::string, std::string> backbone_of(const train::RunConfig& cfg) {
  const models::ModelConfig& m = cfg.model;
  if (m.name == "vit_cls") return {"vit.", "vit"};
  PARALLAX_CHECK(m.name == "bev", ConfigError,
                 "export: --convention needs a model with an image backbone; model '{}' has none",
                 m.name);
  if (m.backbone.rfind("resnet", 0) == 0) return {"encoder.resnet.", "resnet"};
  if (m.backbone == "conv") return {"encoder.conv.", "conv"};
  return {"encoder.vit.", "vit"};
}

// The model tensors of the checkpoint (an extension's run: its model as the extension restores
// it, e.g. LoRA's adapters merged), training-only ones left out.
std::vector<std::pair<std::string, at::Tensor>> model_tensors(
    const std::string& source, const std::optional<train::RunConfig>& cfg) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  checkpoint::CheckpointReader reader(source);
  if (cfg && train::active_extension(*cfg)) {
    train::RunOptions options;
    options.weights = reader.dir();
    const auto restored = train::build_run(*cfg, train::Purpose::kExport, options);
    for (const auto& it : restored->model->named_parameters())
      out.emplace_back(it.key(), it.value().detach());
    for (const auto& it : restored->model->named_buffers())
      out.emplace_back(it.key(), it.value().detach());
  } else {
    const std::string prefix = checkpoint::kModelPrefix;
    for (const std::string& n : reader.names(prefix))
      out.emplace_back(n.substr(prefix.size()), reader.read(n));
  }
  std::erase_if(out, [](const auto& p) { return checkpoint::is_aux_tensor(p.first); });
  return out;
}

}  // namespace

int export_safetensors(const std::string& run, const std::string& checkpoint_arg,
                       const std::string& out_arg, const std::string& dtype,
                       const std::string& convention, bool force,
                       const std::optional<train::RunConfig>& cfg) {
  PARALLAX_CHECK(dtype == "fp32" || dtype == "bf16", UsageError,
                 "export: --format safetensors takes --dtype fp32 or bf16, got '{}'", dtype);
  PARALLAX_CHECK(convention.empty() || convention == "parallax" || convention == "timm" ||
                     convention == "torchvision",
                 UsageError, "export: --convention takes parallax|timm|torchvision, got '{}'",
                 convention);
  const bool renamed = !convention.empty() && convention != "parallax";
  PARALLAX_CHECK(!run.empty() || (!checkpoint_arg.empty() && !out_arg.empty() && !renamed),
                 UsageError,
                 "export: --run DIR is required (or both --checkpoint and --out, without "
                 "--convention, which needs the run's config.yaml)");
  PARALLAX_CHECK(!renamed || cfg.has_value(), UsageError,
                 "export: --convention {} needs the run's config.yaml (which backbone), and '{}' "
                 "has none",
                 convention, run);
  const std::string source =
      !checkpoint_arg.empty() ? checkpoint_arg : (fs::path(run) / "checkpoints").string();
  const std::string out =
      !out_arg.empty()
          ? out_arg
          : (fs::path(run) / "export" /
             (renamed ? "backbone." + convention + ".safetensors" : "model.safetensors"))
                .string();
  core::check_output_file(!out_arg.empty() ? "export: --out" : "export: the safetensors file", out,
                          core::OutputRule::kFile, "it is written to a temporary file and renamed");
  std::vector<std::pair<std::string, at::Tensor>> tensors = model_tensors(source, cfg);
  std::map<std::string, std::string> meta = {
      {"format", "pt"},
      {"parallax.source", checkpoint::resolve_checkpoint(source)},
      {"parallax.convention", renamed ? convention : "parallax"}};
  if (renamed) {
    const auto [root, kind] = backbone_of(*cfg);
    tensors = checkpoint::to_convention(tensors, convention, root, kind);
    meta["parallax.backbone"] = cfg->model.backbone;
  }
  const at::ScalarType type = dtype == "bf16" ? at::kBFloat16 : at::kFloat;
  for (auto& [name, t] : tensors) {
    if (at::isFloatingType(t.scalar_type())) t = t.to(at::kCPU, type);
    if (!at::isFloatingType(t.scalar_type()) || at::isfinite(t).all().item<bool>()) continue;
    PARALLAX_CHECK(force, CheckpointError,
                   "export: tensor '{}' of '{}' holds NaN or infinite values; nothing was written "
                   "(--force exports it anyway)",
                   name, source);
    core::log::warn("export: tensor '{}' holds NaN or infinite values (--force)", name);
  }
  fs::create_directories(fs::path(out).parent_path().empty() ? fs::path(".")
                                                             : fs::path(out).parent_path());
  const int64_t bytes = checkpoint::write_safetensors(out, tensors, meta);
  std::printf("exported %zu tensors (%s, %s names, %.1f MB) from %s to %s\n", tensors.size(),
              dtype.c_str(), renamed ? convention.c_str() : "parallax",
              static_cast<double>(bytes) / 1e6, checkpoint::resolve_checkpoint(source).c_str(),
              out.c_str());
  return 0;
}

}  // namespace parallax::launch
