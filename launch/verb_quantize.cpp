// `parallax quantize`: the automated mixed-precision sweep of a trained fp32 run (docs/trainers.md,
// "The mixed-precision sweep"), in three child processes of this binary:
//   1. <name>_sweep: a PTQ run of the run's config (train.load_from = the run) with qat.budget,
//      which calibrates, evaluates per unit and greedily leaves the most sensitive units
//      unquantized until INT8 is within the budget (train/qat/qat.h, sweep()): quantize_sweep.json;
//   2. <name>: a PTQ run with qat.skip = the chosen layers, so its config.yaml records them and its
//      checkpoint holds exactly the quantizers kept; its evaluation is the sweep's chosen step's;
//   3. `parallax export --run <name> --format onnx`: the Q/DQ graph of the kept quantizers, gated
//      on ONNX Runtime against the fake-quantized forward (the QAT parity gate).
// One process (CPU or one GPU), like export; the children are this binary, so their errors are the
// usual `parallax: error:` lines.
#include "checkpoint/reader.h"
#include "comm/world.h"
#include "core/error.h"
#include "core/files.h"
#include "core/log.h"
#include "core/strings.h"
#include "core/subprocess.h"
#include "launch/args.h"
#include "launch/exit_codes.h"
#include "launch/verbs.h"
#include "train/preemption.h"
#include "train/run_config.h"

