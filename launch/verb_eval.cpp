// `parallax eval`: a checkpoint's metrics on a dataset split (train/evaluate.h, docs/data.md), on
// any number of ranks (alone, or under mpirun / srun / torchrun; the data-parallel group is the
// world), and optionally its detections and the ground truth in the nuScenes detection submission
// format, for external scorers (tools/nuscenes_score.py).
#include "checkpoint/format.h"
#include "checkpoint/weights.h"
#include "comm/world.h"
#include "core/error.h"
#include "core/files.h"
#include "core/strings.h"
#include "data/schema.h"
#include "data/shard.h"
#include "launch/args.h"
#include "launch/bootstrap.h"
#include "launch/exit_codes.h"
#include "launch/submission.h"
#include "launch/verbs.h"
#include "train/evaluate.h"
#include "train/preemption.h"
#include "train/run.h"
#include "train/run_config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <thread>
#include <tuple>

namespace fs = std::filesystem;

namespace parallax::launch {
namespace {

// A JSON number; NaN and infinities (e.g. the IoU of a class that never occurs) become null.
std::string json_number(double v) {
  return std::isfinite(v) ? fmt::format("{}", v) : "null";
}

// The predictions and the ground truth of `det` as submission JSON (submission_json).
std::pair<std::string, std::string> submissions(const train::EvalDetections& det,
                                                const std::string& source, const std::string& split,
                                                const std::vector<std::string>& classes,
                                                const data::DatasetInfo& info) {
  std::vector<std::string> quoted;
  for (const auto& c : classes) quoted.push_back(core::json_quote(c));
  const std::string meta = fmt::format(
      "{{\"use_camera\": true, \"use_lidar\": false, \"use_radar\": false, \"use_map\": false, "
      "\"use_external\": false, \"parallax_checkpoint\": {}, \"parallax_split\": {}, "
      "\"classes\": [{}]}}",
      core::json_quote(source), core::json_quote(split), core::join(quoted, ", "));
  // Each scene's sample token where the dataset holds one (a converted nuScenes dataset), else
  // its index in the split.
  const std::vector<data::SampleMeta> samples = data::split_sample_meta(info, split);
  return {submission_json(det.pred, true, samples, classes, meta),
          submission_json(det.gt, false, samples, classes, meta)};
}

fs::path with_suffix(const fs::path& file, const std::string& suffix) {
  return file.parent_path() / (file.stem().string() + suffix + file.extension().string());
}

// The files eval writes (core/files.h; docs/training.md, "Evaluating a checkpoint"), metrics
// first, then the predictions and the ground truth; checked before any work. --out may be a
// character device or a FIFO, written through (`--out /dev/stdout`). --dump-predictions must be a
// regular file (or new): the ground truth, and without --out the metrics, are named from its path
// and written beside it, and they must be regular files (or new) too. Without `split` (not known
// yet) the default metrics file is left out.
std::vector<core::OutputFile> eval_outputs(const Args& args, const std::string* split) {
  using core::OutputRule;
  const std::string beside = "it is named from --dump-predictions and written beside it";
  std::vector<core::OutputFile> files;
  if (args.has("out")) {
    files.push_back({"eval: --out", args.get("out"), "", OutputRule::kStream, ""});
  }
  if (args.has("dump-predictions")) {
    const std::string pred = args.get("dump-predictions");
    const std::string why =
        "the ground truth (<stem>_gt) and, without --out, the metrics (<stem>_metrics) are named "
        "from its path and written beside it";
    // First on its own: a path refused here names no derived file.
    core::check_output_file("eval: --dump-predictions", pred, OutputRule::kFile, why);
    if (!args.has("out")) {
      files.push_back({"eval: the metrics file (from --dump-predictions)",
                       with_suffix(pred, "_metrics").string(), "", OutputRule::kFile, beside});
    }
    files.push_back({"eval: --dump-predictions", pred, "", OutputRule::kFile, why});
    files.push_back({"eval: the ground truth file (from --dump-predictions)",
                     with_suffix(pred, "_gt").string(), "", OutputRule::kFile, beside});
  } else if (!args.has("out") && split) {
    files.push_back({"eval: the metrics file (default, from the split)",
                     fmt::format("eval_{}.json", *split), "", OutputRule::kFile,
                     "its name is eval's default; give --out"});
  }
  for (const auto& f : files) core::check_output_file(f.what, f.path, f.rule, f.why_file);
  // No two outputs in one file ('a.json' and './a.json' alike).
  auto real = [](const std::string& p) {
    std::error_code ec;
    return fs::weakly_canonical(fs::absolute(p, ec), ec);
  };
  for (size_t i = 0; i < files.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      PARALLAX_CHECK(real(files[i].path) != real(files[j].path), UsageError,
                     "{} '{}' is the same file as {} '{}'; give another path", files[i].what,
                     files[i].path, files[j].what, files[j].path);
    }
  }
  return files;
}

}  // namespace

