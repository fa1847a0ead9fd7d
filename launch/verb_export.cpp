// `parallax export`: a run's checkpoint as an ONNX model gated against ONNX Runtime (model.onnx,
// parity.json; docs/export.md) or as consolidated weights (weights.h5; docs/checkpoints.md). The
// `export` section of the run's config.yaml supplies the defaults; options given here override it.
#include "checkpoint/checkpoint_config.h"
#include "checkpoint/format.h"
#include "checkpoint/reader.h"
#include "checkpoint/weights.h"
#include "core/error.h"
#include "core/files.h"
#include "core/rng.h"
#include "data/datagen.h"
#include "data/dataset.h"
#include "data/loader.h"
#include "launch/args.h"
#include "launch/exit_codes.h"
#include "launch/verb_export_safetensors.h"
#include "launch/verbs.h"
#include "models/model.h"
#include "models/perception_model.h"
#include "train/extension.h"
#include "train/preemption.h"
#include "train/qat/qat.h"
#include "train/run.h"
#include "train/run_config.h"

#ifdef PARALLAX_WITH_ONNX
#include "checkpoint/export/onnx_export.h"
#endif

#include <csignal>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>

namespace fs = std::filesystem;

namespace parallax::launch {

namespace {

// The export settings: the run config's `export` section, then the command line.
struct Settings {
  checkpoint::ExportConfig cfg;
  std::string origin(const Args& args, const char* option) const {
    return args.has(option) ? fmt::format("--{}", option) : fmt::format("export.{}", option);
  }
};

Settings resolve_settings(const Args& args, const std::optional<train::RunConfig>& run_cfg) {
  Settings s;
  if (run_cfg) s.cfg = run_cfg->export_;
  if (args.has("format")) s.cfg.format = args.get("format");
  if (args.has("dtype")) s.cfg.dtype = args.get("dtype");
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  if (args.has("opset")) s.cfg.opset = static_cast<int>(args.get_int("opset", 1, kIntMax));
  // The frames stream through LibTorch and ONNX Runtime one at a time (memory stays bounded);
  // parity.h5 keeps them all, which the exporter checks against the free disk space.
  if (args.has("parity-frames"))
    s.cfg.parity_frames = static_cast<int>(args.get_int("parity-frames", 0, kIntMax));
  if (args.has("batch"))
    s.cfg.batch = args.get("batch") == "dynamic" ? 0 : args.get_int("batch", 0, kIntMax);
  if (args.has("external-data")) s.cfg.external_data = args.get("external-data");
  PARALLAX_CHECK(
      s.cfg.format == "weights" || s.cfg.format == "onnx" || s.cfg.format == "safetensors",
      UsageError, "export: unknown format '{}' ({}); expected onnx, weights or safetensors",
      s.cfg.format, s.origin(args, "format"));
  PARALLAX_CHECK(s.cfg.parity_frames >= 0 && s.cfg.batch >= 0, UsageError,
                 "export: --parity-frames {} and --batch {} must not be negative",
                 s.cfg.parity_frames, s.cfg.batch);
  return s;
}

// runs/<name>/config.yaml, when the run has one (the resolved config the trainer wrote).
std::optional<train::RunConfig> load_run_config(const std::string& run) {
  if (run.empty()) return std::nullopt;
  const fs::path file = fs::path(run) / "config.yaml";
  std::error_code ec;
  if (!fs::is_regular_file(file, ec)) return std::nullopt;
  return train::load_run_config(file.string(), {});
}

// ---- weights.h5 --------------------------------------------------------------------------------

int export_weights(const Args& args, const Settings& s, const std::string& run,
                   const std::optional<train::RunConfig>& cfg) {
  const std::string dtype = s.cfg.dtype;
  if (dtype != "fp32" && dtype != "bf16") {
    throw_error<UsageError>("export: --format weights takes --dtype fp32 or bf16, got '{}' ({})",
                            dtype, s.origin(args, "dtype"));
  }
  if (run.empty() && !(args.has("checkpoint") && args.has("out"))) {
    throw_error<UsageError>("export: --run DIR is required (or both --checkpoint and --out)");
  }
  const std::string source =
      args.has("checkpoint") ? args.get("checkpoint") : (fs::path(run) / "checkpoints").string();
  const std::string out =
      args.has("out") ? args.get("out") : (fs::path(run) / "export" / "weights.h5").string();
  // Before any work (core/files.h): weights.h5 is a regular file or new, never a device node.
  core::check_output_file(args.has("out") ? "export: --out" : "export: the weights file", out,
                          core::OutputRule::kFile,
                          "an HDF5 file is written at random offsets and renamed into place");
  const at::ScalarType type = dtype == "bf16" ? at::kBFloat16 : at::kFloat;
  int64_t n = 0;
  if (cfg && train::active_extension(*cfg) && !checkpoint::is_weights_file(source)) {
    // A run of an extension (train/extension.h): its model as the extension restores it (a LoRA
    // run's checkpoints hold its adapters: the base with the adapters merged in).
    checkpoint::CheckpointReader reader(source);
    train::RunOptions options;
    options.weights = reader.dir();
    const auto restored = train::build_run(*cfg, train::Purpose::kExport, options);
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const auto& it : restored->model->named_parameters())
      tensors.emplace_back(it.key(), it.value());
    for (const auto& it : restored->model->named_buffers())
      tensors.emplace_back(it.key(), it.value());
    n = checkpoint::export_weights(reader.dir(), out, type, args.flag_set("force"), tensors);
  } else {
    n = checkpoint::export_weights(source, out, type, /*allow_nonfinite=*/args.flag_set("force"));
  }
  std::printf("exported %lld tensors (%s) from %s to %s\n", static_cast<long long>(n),
              dtype.c_str(), checkpoint::resolve_checkpoint(source).c_str(), out.c_str());
  return 0;
}

// ---- model.onnx --------------------------------------------------------------------------------

#ifdef PARALLAX_WITH_ONNX

// The parity frames, batch 1 each, made one at a time as the exporter asks for them (memory holds
// one frame whatever their number), and where they came from: the val split of the run's dataset
// (its first scenes, repeated when it has fewer than `count`), else synthetic scenes rendered by
// the data generator for the model's scene (bev), else the model's own example inputs.
checkpoint::exporter::ParityFrames parity_frames(models::Model& model, const train::RunConfig& cfg,
                                                 const core::SceneSpec& scene, int64_t count,
                                                 std::string& source) {
  checkpoint::exporter::ParityFrames frames;
  frames.count = count;
  if (count == 0) return frames;
  auto scene_frame = [](const data::SceneRecord& r) -> core::TensorDict {
    return {{"images", r.images.unsqueeze(0)},
            {"intrinsics", r.intrinsics.unsqueeze(0)},
            {"cam_to_ego", r.cam_to_ego.unsqueeze(0)}};
  };
  const bool dataset = !(cfg.data.synthetic || cfg.train.benchmark) && cfg.model.name == "bev";
  if (dataset && data::read_dataset_info(cfg.data.path).splits.count(cfg.data.val_split)) {
    std::shared_ptr<data::Dataset> ds = data::Dataset::open(cfg.data.path, cfg.data.val_split);
    PARALLAX_CHECK(ds->size() > 0, DataError, "export: the val split '{}' of '{}' has no scenes",
                   cfg.data.val_split, cfg.data.path);
    // As evaluation reads them: data.cameras and data.image_size applied.
    data::LoaderOptions lo = data::LoaderOptions::from_config(cfg.data, 0, 0, 1, false);
    lo.num_workers = 0;
    lo.batch_size = 1;
    auto loader = std::make_shared<data::DataLoader>(ds, lo);
    frames.frame = [ds, loader, scene_frame](int64_t i) {
      return scene_frame(loader->read_scene(i % ds->size()));
    };
    source = fmt::format("val split '{}' of dataset '{}' (scenes 0..{})", cfg.data.val_split,
                         cfg.data.path, std::min<int64_t>(count, ds->size()) - 1);
    return frames;
  }
  const uint64_t seed = static_cast<uint64_t>(cfg.experiment.seed);
  if (cfg.model.name == "bev") {
    data::GeneratorOptions g;
    g.cameras = static_cast<int>(scene.num_cameras);
    g.height = static_cast<int>(scene.image_height);
    g.width = static_cast<int>(scene.image_width);
    g.bev = {scene.x_min, scene.x_max, scene.y_min, scene.y_max, scene.bev_resolution};
    const uint64_t split = data::split_seed(seed, "export-parity");
    frames.frame = [g, split, scene_frame](int64_t i) {
      return scene_frame(data::generate_scene(g, split, i).record);
    };
    source =
        fmt::format("synthetic scenes 0..{} of the data generator (seed {}, split 'export-parity')",
                    count - 1, seed);
    return frames;
  }
  // Drawn in order from the global generator, seeded here (the eval-mode forward between two
  // frames draws nothing).
  core::seed_all(seed);
  frames.frame = [&model](int64_t) { return model.example_batch(1); };
  source = fmt::format("example inputs of model '{}' (seed {})", cfg.model.name, seed);
  return frames;
}

// A QAT model's rounding ties for its parity gate (checkpoint::exporter::QuantTies): every
// activation quantizer is observed during the reference forward, and the calls of each are matched,
// in order, with the QuantizeLinear nodes the export hooks wrote for it.
class QatTies : public checkpoint::exporter::QuantTies {
 public:
  QatTies(const models::onnx::EmitHooks& hooks, const std::vector<train::qat::Layer>& layers)
      : hooks_(hooks) {
    for (const auto& l : layers) {
      models::TensorQuantizerImpl* q = l.input.get();
      observed_.push_back(l.input);
      calls_[q];
      q->set_observer([this, q](const at::Tensor& quotient) {
        auto [index, level] =
            checkpoint::exporter::rounding_ties(quotient, checkpoint::exporter::kQuantTieMargin);
        calls_[q].push_back({index, level, quotient.sizes().vec()});
      });
    }
  }
  ~QatTies() override {
    for (const auto& q : observed_) q->set_observer(nullptr);
  }
  QatTies(const QatTies&) = delete;
  QatTies& operator=(const QatTies&) = delete;