#include <fmt/format.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace parallax::launch {
namespace {

namespace fs = std::filesystem;

using Clock = std::chrono::steady_clock;

// A child stopped (SIGSTOP, SIGTSTP) this long is stopped for good: this binary never stops its
// own children, so somebody did, and a stopped child would hold the sweep forever.
constexpr double kStoppedLimitS = 60;
// After SIGTERM, a child that has not exited in this long gets SIGKILL. The children are training
// and export runs: on SIGTERM they stop before their next batch (the trainer's preemption path).
constexpr double kTermGraceS = 30;

std::string describe(const std::vector<std::string>& args) {
  for (const auto& a : args) {
    if (a.rfind("experiment.name=", 0) == 0) return fmt::format("'{}' ({})", a.substr(16), args[0]);
  }
  return fmt::format("'parallax {}'", args.empty() ? "" : args[0]);
}

// Runs this binary with `args`, waits, and returns its exit status (128 + signal when killed).
// The child dies with this process (PR_SET_PDEATHSIG: SIGTERM, so a training child stops as on
// preemption); it shares this process group, so a Ctrl-C reaches it too. The wait has a deadline:
// `timeout_s` (0: none; the child's own waits have theirs), and kStoppedLimitS for a child that
// stays stopped. Either stops the child and throws one error naming it. A SIGTERM or SIGINT to
// this process (train::PreemptionSignals, installed by verb_quantize) is passed on to the child as
// SIGTERM: the child stops as on preemption, this process waits for it (kTermGraceS, then SIGKILL)
// and throws train::PreemptedError naming it.
int run_self(const std::vector<std::string>& args, double timeout_s) {
  const auto signal_name = [] {
    return train::PreemptionSignals::signal_number() == SIGINT ? "SIGINT" : "SIGTERM";
  };
  if (train::PreemptionSignals::requested()) {
    throw train::PreemptedError(fmt::format(
        "quantize stopped by {} before the child run {}; nothing after it was run. Run the same "
        "command again to start over.",
        signal_name(), describe(args)));
  }
  std::vector<std::string> all{"/proc/self/exe"};
  all.insert(all.end(), args.begin(), args.end());
  core::log::info("quantize: parallax {}", core::join(args, " "));
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  PARALLAX_CHECK(pid >= 0, Error, "quantize: cannot start a child process (fork failed: {})",
                 std::strerror(errno));
  if (pid == 0) {  // only async-signal-safe calls until exec
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) ::_exit(127);  // this process died before prctl
    ::execv("/proc/self/exe", argv.data());
    ::_exit(127);
  }
  // A signal to this process: the child has stopped (with `child`, its wait status).
  const auto preempted = [&](int child) {
    return train::PreemptedError(fmt::format(
        "quantize stopped by {} during the child run {} (pid {}), which stopped as on preemption "
        "({}); nothing after it was run. What it saved is in its run directory; run the same "
        "command again to start over.",
        signal_name(), describe(args), pid,
        WIFEXITED(child) ? fmt::format("exit {}", WEXITSTATUS(child))
                         : fmt::format("killed by signal {}", WTERMSIG(child))));
  };
  const auto start = Clock::now();
  std::optional<Clock::time_point> stopped_since;
  int stop_signal = 0;
  int status = 0;
  while (true) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG | WUNTRACED | WCONTINUED);
    if (r < 0) {
      PARALLAX_CHECK(errno == EINTR, Error, "quantize: waiting for the child run {} (pid {}): {}",
                     describe(args), pid, std::strerror(errno));
      continue;
    }
    if (r == pid) {
      if (WIFEXITED(status) || WIFSIGNALED(status)) break;
      if (WIFSTOPPED(status)) {
        stopped_since = Clock::now();
        stop_signal = WSTOPSIG(status);
        core::log::warn(
            "quantize: the child run {} (pid {}) was stopped by signal {}; it is ended as failed "
            "if it is still stopped in {:.0f} s",
            describe(args), pid, stop_signal,
            timeout_s > 0 ? std::min(timeout_s, kStoppedLimitS) : kStoppedLimitS);
      } else if (WIFCONTINUED(status)) {
        stopped_since.reset();
      }
      continue;
    }
    if (train::PreemptionSignals::requested()) throw preempted(core::stop_child(pid, kTermGraceS));
    const auto now = Clock::now();
    const double ran = std::chrono::duration<double>(now - start).count();
    const double stopped =
        stopped_since ? std::chrono::duration<double>(now - *stopped_since).count() : 0.0;
    const double stopped_limit =
        timeout_s > 0 ? std::min(timeout_s, kStoppedLimitS) : kStoppedLimitS;
    if ((timeout_s > 0 && ran > timeout_s) || (stopped_since && stopped > stopped_limit)) {
      core::stop_child(pid, kTermGraceS);
      std::string why =
          timeout_s > 0 && ran > timeout_s
              ? fmt::format("ran past --timeout {} s", timeout_s)
              : fmt::format("has been stopped (signal {}) for {:.0f} s", stop_signal, stopped);
      if (stopped_since && timeout_s > 0 && ran > timeout_s)
        why += fmt::format(", stopped (signal {}) for the last {:.0f} s", stop_signal, stopped);
      throw_error<Error>(
          "quantize: the child run {} (pid {}) {}; it was ended (SIGTERM, then SIGKILL after "
          "{:.0f} s). What it saved is in its run directory.",
          describe(args), pid, why, kTermGraceS);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  // The child ended on the same signal (a Ctrl-C reaches the whole process group).
  if (train::PreemptionSignals::requested()) throw preempted(status);
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

// What the child runs would find only after the sweep (minutes, and its folders on disk): the
// export's --parity-frames, the run's checkpoint that train.load_from reads, and the config the
// children are given (the run's, with the overrides). Each is one error before any child starts.
void check_before_children(const Args& args, const fs::path& run, const fs::path& config) {
  if (args.has("parity-frames"))
    args.get_int("parity-frames", 0, std::numeric_limits<int>::max(),
                 "the frames the export's parity gate compares");
  if (args.has("name")) {
    const std::string name = args.get("name"), own = run.filename().string();
    PARALLAX_CHECK(name != own && name + "_sweep" != own, UsageError,
                   "quantize: --name '{}' would write its runs into the run it quantizes ('{}'); "
                   "give another name",
                   name, run.string());
  }
  try {
    checkpoint::CheckpointReader latest(run.string());  // its checkpoints/latest, verified
  } catch (const CheckpointError& e) {
    throw_error<CheckpointError>(
        "quantize: run '{}' has no checkpoint to quantize (its trained weights are the sweep's "
        "train.load_from): {}",
        run.string(), e.what());
  }
  std::vector<std::string> overrides{"train.load_from=" + run.string(), "qat.enabled=true",
                                     "qat.mode=ptq", "train.resume="};
  for (const auto& o : args.override_args()) overrides.push_back(o);
  try {
    train::load_run_config(config.string(), overrides);
  } catch (Error& e) {
    e.add_context("the config of quantize's child runs: the run's config.yaml and the overrides");
    throw;
  }
}

// The sweep, the chosen PTQ run and its ONNX export, each a child run (verb_quantize).
int run_all(const Args& args, const std::vector<std::string>& common, const fs::path& parent,
            const std::string& name, const std::string& sweep_name, const std::string& budget,
            const std::string& metric, double timeout_s) {
  std::vector<std::string> a = common;
  a.push_back("experiment.name=" + sweep_name);
  a.push_back(fmt::format("qat.budget={}", budget));
  a.push_back("qat.budget_metric=" + metric);
  if (int rc = run_self(a, timeout_s); rc != 0) return rc;

  const fs::path report = parent / sweep_name / "quantize_sweep.json";
  YAML::Node r;
  try {
    r = YAML::LoadFile(report.string());  // JSON is YAML
  } catch (const std::exception& e) {
    throw_error<IoError>("quantize: cannot read the sweep's report '{}': {}", report.string(),
                         e.what());
  }
  std::vector<std::string> skip;
  for (const auto& s : r["skip"]) skip.push_back(s.as<std::string>());
  std::vector<std::string> quoted;
  for (const auto& s : skip) quoted.push_back("'" + s + "'");

  a = common;
  a.push_back("experiment.name=" + name);
  a.push_back("qat.skip=[" + core::join(quoted, ",") + "]");
  if (int rc = run_self(a, timeout_s); rc != 0) return rc;

  std::vector<std::string> e{"export", "--run", (parent / name).string(), "--format", "onnx"};
  if (args.has("parity-frames")) {
    e.push_back("--parity-frames");
    e.push_back(args.get("parity-frames"));
  }
  if (int rc = run_self(e, timeout_s); rc != 0) return rc;

  std::fprintf(stdout,
               "quantize: %s within %s points of fp32 (%.4f): INT8 %.4f with %lld of %lld layers "
               "INT8 (%.1f%% of the weights); %zu layer(s) left unquantized%s%s\n"
               "  sweep:  %s\n  run:    %s (config.yaml holds qat.skip)\n  onnx:   %s\n",
               metric.c_str(), budget.c_str(), r["fp32"][metric].as<double>(),
               r["chosen"].as<double>(), r["int8_layers"].as<long long>(),
               r["layers"].as<long long>(), 100 * r["int8_weight_fraction"].as<double>(),
               skip.size(), skip.empty() ? "" : ": ", core::join(skip, ", ").c_str(),
               report.string().c_str(), (parent / name).string().c_str(),
               (parent / name / "export" / "model.onnx").string().c_str());
  return 0;
}

}  // namespace

