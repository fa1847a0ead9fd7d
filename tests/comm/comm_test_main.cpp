// main() of the multi-rank comm tests: one World per process; every rank runs the same tests in the
// same order (they are collective). Rank 0 prints GoogleTest's usual output; other ranks print only
// their failures, prefixed with the rank.
#include "comm/world.h"

#include "tests/comm/comm_test_util.h"
#include "tests/common/mpi_gtest.h"

#include <gtest/gtest.h>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  int rc = 1;
  {
    parallax::comm::World world;
    if (parallax::testing::skip_without_gpus(world)) return 0;
    parallax::testing::install_rank_printer(world.rank());
    rc = RUN_ALL_TESTS();
    parallax::comm::testing::world_comm_slot().reset();
  }
  return rc;
}