int verb_eval(const std::vector<std::string>& argv) {
  Args args(
      "eval",
      "Evaluate a checkpoint on a dataset split: BEV IoU per class, nuScenes-style detection "
      "mAP, the true-positive errors ATE, ASE, AOE, AVE, AAE and the nuScenes detection score NDS "
      "(docs/data.md). "
      "Works alone or under mpirun, srun or torchrun, on any number of ranks.");
  args.option("config", "FILE", "YAML config of the run (its model and data sections)")
      .option("checkpoint", "PATH",
              "a checkpoint directory, a run's checkpoints/ or checkpoints/latest (its latest), a "
              "run directory, or an exported weights.h5")
      .option("split", "NAME", "dataset split to evaluate (default: data.val_split, val)")
      .option("dump-predictions", "FILE",
              "write the detections as nuScenes submission JSON to FILE and the ground truth to "
              "FILE with _gt before the extension")
      .option("out", "FILE",
              "metrics JSON (default: beside --dump-predictions as <stem>_metrics.json, else "
              "eval_<split>.json in the working directory)")
      .overrides("config overrides, Hydra style: data.batch_size=4 train.device=cpu")
      .epilog(
          "examples:\n"
          "  parallax eval --config configs/bev_tiny.yaml --checkpoint runs/bev_tiny/checkpoints\n"
          "  mpirun -np 2 parallax eval --config runs/bev_tiny/config.yaml --checkpoint "
          "runs/bev_tiny \\\n"
          "      --dump-predictions preds.json   # also preds_gt.json and preds_metrics.json\n"
          "  python3 tools/nuscenes_score.py preds.json preds_gt.json");
  args.parse(argv);
  if (args.help_requested()) {
    std::fputs(args.help_text().c_str(), stdout);
    return 0;
  }
  PARALLAX_CHECK(args.has("config"), UsageError,
                 "eval: --config FILE is required; see 'parallax eval --help'");
  PARALLAX_CHECK(args.has("checkpoint"), UsageError,
                 "eval: --checkpoint PATH is required; see 'parallax eval --help'");
  eval_outputs(args, nullptr);  // the paths given, before any work (core/files.h)
  train::RunConfig cfg = train::load_run_config(args.get("config"), args.override_args());
  PARALLAX_CHECK(cfg.model.name == "bev" && !cfg.data.synthetic, UsageError,
                 "eval: needs a bev model trained on a dataset (config '{}' has model.name={}, "
                 "data.synthetic={})",
                 args.get("config"), cfg.model.name, cfg.data.synthetic);
  const std::string split = args.has("split") ? args.get("split") : cfg.data.val_split;
  const data::DatasetInfo info = data::read_dataset_info(cfg.data.path);
  if (!info.splits.count(split)) {
    std::vector<std::string> names;
    for (const auto& [name, _] : info.splits) names.push_back(name);
    throw_error<UsageError>("eval: split '{}' is not in dataset '{}' (data.path); its splits: {}",
                            split, cfg.data.path, core::join(names, ", "));
  }
  cfg.data.val_split = split;
  std::vector<core::OutputFile> outputs = eval_outputs(args, &split);
  const std::string ckpt = args.get("checkpoint");
  std::error_code ec;
  PARALLAX_CHECK(fs::exists(ckpt, ec), CheckpointError,
                 "eval: checkpoint '{}' does not exist (--checkpoint)", ckpt);
  const std::string source =
      checkpoint::is_weights_file(ckpt) ? ckpt : checkpoint::resolve_checkpoint(ckpt);

  // The process's World for the evaluation's lifetime (launch/bootstrap.h); the run (the device,
  // the world communicator as the data-parallel group, the precision policy and the model with
  // the checkpoint's weights) is assembled as the trainer's is (train/run.h).
  // The first SIGTERM / SIGINT stops the evaluation before its next batch on every rank (exit 143,
  // nothing written); a second one exits at once (train/preemption.h). Installed before the
  // rendezvous, as `parallax train` does.
  train::PreemptionSignals signals("stopping the evaluation (no metrics are written; exit 143)");
  const std::unique_ptr<comm::World> world = bootstrap_world(cfg);
  train::RunOptions options;
  options.weights = source;
  const std::unique_ptr<train::Run> run = train::build_run(cfg, train::Purpose::kEval, options);
  const core::SceneSpec& scene = run->scene;
  train::EvalDetections det;
  std::map<std::string, double> metrics;
  try {
    metrics =
        train::evaluate(*run->model, cfg.data, scene, static_cast<uint64_t>(cfg.experiment.seed),
                        *run->world_comm, run->device, run->precision, &det);
  } catch (const train::PreemptedError& e) {
    std::fprintf(stderr, "parallax: %s\n", e.what());
    return kExitPreempted;
  }
  const std::string& loaded = run->loaded;
  const int rank = world->rank();
  run->world_comm->barrier();
  if (rank != 0) return 0;

  std::printf("eval of %s on split '%s' of %s (%d rank(s), %s)\n", source.c_str(), split.c_str(),
              cfg.data.path.c_str(), world->size(), loaded.c_str());
  std::string json = fmt::format(
      "{{\"checkpoint\": {}, \"split\": {}, \"dataset\": {}, \"ranks\": {}, \"metrics\": {{",
      core::json_quote(source), core::json_quote(split), core::json_quote(cfg.data.path),
      world->size());
  bool first = true;
  for (const auto& [name, value] : metrics) {
    if (name == "eval_s") continue;  // timing, not a metric
    std::printf("%-20s %.6f\n", name.c_str(), value);
    json +=
        fmt::format("{}\n  {}: {}", first ? "" : ",", core::json_quote(name), json_number(value));
    first = false;
  }
  json += "}}\n";
  // Every file or none (core/files.h): a failed write leaves no metrics without predictions.
  outputs[0].text = json;
  if (args.has("dump-predictions")) {
    std::tie(outputs[1].text, outputs[2].text) =
        submissions(det, source, split, scene.box_classes, info);
  }
  core::write_outputs(outputs);
  std::printf("metrics: %s\n", outputs[0].path.c_str());
  if (outputs.size() == 3) {
    std::printf("predictions: %s\nground truth: %s\n", outputs[1].path.c_str(),
                outputs[2].path.c_str());
  }
  return 0;
}

}  // namespace parallax::launch
