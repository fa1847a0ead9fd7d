#include "tests/common/mpi_gtest.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace parallax::testing {
namespace {

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed()) {
      std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_,
                   r.file_name() ? r.file_name() : "?", r.line_number(), r.summary());
    }
  }
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (info.result()->Failed()) {
      std::fprintf(stderr, "[rank %d] FAILED %s.%s\n", rank_, info.test_suite_name(), info.name());
    }
  }

 private:
  int rank_;
};

}  // namespace

void install_rank_printer(int rank) {
  if (rank == 0) return;
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  delete listeners.Release(listeners.default_result_printer());
  listeners.Append(new RankFailurePrinter(rank));
}

bool skip_without_gpus(const comm::World& world) {
  const char* backend = std::getenv("PARALLAX_TEST_BACKEND");
  if (!backend || std::string(backend) != "nccl") return false;
  if (world.cuda_device_count() >= world.launch().local_world_size) return false;
  std::printf("PARALLAX_SKIP: backend nccl needs %d GPUs on this node, found %d\n",
              world.launch().local_world_size, world.cuda_device_count());
  return true;
}

}  // namespace parallax::testing
