// main() of the multi-rank comm tests: one World per process; every rank runs the same tests in the
// same order (they are collective). Rank 0 prints GoogleTest's usual output; other ranks print only
// their failures, prefixed with the rank.
#include "parallel/comm/world.h"

#include "tests/comm/comm_test_util.h"

#include <gtest/gtest.h>

namespace {

class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_, r.file_name(), r.line_number(),
                   r.summary());
  }
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (info.result()->Failed())
      std::fprintf(stderr, "[rank %d] FAILED %s.%s\n", rank_, info.test_suite_name(), info.name());
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  int rc = 1;
  {
    parallax::parallel::comm::World world;
    if (parallax::parallel::comm::testing::test_backend() == "nccl" &&
        world.cuda_device_count() < world.launch().local_world_size) {
      // ctest reports the test as skipped (SKIP_REGULAR_EXPRESSION).
      std::printf("PARALLAX_SKIP: backend nccl needs %d GPUs on this node, found %d\n",
                  world.launch().local_world_size, world.cuda_device_count());
      return 0;
    }
    if (world.rank() != 0) {
      auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
      listeners.Append(new FailurePrinter(world.rank()));
    }
    rc = RUN_ALL_TESTS();
    parallax::parallel::comm::testing::world_comm_slot().reset();
  }
  return rc;
}
