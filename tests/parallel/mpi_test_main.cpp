// main() of the multi-rank DDP tests (run under mpirun): creates the process World, runs the tests,
// prints results on rank 0 and failures on every rank with the rank.
#include "comm/world.h"
#include "tests/common/mpi_gtest.h"

#include <gtest/gtest.h>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  parallax::comm::World world;
  if (parallax::testing::skip_without_gpus(world)) return 0;
  parallax::testing::install_rank_printer(world.rank());
  return RUN_ALL_TESTS();
}
