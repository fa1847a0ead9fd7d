// Hang detection, end to end: the last rank skips a collective; every other rank must fail within
// the timeout with a TimeoutError naming the op, the group, the tensor and the rank that never
// arrived (from the out-of-band store), and write its flight recorder. Then a receive from a rank
// that never sends must time out naming its peer.
//
// Exit path: a rank whose MPI collective timed out cannot finalize MPI (the op is still pending),
// so the ranks report their results through the World's store and rank 0 ends the job with
// World::abort(0 or 1) (MPI_Abort under mpirun; each rank _Exits with its own code otherwise).
// This is the documented way out after a TimeoutError.
#include "comm/flight_recorder.h"
#include "core/error.h"
#include "tests/comm/comm_test_util.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

using namespace parallax;
using namespace parallax::comm;
using namespace parallax::comm::testing;

namespace {

constexpr double kTimeout = 2.0;

c10::intrusive_ptr<c10d::Store> store() {
  return World::current().store();
}

// A barrier through the store, independent of any communicator.
void store_barrier(const std::string& name) {
  const int n = World::current().size();
  store()->add("timeout_test/" + name, 1);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (store()->add("timeout_test/" + name, 0) < n) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "store barrier " << name;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// Runs `op`, which must fail with a TimeoutError no earlier than kTimeout and at most 3 s later;
// returns its message ("" when none came) and prints it as the hang report.
template <class F>
std::string timeout_message(F&& op) {
  const auto start = std::chrono::steady_clock::now();
  std::string message;
  try {
    op();
  } catch (const TimeoutError& e) {
    message = e.what();
  }
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::fprintf(stderr, "[rank %d] hang report after %.2f s:\n%s\n", World::current().rank(),
               elapsed, message.c_str());
  EXPECT_GE(elapsed, kTimeout);
  EXPECT_LT(elapsed, kTimeout + 3.0) << "the timeout fired late";
  return message;
}

}  // namespace

TEST(TimeoutTest, RanksWaitingForAMissingRankFailInTimeNamingIt) {
  CommOptions o;
  o.timeout_s = kTimeout;
  CommPtr c = make_world_communicator(test_backend(), o);
  const int n = c->size(), r = c->rank(), last = n - 1;
  ASSERT_GE(n, 2);
  at::Tensor t = at::ones({1000}, at::TensorOptions().device(test_device()));
  c->all_reduce(t, ReduceOp::kSum);  // #1: everyone
  if (r != last) {
    const int line = __LINE__ + 1;  // #2: the last rank never comes
    const std::string message = timeout_message([&] { c->all_reduce(t, ReduceOp::kSum); });
    ASSERT_FALSE(message.empty()) << "no TimeoutError";
    EXPECT_NE(message.find("all_reduce(sum, native) #2 on group 'world'"), std::string::npos)
        << message;
    EXPECT_NE(message.find(fmt::format("timed out after {:.1f} s on world rank {}", kTimeout, r)),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("float32[1000] (3.9 KiB)"), std::string::npos) << message;
    EXPECT_NE(message.find(fmt::format("comm_timeout_test.cpp:{}", line)), std::string::npos)
        << message;
    EXPECT_NE(message.find(fmt::format("Ranks that never arrived: [{}]", last)), std::string::npos)
        << message;
    EXPECT_NE(message.find(fmt::format("world rank {} (last issued #1 all_reduce", last)),
              std::string::npos)
        << message;
    EXPECT_TRUE(c->aborted());
    EXPECT_TRUE(World::current().comm_failed());
    const std::string path = flight_dump_path(World::current().rank());
    EXPECT_NE(message.find("Flight recorder: " + path), std::string::npos) << message;
    const std::string dump = read_file(path);
    EXPECT_NE(dump.find("\"state\": \"timed_out\""), std::string::npos) << dump;
    EXPECT_NE(dump.find("\"seq\": 2"), std::string::npos) << dump;
    EXPECT_THROW(c->barrier(), CommError);
  }
  store_barrier("after_collective");

  // The first collective on a fresh communicator, which the last rank skips. On NCCL's blocking
  // communicators (the default) this is the case that needs the collective's connections made at
  // creation: a first contact inside the call would wait for the missing rank with the host
  // blocked, past the timeout.
  {
    CommPtr f = make_world_communicator(test_backend(), o);
    if (r != last) {
      at::Tensor x = at::ones({4096}, at::TensorOptions().device(test_device()));
      // #1: the last rank never comes
      const std::string message = timeout_message([&] { f->all_reduce(x, ReduceOp::kSum); });
      ASSERT_FALSE(message.empty()) << "no TimeoutError";
      EXPECT_NE(message.find("all_reduce(sum, native) #1 on group 'world'"), std::string::npos)
          << message;
      EXPECT_NE(message.find(fmt::format("Ranks that never arrived: [{}]", last)),
                std::string::npos)
          << message;
    }
    store_barrier("after_first_collective");
  }

  // A point-to-point receive whose sender never sends.
  CommPtr p = make_world_communicator(test_backend(), o);
  if (r == 0) {
    at::Tensor buf = at::empty({16}, at::TensorOptions().device(test_device()));
    std::string message;
    try {
      p->recv(buf, 1, 7);
    } catch (const TimeoutError& e) {
      message = e.what();
    }
    ASSERT_FALSE(message.empty()) << "no TimeoutError";
    EXPECT_NE(message.find("recv from rank 1 (world 1), tag 7, p2p #1 on group 'world'"),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("Peer world rank 1 is alive"), std::string::npos) << message;
  }
  store_barrier("after_p2p");
}

int main(int argc, char** argv) {
  World world;
  if (test_backend() == "nccl" && world.cuda_device_count() < world.launch().local_world_size) {
    std::printf("PARALLAX_SKIP: backend nccl needs %d GPUs, this node has %d\n",
                world.launch().local_world_size, world.cuda_device_count());
    world.abort(0);
  }
  ::testing::InitGoogleTest(&argc, argv);
  const int rc = RUN_ALL_TESTS();
  // Gather every rank's result through the store, then leave through the documented exit path.
  // Rank 0 hosts the store, so it leaves last.
  auto s = world.store();
  s->set(fmt::format("timeout_test/result/{}", world.rank()),
         std::vector<uint8_t>{static_cast<uint8_t>(rc ? 1 : 0)});
  if (world.rank() == 0) {
    int failed = 0;
    for (int q = 0; q < world.size(); ++q) {
      const std::string k = fmt::format("timeout_test/result/{}", q);
      s->wait({k}, std::chrono::seconds(60));
      failed += s->get(k).at(0);
    }
    std::printf("timeout test: %d of %d ranks failed\n", failed, world.size());
    std::fflush(stdout);
    world.abort(failed ? 1 : 0);  // MPI_Abort ends every rank under mpirun
  }
  if (!world.has_mpi()) world.abort(rc ? 1 : 0);
  std::this_thread::sleep_for(
      std::chrono::seconds(90));  // rank 0's MPI_Abort ends this process first
  return 1;
}
