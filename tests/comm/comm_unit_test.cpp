// Single-process tests of the comm layer: launcher detection, layouts, chunking, options, the
// flight recorder, and a one-rank World with each CPU backend.
#include "comm/factory.h"
#include "comm/flight_recorder.h"
#include "comm/startup.h"
#include "comm/topology.h"
#include "comm/world.h"
#include "core/error.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

using namespace parallax;
using namespace parallax::comm;

namespace {

GetEnv env_of(const std::map<std::string, std::string>& vars) {
  return [vars](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
}

template <class E, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(LaunchTest, DetectsOpenMpi) {
  auto info = detect_launch(env_of({{"OMPI_COMM_WORLD_SIZE", "4"},
                                    {"OMPI_COMM_WORLD_RANK", "2"},
                                    {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                                    {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                    {"RANK", "9"},
                                    {"WORLD_SIZE", "16"}}));
  EXPECT_EQ(info.launcher, Launcher::kOpenMpi);
  EXPECT_EQ(info.rank, 2);
  EXPECT_EQ(info.world_size, 4);
  EXPECT_EQ(info.local_rank, 0);
  EXPECT_EQ(info.local_world_size, 2);
  EXPECT_TRUE(info.use_mpi);
}

TEST(LaunchTest, DetectsTorchrunWithItsStore) {
  auto info = detect_launch(env_of({{"RANK", "3"},
                                    {"WORLD_SIZE", "8"},
                                    {"LOCAL_RANK", "1"},
                                    {"LOCAL_WORLD_SIZE", "2"},
                                    {"MASTER_ADDR", "node7"},
                                    {"MASTER_PORT", "29511"},
                                    {"SLURM_PROCID", "0"},
                                    {"SLURM_NTASKS", "4"},
                                    {"TORCHELASTIC_USE_AGENT_STORE", "True"}}));
  EXPECT_EQ(info.launcher, Launcher::kTorchrun);
  EXPECT_EQ(info.rank, 3);
  EXPECT_EQ(info.world_size, 8);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 2);
  EXPECT_FALSE(info.use_mpi);
  EXPECT_EQ(info.master_addr, "node7");
  EXPECT_EQ(info.master_port, 29511);
  EXPECT_TRUE(info.agent_store);
  EXPECT_NE(info.describe().find("store node7:29511"), std::string::npos) << info.describe();
}

TEST(LaunchTest, DetectsSlurmWithAndWithoutPmi) {
  std::map<std::string, std::string> vars = {{"SLURM_PROCID", "5"},
                                             {"SLURM_NTASKS", "8"},
                                             {"SLURM_LOCALID", "1"},
                                             {"SLURM_NTASKS_PER_NODE", "4(x2)"},
                                             {"PMIX_RANK", "5"}};
  auto info = detect_launch(env_of(vars));
  EXPECT_EQ(info.launcher, Launcher::kSlurm);
  EXPECT_EQ(info.rank, 5);
  EXPECT_EQ(info.world_size, 8);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 4);
  EXPECT_TRUE(info.use_mpi);
  vars.erase("PMIX_RANK");
  std::string err = error_of<CommError>([&] { detect_launch(env_of(vars)); });
  EXPECT_NE(err.find("MASTER_PORT"), std::string::npos) << err;
  vars["MASTER_ADDR"] = "head";
  vars["MASTER_PORT"] = "1234";
  info = detect_launch(env_of(vars));
  EXPECT_FALSE(info.use_mpi);
  EXPECT_EQ(info.master_addr, "head");
}

TEST(LaunchTest, FallsBackToASingleProcess) {
  auto info = detect_launch(env_of({}));
  EXPECT_EQ(info.launcher, Launcher::kSingle);
  EXPECT_EQ(info.rank, 0);
  EXPECT_EQ(info.world_size, 1);
  EXPECT_TRUE(info.use_mpi);
  EXPECT_FALSE(detect_launch(env_of({{"PARALLAX_MPI", "0"}})).use_mpi);
}

TEST(LaunchTest, MalformedOrMissingVariablesAreNamed) {
  std::string err = error_of<CommError>([] {
    detect_launch(env_of({{"RANK", "0"}, {"WORLD_SIZE", "two"}}));
  });
  EXPECT_NE(err.find("WORLD_SIZE='two' is not an integer"), std::string::npos) << err;
  err = error_of<CommError>([] {
    detect_launch(env_of({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29500"}}));
  });
  EXPECT_NE(err.find("MASTER_ADDR is not set"), std::string::npos) << err;
  err = error_of<CommError>([] {
    detect_launch(
        env_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}}));
  });
  EXPECT_NE(err.find("rank 2 is outside the world of 2 ranks"), std::string::npos) << err;
  err = error_of<CommError>([] { detect_launch(env_of({{"OMPI_COMM_WORLD_SIZE", "2"}})); });
  EXPECT_NE(err.find("OMPI_COMM_WORLD_RANK is not set"), std::string::npos) << err;
}

TEST(LayoutTest, ResolvesAutomaticDp) {
  RankLayout l = resolve_layout(8, 0, 2, 2);
  EXPECT_EQ(l.dp, 2);
  EXPECT_EQ(l.tp, 2);
  EXPECT_EQ(l.pp, 2);
  EXPECT_EQ(resolve_layout(6, 0, 1, 1).dp, 6);
}

TEST(LayoutTest, ImpossibleLayoutsNameTheirNumbers) {
  std::string err = error_of<LayoutError>([] { resolve_layout(6, 2, 2, 1); });
  EXPECT_NE(err.find("dp * tp * pp = 2 * 2 * 1 = 4 does not equal the world size 6"),
            std::string::npos)
      << err;
  err = error_of<LayoutError>([] { resolve_layout(6, 0, 4, 1); });
  EXPECT_NE(err.find("world size 6 to be divisible by tp * pp = 4 * 1 = 4"), std::string::npos)
      << err;
  err = error_of<LayoutError>([] { resolve_layout(16, 0, 8, 1, 4); });
  EXPECT_NE(err.find("tp=8 is larger than the 4 GPUs per node"), std::string::npos) << err;
  err = error_of<LayoutError>([] { resolve_layout(12, 0, 3, 1, 8); });
  EXPECT_NE(err.find("tp=3 does not divide the 8 GPUs per node"), std::string::npos) << err;
  EXPECT_NO_THROW(resolve_layout(16, 0, 8, 1, 8));
}

TEST(LayoutTest, TensorParallelIsInnermostAndPipelineOutermost) {
  const RankLayout l = resolve_layout(8, 2, 2, 2);
  // The example of topology.h, written out.
  EXPECT_EQ(group_ranks(l, "tp", 5), (std::vector<int>{4, 5}));
  EXPECT_EQ(group_ranks(l, "dp", 5), (std::vector<int>{5, 7}));
  EXPECT_EQ(group_ranks(l, "pp", 5), (std::vector<int>{1, 5}));
  EXPECT_THROW(group_ranks(l, "dp_tp", 5), CommError);
  for (int r = 0; r < 8; ++r) EXPECT_EQ(rank_of(l, coord_of(l, r)), r);
  const Coord c = coord_of(l, 6);
  EXPECT_EQ(c.tp, 0);
  EXPECT_EQ(c.dp, 1);
  EXPECT_EQ(c.pp, 1);
}

TEST(ChunkTest, ChunksCoverTheTensorAndDifferByAtMostOne) {
  for (int64_t numel : {0, 1, 5, 7, 1000, 1003}) {
    for (int parts : {1, 2, 3, 4}) {
      int64_t total = 0;
      for (int i = 0; i < parts; ++i) {
        EXPECT_EQ(chunk_offset(numel, parts, i), total);
        const int64_t c = chunk_numel(numel, parts, i);
        EXPECT_TRUE(c == numel / parts || c == numel / parts + 1);
        total += c;
      }
      EXPECT_EQ(total, numel);
      EXPECT_EQ(chunk_offset(numel, parts, parts), numel);
    }
  }
  EXPECT_EQ(chunk_numel(10, 4, 0), 3);
  EXPECT_EQ(chunk_numel(10, 4, 3), 2);
}

TEST(OptionsTest, ConfigValuesBecomeCommOptions) {
  CommOptions o = make_comm_options(30, 60, 900, true, 64, "ring", 1 << 20);
  EXPECT_EQ(o.timeout_s, 30);
  EXPECT_EQ(o.init_timeout_s, 60);
  EXPECT_EQ(o.checkpoint_timeout_s, 900);
  EXPECT_TRUE(o.debug_collectives);
  EXPECT_EQ(o.flight_recorder_size, 64);
  EXPECT_EQ(o.allreduce_algo, AllReduceAlgo::kRing);
  EXPECT_EQ(o.ring_chunk_bytes, 1 << 20);
  std::string err =
      error_of<ConfigError>([] { make_comm_options(30, 60, 900, false, 64, "tree"); });
  EXPECT_NE(err.find("'tree'"), std::string::npos) << err;
  EXPECT_THROW(make_comm_options(0, 60, 900, false, 64, "native"), ConfigError);
}

// The start-up deadline is the smallest of init_timeout_s, timeout_s and $PARALLAX_STARTUP_TIMEOUT.
TEST(StartupTest, DeadlineIsTheSmallestOfTheKeysAndTheVariable) {
  ::unsetenv("PARALLAX_STARTUP_TIMEOUT");
  EXPECT_EQ(startup_deadline_s(300, 600), 300);
  EXPECT_EQ(startup_deadline_s(300, 10), 10);
  ::setenv("PARALLAX_STARTUP_TIMEOUT", "42.5", 1);
  EXPECT_EQ(startup_deadline_s(300, 600), 42.5);
  EXPECT_EQ(startup_deadline_s(300, 10), 10);
  for (const char* bad : {"0", "-1", "abc", "5s", "inf", "nan"}) {
    ::setenv("PARALLAX_STARTUP_TIMEOUT", bad, 1);
    const std::string err = error_of<ConfigError>([] { startup_deadline_s(300, 600); });
    EXPECT_NE(err.find("PARALLAX_STARTUP_TIMEOUT"), std::string::npos) << bad << ": " << err;
  }
  ::unsetenv("PARALLAX_STARTUP_TIMEOUT");
}

// A phase that ends in time disarms its watchdog (the process goes on); one that outlives the
// deadline ends the process with one line naming the phase (a death test: a child process).
TEST(StartupTest, APhasePastTheDeadlineEndsTheProcessWithOneLine) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // re-executes the binary: LibTorch has threads
  LaunchInfo launch;
  launch.launcher = Launcher::kOpenMpi;
  launch.rank = 1;
  launch.world_size = 4;
  launch.local_world_size = 2;
  { StartupPhase quick("a quick phase", 30, launch); }
  EXPECT_EXIT(
      {
        StartupPhase slow("a stuck phase", 0.2, launch);
        std::this_thread::sleep_for(std::chrono::seconds(30));
      },
      ::testing::ExitedWithCode(1),
      "parallax: error: rank 1 of 4: start-up did not finish: a stuck phase still waited after 0 s"
      ".*2 rank\\(s\\) run on other hosts");
}

TEST(FlightRecorderTest, RingBufferKeepsTheNewestEntries) {
  FlightRecorder rec(3);
  std::vector<uint64_t> ids;
  for (int i = 1; i <= 5; ++i) {
    FlightEntry e;
    e.seq = static_cast<uint64_t>(i);
    e.op = "all_reduce";
    ids.push_back(rec.record(e));
  }
  rec.set_state(ids[4], OpState::kTimedOut);
  rec.set_state(ids[0], OpState::kCompleted);  // overwritten: ignored
  auto s = rec.snapshot();
  ASSERT_EQ(s.size(), 3u);
  EXPECT_EQ(s[0].seq, 3u);
  EXPECT_EQ(s[2].seq, 5u);
  EXPECT_EQ(s[2].state, OpState::kTimedOut);
  EXPECT_GT(s[2].finished_at, 0);
  EXPECT_EQ(rec.total_recorded(), 5u);
}

TEST(FlightRecorderTest, JsonEscapesAndDumpsGoToTheFlightDir) {
  FlightEntry e;
  e.seq = 7;
  e.op = "broadcast";
  e.site = "a \"quoted\"\\path.cpp:3";
  e.shape = {2, 3};
  const std::string j = to_json(e);
  EXPECT_NE(j.find("\"seq\": 7"), std::string::npos) << j;
  EXPECT_NE(j.find("a \\\"quoted\\\"\\\\path.cpp:3"), std::string::npos) << j;
  EXPECT_NE(j.find("\"shape\": [2, 3]"), std::string::npos) << j;
  EXPECT_NE(j.find("\"state\": \"issued\""), std::string::npos) << j;
  const auto dir =
      std::filesystem::temp_directory_path() / fmt::format("parallax_flight_test_{}", ::getpid());
  setenv("PARALLAX_FLIGHT_DIR", dir.c_str(), 1);
  const std::string path = write_flight_dump(3, "{\"x\": 1}\n");
  unsetenv("PARALLAX_FLIGHT_DIR");
  EXPECT_EQ(path, (dir / "parallax_flight_3.json").string());
  std::ifstream f(path);
  std::string content((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_EQ(content, "{\"x\": 1}\n");
  std::filesystem::remove_all(dir);
}

TEST(SiteTest, FormatsFileLineAndFunction) {
  const int line = __LINE__ + 1;
  const std::string s = format_site(CallSite::current());
  EXPECT_EQ(s.find(fmt::format("comm/comm_unit_test.cpp:{} (", line)), 0u) << s;
  EXPECT_NE(s.find("TestBody"), std::string::npos) << s;
}

TEST(SingleProcessWorldTest, EveryCompiledCpuBackendWorksWithOneRank) {
  World world;
  EXPECT_EQ(world.rank(), 0);
  EXPECT_EQ(world.size(), 1);
  EXPECT_EQ(&World::current(), &world);
  EXPECT_EQ(resolve_backend("auto", world),
            world.device() && backend_compiled("nccl") ? "nccl" : "mpi");
  std::string err = error_of<ConfigError>([&] { resolve_backend("tcp", world); });
  EXPECT_NE(err.find("unknown backend 'tcp'"), std::string::npos) << err;
  for (const std::string b : {"mpi", "gloo"}) {
    if (!backend_compiled(b)) continue;
    CommPtr c = make_world_communicator(world, b);
    EXPECT_EQ(c->backend(), b);
    at::Tensor t = at::arange(6, at::kFloat);
    c->all_reduce(t, ReduceOp::kAvg);
    c->all_reduce(t, ReduceOp::kSum, AllReduceAlgo::kRing);
    EXPECT_TRUE(at::equal(t, at::arange(6, at::kFloat))) << b;
    at::Tensor out = at::empty({6});
    c->reduce_scatter(t, out, ReduceOp::kSum);
    EXPECT_TRUE(at::equal(out, t)) << b;
    c->all_gather(t, out);
    EXPECT_TRUE(at::equal(out, t)) << b;
    c->barrier();
    CommPtr g = c->split(0, 0, "solo");
    EXPECT_EQ(g->size(), 1);
    EXPECT_EQ(g->name(), "solo");
    EXPECT_EQ(c->split(-1, 0, "none"), nullptr);
  }
}
