// main() for multi-rank GoogleTest binaries run under mpirun: creates the process World, runs the
// tests, and prints results on rank 0 only, while failures on any rank are printed with the rank.
// mpirun's exit code is non-zero when any rank fails.
#include "parallel/comm/world.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed()) {
      std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_, r.file_name() ? r.file_name() : "?",
                   r.line_number(), r.summary());
    }
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  parallax::parallel::comm::World world;
  const char* backend = std::getenv("PARALLAX_TEST_BACKEND");
  if (backend && std::string(backend) == "nccl" &&
      world.cuda_device_count() < world.launch().local_world_size) {
    // ctest reports the test as skipped (SKIP_REGULAR_EXPRESSION).
    std::printf("PARALLAX_SKIP: backend nccl needs %d GPUs on this node, found %d\n",
                world.launch().local_world_size, world.cuda_device_count());
    return 0;
  }
  if (world.rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(world.rank()));
  }
  return RUN_ALL_TESTS();
}