  std::vector<std::string> tensors() override {
    nodes_ = train::qat::activation_qdq(hooks_);
    std::vector<std::string> out;
    for (const auto& n : nodes_) out.insert(out.end(), n.outputs.begin(), n.outputs.end());
    return out;
  }
  void begin_frame() override {
    for (auto& [q, c] : calls_) c.clear();
  }
  std::map<std::string, Frame> end_frame() override {
    std::map<std::string, Frame> out;
    for (const auto& n : nodes_) {
      const std::vector<Frame>& c = calls_[n.quantizer.get()];
      PARALLAX_CHECK(c.size() == n.outputs.size(), Error,
                     "QAT export: the activation quantizer of layer '{}' ran {} time(s) in the "
                     "parity reference's forward, and the graph has {} QuantizeLinear node(s) for "
                     "it",
                     n.layer, c.size(), n.outputs.size());
      for (std::size_t i = 0; i < c.size(); ++i) out[n.outputs[i]] = c[i];
    }
    return out;
  }

 private:
  const models::onnx::EmitHooks& hooks_;
  std::vector<std::shared_ptr<models::TensorQuantizerImpl>> observed_;
  std::map<const models::TensorQuantizerImpl*, std::vector<Frame>> calls_;
  std::vector<train::qat::ActivationQdq> nodes_;
};

int export_onnx(const Args& args, const Settings& s, const std::string& run,
                const std::optional<train::RunConfig>& cfg) {
  PARALLAX_CHECK(!run.empty(), UsageError,
                 "export: --format onnx needs --run DIR (its config.yaml defines the model)");
  PARALLAX_CHECK(
      cfg.has_value(), UsageError,
      "export: --format onnx needs the run's config.yaml to build the model, and '{}' has none",
      run);
  checkpoint::exporter::OnnxExportOptions o;
  o.opset = s.cfg.opset;
  PARALLAX_CHECK(s.cfg.dtype == "fp32" || s.cfg.dtype == "fp16", UsageError,
                 "export: --format onnx takes --dtype fp32 or fp16, got '{}' ({})", s.cfg.dtype,
                 s.origin(args, "dtype"));
  o.dtype = s.cfg.dtype == "fp16" ? at::kHalf : at::kFloat;
  o.batch = s.cfg.batch;
  o.external_data = s.cfg.external_data;
  o.parity_timeout_s = s.cfg.parity_timeout_s;
  o.allow_non_finite = args.flag_set("force");
  try {
    checkpoint::exporter::validate(o);
  } catch (UsageError& e) {
    e.add_context(fmt::format("opset from {}", s.origin(args, "opset")));
    throw;
  }
  // The cheap checks first: the output path, a checkpoint to export, ONNX Runtime for the gate, a
  // folder to write. model.onnx is a regular file or new, never a device node, FIFO or folder: its
  // siblings (model.onnx.data, parity.h5, parity.json, the staging folder) are written beside it.
  const std::string out =
      args.has("out") ? args.get("out") : (fs::path(run) / "export" / "model.onnx").string();
  core::check_output_file(args.has("out") ? "export: --out" : "export: the model file", out,
                          core::OutputRule::kFile,
                          "the export writes model.onnx.data, parity.h5, parity.json and its "
                          "staging folder beside it");
  const std::string source =
      args.has("checkpoint") ? args.get("checkpoint") : (fs::path(run) / "checkpoints").string();
  std::unique_ptr<checkpoint::CheckpointReader> opened;
  try {
    opened = std::make_unique<checkpoint::CheckpointReader>(source);
  } catch (CheckpointError& e) {
    if (!args.has("checkpoint"))
      e.add_context(fmt::format("run '{}' has no checkpoint to export", run));
    throw;
  }
  checkpoint::CheckpointReader& reader = *opened;
  if (s.cfg.parity_frames > 0) checkpoint::exporter::check_parity_runtime(o);
  checkpoint::exporter::prepare_output_dir(out);

  // The model as the run's assembly restores it for export (train/run.h): a LoRA run's base with
  // its adapters merged in (no adapter nodes in the graph); a QAT run's model fake-quantized with
  // the checkpoint's amax, exported with QuantizeLinear / DequantizeLinear pairs on the inputs
  // and weights of its Linear and Conv layers.
  train::RunOptions options;
  options.weights = reader.dir();
  const std::unique_ptr<train::Run> restored =
      train::build_run(*cfg, train::Purpose::kExport, options);
  const std::shared_ptr<models::Model>& model = restored->model;
  const core::SceneSpec& scene = restored->scene;
  std::unique_ptr<models::onnx::EmitHooks> qdq;
  std::unique_ptr<QatTies> ties;
  const std::vector<train::qat::Layer> quantized = train::qat::layers(*model);
  if (!quantized.empty()) {
    qdq = train::qat::export_hooks(quantized);
    o.hooks = qdq.get();
    ties = std::make_unique<QatTies>(*qdq, quantized);
    o.quant_ties = ties.get();
    o.gate = checkpoint::exporter::qat_parity_gate();
    PARALLAX_CHECK(
        o.dtype == at::kFloat, ConfigError,
        "export: run '{}' is a QAT run: its Q/DQ graph is written in fp32 (QuantizeLinear "
        "of float16 needs opset 19; this exporter writes opset 17); drop --dtype fp16",
        run);
  }
  // A fixed batch takes the frames in whole batches.
  const int64_t b = s.cfg.batch;
  const int64_t count = b > 0 ? (s.cfg.parity_frames + b - 1) / b * b : s.cfg.parity_frames;
  const checkpoint::exporter::ParityFrames frames =
      parity_frames(*model, *cfg, scene, count, o.frames_source);
  // Preemption (train/preemption.h): a SIGTERM or SIGINT stops the export between parity frames or
  // while ONNX Runtime runs; the staging folder is removed and nothing is published.
  o.interruption = [] {
    if (!train::PreemptionSignals::requested()) return;
    throw train::PreemptedError(fmt::format(
        "export stopped by {} before it finished: nothing was written (an earlier model.onnx, "
        "if any, is unchanged)",
        train::PreemptionSignals::signal_number() == SIGINT ? "SIGINT" : "SIGTERM"));
  };

  const auto& m = reader.metadata();
  o.metadata = {{"parallax.model", fmt::format("{} size={} backbone={}", cfg->model.name,
                                               cfg->model.size, cfg->model.backbone)},
                {"parallax.checkpoint", reader.dir()},
                {"parallax.step", std::to_string(m.step)},
                {"parallax.config_hash", m.config_hash}};
  const auto r = checkpoint::exporter::export_onnx(*model, frames, out, o);
  std::printf(
      "exported %s (opset %d, %s, batch %s, %lld initializers, %.1f MB%s) from %s in %.2f s\n",
      r.model_file.c_str(), o.opset, s.cfg.dtype.c_str(),
      b > 0 ? std::to_string(b).c_str() : "dynamic", static_cast<long long>(r.initializers),
      static_cast<double>(r.model_bytes + r.data_bytes) / 1e6,
      r.data_file.empty() ? "" : fmt::format(", weights in {}", r.data_file).c_str(),
      reader.dir().c_str(), r.graph_s);
  if (frames.count > 0) {
    std::printf(
        "parity on %lld frames (%s): %s\nreport: %s (LibTorch %.2f s, ONNX Runtime tool %.2f s)\n",
        static_cast<long long>(frames.count), o.frames_source.c_str(), r.parity_summary.c_str(),
        r.parity_json.c_str(), r.reference_s, r.parity_s);
  } else {
    std::printf("parity gate skipped (--parity-frames 0)\n");
  }
  return 0;
}

#else

int export_onnx(const Args&, const Settings&, const std::string&,
                const std::optional<train::RunConfig>&) {
  throw_error<UsageError>(
      "export: this build has no ONNX support: libonnx + protobuf were not found when it was "
      "configured (install "
      "libonnx-dev libprotobuf-dev, or pass -DONNX_ROOT=<prefix>; scripts/gpu_build.sh unpacks "
      "them from .debs/); "
      "--format weights works");
}

#endif

}  // namespace

