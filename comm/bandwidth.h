// The bus bandwidth of an all-reduce over a world, measured as nccl-tests defines it (parallel/
// comm): `parallax plan --calibrate` starts one worker per local GPU or CPU rank, each of which
// calls measure_bus_bandwidth() on its World.
#pragma once

#include "comm/world.h"

#include <cstdint>
#include <string>

namespace parallax::comm {

struct Bandwidth {
  double busbw_gbps = 0;  // 2 (n-1)/n x bytes / time, the slowest rank's time
  double bytes = 0;
  double seconds = 0;  // per all-reduce
  int ranks = 0;
  int rank = 0;
  std::string backend;
};

// An all-reduce of `mib` MiB of float32 over `world` (NCCL on GPUs, gloo on CPUs): 2 warm-up calls
// then 5 timed ones, each waited for. Collective. The buffer holds ones and is averaged, so it
// must stay all ones: a wrong reduction is a CommError rather than a number.
Bandwidth measure_bus_bandwidth(World& world, bool cuda, int64_t mib);

}  // namespace parallax::comm
