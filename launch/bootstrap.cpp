#include "launch/bootstrap.h"

#include "comm/startup.h"

namespace parallax::launch {

std::unique_ptr<comm::World> bootstrap_world(const train::RunConfig& cfg) {
  comm::WorldOptions options;
  // The start-up deadline bounds every wait before the first step (comm/startup.h).
  options.init_timeout_s =
      comm::startup_deadline_s(cfg.parallel.init_timeout_s, cfg.parallel.timeout_s);
  return std::make_unique<comm::World>(options);
}

std::unique_ptr<comm::World> bootstrap_world() {
  return std::make_unique<comm::World>(comm::WorldOptions{});
}

}  // namespace parallax::launch
