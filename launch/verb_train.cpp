// `parallax train`: load the config, then train (or print the resolved config / its keys).
#include "core/config.h"
#include "launch/args.h"
#include "launch/exit_codes.h"
#include "launch/verbs.h"
#include "parallel/comm/world.h"
#include "parallel/pipeline/schedule.h"
#include "train/preemption.h"
#include "train/run_config.h"
#include "train/trainer.h"

#include <fmt/format.h>

#include <cstdio>

namespace parallax::launch {

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
          "config overrides, Hydra style: optim.lr=3e-4 parallel.dp=2 model.img_size[0]=224 ~key")
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
    train::RunConfig defaults;
    for (const auto& e : core::list_keys(defaults)) {
      std::printf("%-40s %-16s %-14s %s\n", e.path.c_str(), e.type.c_str(), e.default_value.c_str(),
                  e.doc.c_str());
    }
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
  // The World (MPI or TCPStore rendezvous, device selection) lives for the whole run and is
  // destroyed after every communicator the trainer created.
  parallel::comm::WorldOptions wopts;
  wopts.init_timeout_s = cfg.parallel.init_timeout_s;
  // The first SIGTERM/SIGINT stops training after the current step with a checkpoint, the
  // second exits at once (train/preemption.h); installed before the rendezvous so that a signal
  // during start-up is not lost.
  train::PreemptionSignals signals;
  parallel::comm::World world(wopts);
  train::run_training(cfg);
  return train::preempted() ? kExitPreempted : kExitOk;
}

}  // namespace parallax::launch