int verb_export(const std::vector<std::string>& argv) {
  Args args("export", "Export a trained model from a run's checkpoint.");
  args.option("run", "DIR", "run directory (runs/<name>); its checkpoints/latest is exported")
      .option("format", "FORMAT",
              "onnx (model.onnx + parity gate) | weights (weights.h5) | safetensors "
              "(a .safetensors file) (default: export.format, onnx)")
      .option("dtype", "DTYPE",
              "onnx: fp32 | fp16; weights, safetensors: fp32 | bf16 (default: export.dtype, fp32)")
      .option("convention", "NAMES",
              "safetensors: parallax (every tensor, Parallax's names; the default) | timm | "
              "torchvision (the backbone only, with that library's names)")
      .option("checkpoint", "PATH",
              "export this checkpoint (a step directory, a checkpoints/ directory or its "
              "latest file) instead of the run's latest")
      .option("out", "FILE",
              "output file (default: <run>/export/model.onnx, weights.h5, model.safetensors or "
              "backbone.<convention>.safetensors)")
      .option("opset", "N", "onnx: ONNX opset; 17 is the one written (default: export.opset, 17)")
      .option("parity-frames", "N",
              "onnx: frames compared against ONNX Runtime; 0 skips the gate (default: "
              "export.parity_frames, 8)")
      .option("batch", "B|dynamic",
              "onnx: fixed batch size, or a dynamic batch axis (default: export.batch, dynamic)")
      .option("external-data", "auto|always",
              "onnx: weights in <out>.data: above 2 GB, or always (default: export.external_data, "
              "auto)")
      .flag("force", "export even when tensors hold NaN or infinite values (warns for each)")
      .epilog(
          "Defaults come from the `export` section of the run's config.yaml; options override "
          "them.\n\n"
          "onnx: writes model.onnx (opset 17, no custom ops; inputs images uint8 [B, N, H, W, 3],\n"
          "intrinsics, cam_to_ego for bev), runs the checkpoint in LibTorch and in ONNX Runtime\n"
          "(tools/onnx_parity.py, PARALLAX_PYTHON) on the val split or synthetic scenes, and "
          "writes\n"
          "parity.h5 and parity.json; exits non-zero naming the output and frame when the gate "
          "fails.\n"
          "See docs/export.md.\n\n"
          "weights: weights.h5 holds one dataset per parameter and buffer, named by its flat "
          "module path\n"
          "(e.g. 'encoder.vit.block0.attn.qkv.weight'), fp32 or bf16 (bf16 as uint16 bits, "
          "attribute\n"
          "dtype=bfloat16); see docs/checkpoints.md.\n\n"
          "examples:\n"
          "  parallax export --run runs/bev_tiny\n"
          "  parallax export --run runs/bev_tiny --format onnx --dtype fp16 --batch 1\n"
          "  parallax export --run runs/bev_tiny --format weights --dtype bf16\n"
          "  parallax export --run runs/bev_vitb --format safetensors --convention timm\n"
          "  parallax export --run runs/bev_tiny --format weights --checkpoint "
          "runs/bev_tiny/checkpoints/step_00000400");
  args.parse(argv);
  if (args.help_requested()) {
    std::fputs(args.help_text().c_str(), stdout);
    return 0;
  }
  const std::string run = args.has("run") ? args.get("run") : "";
  if (!run.empty()) {
    std::error_code ec;
    PARALLAX_CHECK(fs::is_directory(run, ec), UsageError,
                   "export: run directory '{}' does not exist", run);
  }
  const std::optional<train::RunConfig> cfg = load_run_config(run);
  const Settings s = resolve_settings(args, cfg);
  if (s.cfg.format == "weights") return export_weights(args, s, run, cfg);
  if (s.cfg.format == "safetensors") {
    return export_safetensors(run, args.has("checkpoint") ? args.get("checkpoint") : "",
                              args.has("out") ? args.get("out") : "", s.cfg.dtype,
                              args.has("convention") ? args.get("convention") : "",
                              args.flag_set("force"), cfg);
  }
  PARALLAX_CHECK(!args.has("convention"), UsageError,
                 "export: --convention applies to --format safetensors");
  // The first SIGTERM / SIGINT stops the export at its next frame (or the parity tool) and exits
  // kExitPreempted with nothing written; a second one exits at once.
  train::PreemptionSignals signals(
      "stopping the export (nothing is written, the staging folder is removed; exit 143)");
  try {
    return export_onnx(args, s, run, cfg);
  } catch (const train::PreemptedError& e) {
    std::fprintf(stderr, "parallax: %s\n", e.what());
    return kExitPreempted;
  }
}

}  // namespace parallax::launch
