// The process's World for the verbs that run a config on every rank (`parallax train`, `parallax
// eval`): MPI or the TCPStore rendezvous and the device of this rank, bounded by the run's
// start-up deadline (comm/startup.h). It lives for the verb's lifetime and is destroyed
// after every communicator the run created (the run is assembled after it: train/run.h).
#pragma once

#include "comm/world.h"
#include "train/run_config.h"

#include <memory>

namespace parallax::launch {

std::unique_ptr<comm::World> bootstrap_world(const train::RunConfig& cfg);

}  // namespace parallax::launch
