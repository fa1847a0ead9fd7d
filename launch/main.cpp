// Entry point of the `parallax` binary: dispatches to a verb and is the one place where errors
// become `parallax: error: ...` and a non-zero exit code.
#include "core/error.h"
#include "core/strings.h"
#include "launch/exit_codes.h"
#include "launch/verbs.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <csignal>
#include <cstdio>
#include <exception>
#include <new>

namespace parallax::launch {

const std::vector<Verb>& verbs() {
  static const std::vector<Verb> kVerbs = {
      {"train", "train a model from a config file (also under mpirun / srun / torchrun)",
       verb_train},
      {"eval", "evaluate a checkpoint on a dataset split (also under mpirun / srun / torchrun)",
       verb_eval},
      {"export", "export a run's checkpoint: ONNX with a parity gate, or weights.h5", verb_export},
      {"datagen", "generate a synthetic multi-camera dataset (HDF5 shards + dataset.json)",
       verb_datagen},
      {"convert", "convert a driving dataset (nuScenes) into a Parallax dataset", verb_convert},
      {"inspect", "describe and verify a dataset folder or an HDF5 data shard", verb_inspect},
      {"launch", "run N workers per node with restarts and graceful preemption (torchrun style)",
       verb_launch},
      {"quantize",
       "choose which layers to quantize to INT8 within an accuracy budget, export the Q/DQ ONNX",
       verb_quantize},
      {"plan", "which parallel layout to run on N GPUs: memory and step time of every layout",
       verb_plan},
  };
  return kVerbs;
}

namespace {

std::string top_help() {
  std::string out =
      "usage: parallax <verb> [options]\n\n"
      "Parallax: distributed training of multi-camera BEV perception models in C++.\n\nverbs:\n";
  for (const auto& v : verbs()) out += fmt::format("  {:<10} {}\n", v.name, v.summary);
  out +=
      "\nRun 'parallax <verb> --help' for the options of a verb.\n"
      "Environment: PARALLAX_LOG_LEVEL=trace|debug|info|warn|error, PARALLAX_LOG_ALL_RANKS=1.\n";
  return out;
}

int dispatch(int argc, char** argv) {
  if (argc < 2) {
    std::fputs(top_help().c_str(), stderr);
    return 2;
  }
  const std::string verb = argv[1];
  if (verb == "--help" || verb == "-h" || verb == "help") {
    std::fputs(top_help().c_str(), stdout);
    return 0;
  }
  if (verb == "--version") {
    std::puts("parallax 0.1.0");
    return 0;
  }
  std::vector<std::string> args(argv + 2, argv + argc);
  std::vector<std::string> names;
  for (const auto& v : verbs()) {
    if (verb == v.name) return v.run(args);
    names.push_back(v.name);
  }
  throw_error<UsageError>("unknown verb '{}'{}; verbs are: {}", verb,
                          core::did_you_mean(verb, names), core::join(names, ", "));
}

}  // namespace
}  // namespace parallax::launch

int main(int argc, char** argv) {
  // As in Python (and so in torchrun's workers): a peer's socket closing is an error that the
  // communicator reports, not a silent death by SIGPIPE. This matters once SIGTERM no longer
  // kills a worker at once (graceful preemption, train/preemption.h).
  std::signal(SIGPIPE, SIG_IGN);
  try {
    return parallax::launch::dispatch(argc, argv);
  } catch (const parallax::UsageError& e) {
    std::fprintf(stderr, "parallax: error: %s\n", e.what());
    return parallax::launch::kExitUsage;
  } catch (const parallax::ConfigError& e) {
    // Deterministic: the same command fails the same way, so `parallax launch` does not restart.
    std::fprintf(stderr, "parallax: error: %s\n", e.what());
    return parallax::launch::kExitDeterministic;
  } catch (const parallax::LayoutError& e) {
    std::fprintf(stderr, "parallax: error: %s\n", e.what());
    return parallax::launch::kExitDeterministic;
  } catch (const parallax::DataError& e) {
    std::fprintf(stderr, "parallax: error: %s\n", e.what());
    return parallax::launch::kExitDeterministic;
  } catch (const parallax::Error& e) {
    std::fprintf(stderr, "parallax: error: %s\n", e.what());
    return 1;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "parallax: error: LibTorch: %s\n", e.what_without_backtrace());
    return 1;
  } catch (const std::bad_alloc&) {
    // Deterministic too: the same sizes run out of memory again.
    std::fprintf(stderr,
                 "parallax: error: out of host memory (std::bad_alloc); a setting that sizes "
                 "memory (data.batch_size, data.prefetch, the model size, --parity-frames ...) "
                 "asks for more than this machine has\n");
    return parallax::launch::kExitDeterministic;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "parallax: error: %s\n", e.what());
    return 1;
  }
}
