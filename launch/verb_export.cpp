// `parallax export`: consolidated weights (weights.h5) from a run's checkpoint. ONNX export is a
// later issue and is rejected with a clear error.
#include "checkpoint/format.h"
#include "checkpoint/weights.h"
#include "core/error.h"
#include "launch/args.h"
#include "launch/verbs.h"

#include <cstdio>
#include <filesystem>

namespace fs = std::filesystem;

namespace parallax::launch {

int verb_export(const std::vector<std::string>& argv) {
  Args args("export", "Export a trained model from a run's checkpoint.");
  args.option("run", "DIR", "run directory (runs/<name>); its checkpoints/latest is exported")
      .option("format", "FORMAT", "weights (consolidated HDF5) | onnx (not available yet)",
              "weights")
      .option("dtype", "DTYPE", "dtype of floating tensors in weights.h5: fp32 | bf16", "fp32")
      .option("checkpoint", "DIR", "export this checkpoint instead of the run's latest")
      .option("out", "FILE", "output file (default: <run>/export/weights.h5)")
      .flag("force", "export even when tensors hold NaN or infinite values (warns for each)")
      .epilog(
          "weights.h5 holds one dataset per parameter and buffer, named by its flat module path\n"
          "(e.g. 'backbone.blocks.0.attn.qkv.weight'), fp32 or bf16 (bf16 as uint16 bits, "
          "attribute\n"
          "dtype=bfloat16); see docs/checkpoints.md.\n\n"
          "examples:\n"
          "  parallax export --run runs/bev_tiny --format weights\n"
          "  parallax export --run runs/bev_tiny --format weights --dtype bf16\n"
          "  parallax export --run runs/bev_tiny --checkpoint "
          "runs/bev_tiny/checkpoints/step_00001000");
  args.parse(argv);
  if (args.help_requested()) {
    std::fputs(args.help_text().c_str(), stdout);
    return 0;
  }
  const std::string format = args.get("format");
  if (format == "onnx") {
    throw_error<UsageError>(
        "export: --format onnx is not available yet (ONNX export is a later issue); use "
        "--format weights");
  }
  if (format != "weights") {
    throw_error<UsageError>(
        "export: unknown --format '{}'; expected weights (or onnx, not available yet)", format);
  }
  const std::string dtype = args.get("dtype");
  if (dtype != "fp32" && dtype != "bf16") {
    throw_error<UsageError>("export: unknown --dtype '{}'; expected fp32 or bf16", dtype);
  }
  if (!args.has("run") && !(args.has("checkpoint") && args.has("out"))) {
    throw_error<UsageError>("export: --run DIR is required (or both --checkpoint and --out)");
  }
  const std::string run = args.has("run") ? args.get("run") : "";
  if (!run.empty()) {
    std::error_code ec;
    PARALLAX_CHECK(fs::is_directory(run, ec), UsageError,
                   "export: run directory '{}' does not exist", run);
  }
  const std::string source =
      args.has("checkpoint") ? args.get("checkpoint") : (fs::path(run) / "checkpoints").string();
  const std::string out =
      args.has("out") ? args.get("out") : (fs::path(run) / "export" / "weights.h5").string();
  const int64_t n =
      checkpoint::export_weights(source, out, dtype == "bf16" ? at::kBFloat16 : at::kFloat,
                                 /*allow_nonfinite=*/args.flag_set("force"));
  std::printf("exported %lld tensors (%s) from %s to %s\n", static_cast<long long>(n),
              dtype.c_str(), checkpoint::resolve_checkpoint(source).c_str(), out.c_str());
  return 0;
}

}  // namespace parallax::launch
