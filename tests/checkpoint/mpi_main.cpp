// main() of the multi-rank checkpoint tests (run under mpirun): creates the process World and a
// world communicator (for the tests' own barriers and broadcasts, never used by the checkpoint
// code), parses `--dir=PATH` (where the resharding tests keep their checkpoint between runs), and
// prints results on rank 0 only, failures on every rank with the rank.
#include "mpi_env.h"

#include "comm/factory.h"
#include "tests/common/mpi_gtest.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>

namespace parallax::ckpt_test {

MpiEnv& MpiEnv::get() {
  static MpiEnv env;
  return env;
}

}  // namespace parallax::ckpt_test

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  auto& env = parallax::ckpt_test::MpiEnv::get();
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--dir=", 6) == 0) env.dir = argv[i] + 6;
  }
  parallax::comm::World world;
  env.comm = parallax::comm::make_world_communicator(world, "mpi");
  parallax::testing::install_rank_printer(world.rank());
  const int rc = RUN_ALL_TESTS();
  env.comm.reset();
  return rc;
}
