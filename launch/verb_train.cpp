// `parallax train`: load the config, then train (or print the resolved config / its keys).
#include "core/config.h"
#include "core/strings.h"
#include "launch/args.h"
#include "launch/bootstrap.h"
#include "launch/exit_codes.h"
#include "launch/verbs.h"
#include "parallel/pipeline/schedule.h"
#include "parallel/pipeline/schedule_check.h"
#include "train/preemption.h"
#include "train/run_config.h"
#include "train/trainer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <string>
#include <vector>

namespace parallax::launch {
namespace {

// Whether `text` holds `word` with no letter, digit or '_' on either side.
bool names_word(const std::string& text, const std::string& word) {
  const auto part = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
  for (auto at = text.find(word); at != std::string::npos; at = text.find(word, at + 1)) {
    const std::size_t end = at + word.size();
    if ((at == 0 || !part(text[at - 1])) && (end == text.size() || !part(text[end]))) return true;
  }
  return false;
}

// `--help-config`: every key, its type, default and meaning. A key validated against a fixed set
// (core::Check::one_of) ends its meaning with the set, as its error message names it, unless the
// meaning already names every choice.
void print_config_keys() {
  train::RunConfig defaults;
  for (const auto& e : core::list_keys(defaults)) {
    std::string doc = e.doc;
    const bool named = std::all_of(e.choices.begin(), e.choices.end(), [&](const std::string& c) {
      return c.empty() || names_word(doc, c);
    });
    if (!named) {
      std::vector<std::string> choices;
      for (const auto& c : e.choices) choices.push_back(c.empty() ? "''" : c);
      doc += fmt::format("{}(one of {})", doc.empty() ? "" : " ", core::join(choices, "|"));
    }
    std::printf("%-40s %-16s %-14s %s\n", e.path.c_str(), e.type.c_str(), e.default_value.c_str(),
                doc.c_str());
  }
}

}  // namespace

int verb_train(const std::vector<std::string>& argv) {
  Args args("train",
            "Train a model described by a YAML config. Works alone (one process) or under "
            "mpirun, srun or torchrun --no-python; the rank layout comes from the launcher.");
  args.option("config", "FILE", "YAML config (may extend others through `_base_`)")
      .flag("print-config",
            "print the resolved config (defaults, bases and overrides applied) and exit")
      .flag("print-pp-schedule",
            "print the pipeline schedule (parallel.pp stages, train.grad_accum micro-batches) as a "
            "checked timeline with its bubble, and exit")
      .flag("help-config", "list every config key with its type, default and meaning, and exit")
      .overrides(
          "config overrides, Hydra style: optim.lr=3e-4 parallel.dp=2 optim.betas[1]=0.95 "
          "~schedule.warmup_steps (~key restores the default)")
      .epilog(
          "examples:\n"
          "  parallax train --config configs/bev_tiny.yaml\n"
          "  parallax train --config configs/bev_tiny.yaml optim.lr=3e-4 train.steps=200 "
          "--print-config\n"
          "  mpirun -np 2 parallax train --config configs/bev_tiny.yaml\n"
          "  parallax train --config configs/bev_tiny.yaml parallel.pp=4 train.grad_accum=8 "
          "--print-pp-schedule");
  args.parse(argv);
  if (args.help_requested()) {
    std::fputs(args.help_text().c_str(), stdout);
    return 0;
  }
  if (args.flag_set("help-config")) {
    print_config_keys();
    return 0;
  }
  if (!args.has("config")) {
    throw_error<UsageError>("train: --config FILE is required; see 'parallax train --help'");
  }
  train::RunConfig cfg = train::load_run_config(args.get("config"), args.override_args());
  if (args.flag_set("print-config")) {
    std::fputs(train::resolved_yaml(cfg).c_str(), stdout);
    return 0;
  }
  if (args.flag_set("print-pp-schedule")) {
    const auto schedule =
        parallel::pipeline::build_schedule(cfg.parallel.pp_schedule, cfg.parallel.pp,
                                           cfg.train.grad_accum, cfg.parallel.pp_virtual_stages);
    parallel::pipeline::check(schedule);
    std::fputs(parallel::pipeline::render(schedule).c_str(), stdout);
    return 0;
  }
  // The first SIGTERM/SIGINT stops training after the current step with a checkpoint, the
  // second exits at once (train/preemption.h); installed before the rendezvous so that a signal
  // during start-up is not lost.
  train::PreemptionSignals signals;
  const std::unique_ptr<comm::World> world = bootstrap_world(cfg);
  train::run_training(cfg);
  return train::preempted() ? kExitPreempted : kExitOk;
}

}  // namespace parallax::launch