int verb_quantize(const std::vector<std::string>& argv) {
  Args args("quantize",
            "Choose which layers of a trained fp32 run to quantize to INT8 within an accuracy "
            "budget: a per-unit sensitivity sweep, then the most sensitive units kept unquantized "
            "(greedily) until INT8 is within the budget of fp32; writes a PTQ run whose qat.skip "
            "holds the choice, and exports its Q/DQ ONNX through the parity gate.");
  args.option("run", "DIR", "the trained fp32 run directory (its config.yaml and checkpoints)")
      .option("budget-map", "POINTS", "the largest mAP drop allowed, in points (0.5 = 0.005)")
      .option("budget-miou", "POINTS", "the same on mIoU")
      .option("budget-nds", "POINTS", "the same on NDS")
      .option("name", "NAME", "the result run's name, beside the run (default: <run>_int8)")
      .option("parity-frames", "N", "frames the ONNX parity gate compares (default: export's)")
      .option("timeout", "SECONDS",
              "the longest each child run (sweep, result run, export) may take; 0: no limit, "
              "beyond the deadlines of the child's own waits (default: 0). A child stopped "
              "(SIGSTOP) for 60 s, or --timeout if shorter, is ended as failed")
      .overrides(
          "config overrides for the PTQ runs, e.g. qat.calibrator=percentile qat.calib_batches=16 "
          "qat.calib_select=hardest")
      .epilog(
          "example:\n"
          "  parallax quantize --run runs/bev_base --budget-map 0.5 qat.calib_select=hardest\n"
          "writes runs/bev_base_int8_sweep (the sweep: quantize_sweep.json), runs/bev_base_int8 "
          "(config.yaml with qat.skip, the calibrated checkpoint) and "
          "runs/bev_base_int8/export/model.onnx");
  args.parse(argv);
  if (args.help_requested()) {
    std::fputs(args.help_text().c_str(), stdout);
    return 0;
  }
  {
    // The children are this binary: under mpirun they would inherit the launcher's rank variables
    // and fail in MPI_Init (a page of OpenMPI's text), under a world of several ranks each rank
    // would run the whole sweep. One process does it all.
    const auto launch = comm::detect_launch();
    PARALLAX_CHECK(
        launch.launcher == comm::Launcher::kSingle || (launch.world_size == 1 && !launch.use_mpi),
        UsageError,
        "quantize: runs as one process (CPU or one GPU) and starts its own child runs; "
        "it was started by {} in a world of {} rank(s): run 'parallax quantize' "
        "directly, not under a launcher",
        comm::to_string(launch.launcher), launch.world_size);
  }
  PARALLAX_CHECK(args.has("run"), UsageError,
                 "quantize: --run DIR is required; see 'parallax quantize --help'");
  std::string metric, budget;
  for (const char* m : {"map", "miou", "nds"}) {
    const std::string opt = std::string("budget-") + m;
    if (!args.has(opt)) continue;
    PARALLAX_CHECK(metric.empty(), UsageError,
                   "quantize: give one budget (--budget-{} and --{} were both given)", metric, opt);
    metric = m;
    budget = args.get(opt);
  }
  PARALLAX_CHECK(!metric.empty(), UsageError,
                 "quantize: a budget is required: --budget-map POINTS (or --budget-miou, "
                 "--budget-nds)");
  double points = 0;
  try {
    std::size_t used = 0;
    points = std::stod(budget, &used);
    PARALLAX_CHECK(used == budget.size(), UsageError, "x");
  } catch (const std::exception&) {
    throw_error<UsageError>("quantize: --budget-{} '{}' is not a number", metric, budget);
  }
  PARALLAX_CHECK(points > 0 && std::isfinite(points), UsageError,
                 "quantize: --budget-{} must be above 0 points (got {})", metric, budget);
  double timeout_s = 0;
  if (args.has("timeout")) {
    const std::string t = args.get("timeout");
    try {
      std::size_t used = 0;
      timeout_s = std::stod(t, &used);
      PARALLAX_CHECK(used == t.size(), UsageError, "x");
    } catch (const std::exception&) {
      throw_error<UsageError>("quantize: --timeout '{}' is not a number of seconds", t);
    }
    PARALLAX_CHECK(timeout_s >= 0 && std::isfinite(timeout_s), UsageError,
                   "quantize: --timeout must be 0 (no limit) or more seconds (got {})", t);
  }
  fs::path run = fs::path(args.get("run")).lexically_normal();
  if (run.filename().empty()) run = run.parent_path();
  const fs::path config = run / "config.yaml";
  std::error_code ec;
  PARALLAX_CHECK(fs::is_regular_file(config, ec), ConfigError,
                 "quantize: '{}' is not a run directory: it has no config.yaml", run.string());
  const fs::path parent = run.has_parent_path() ? run.parent_path() : fs::path(".");
  const std::string name = args.has("name") ? args.get("name") : run.filename().string() + "_int8";
  const std::string sweep_name = name + "_sweep";
  // Its two runs are folders beside the run, checked before any child starts (core/files.h).
  const std::string bad_name = core::path_component_problem(name);
  PARALLAX_CHECK(bad_name.empty(), UsageError,
                 "quantize: --name '{}' must be one folder name, and it {}", name, bad_name);
  core::check_output_dir("quantize: the sweep's run directory", (parent / sweep_name).string());
  core::check_output_dir(args.has("name") ? "quantize: --name" : "quantize: the result run",
                         (parent / name).string());
  check_before_children(args, run, config);

  std::vector<std::string> common{"train",
                                  "--config",
                                  config.string(),
                                  "experiment.output_dir=" + parent.string(),
                                  "train.load_from=" + run.string(),
                                  "qat.enabled=true",
                                  "qat.mode=ptq",
                                  "train.resume="};
  for (const auto& o : args.override_args()) common.push_back(o);

  // The first SIGTERM / SIGINT is passed on to the running child, which stops as on preemption;
  // quantize then exits kExitPreempted. A second one exits at once (the child still gets SIGTERM
  // through PR_SET_PDEATHSIG).
  train::PreemptionSignals signals("stopping the child run (it stops as on preemption; exit 143)");
  try {
    return run_all(args, common, parent, name, sweep_name, budget, metric, timeout_s);
  } catch (const train::PreemptedError& e) {
    std::fprintf(stderr, "parallax: %s\n", e.what());
    return kExitPreempted;
  }
}

}  // namespace parallax::launch
