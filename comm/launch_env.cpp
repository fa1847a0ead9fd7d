// How this process was launched (world.h: detect_launch): rank, world size, local rank and the
// rendezvous address read from OpenMPI's, torchrun's (and `parallax launch`'s) or Slurm's
// environment, each variable checked and named in the error when malformed or missing.
#include "comm/world.h"

#include "core/error.h"

#include <fmt/format.h>

#include <charconv>
#include <cstdlib>
#include <cstring>

namespace parallax::comm {

const char* to_string(Launcher launcher) {
  switch (launcher) {
    case Launcher::kSingle:
      return "single process";
    case Launcher::kOpenMpi:
      return "OpenMPI";
    case Launcher::kTorchrun:
      return "torchrun";
    case Launcher::kSlurm:
      return "Slurm";
  }
  return "?";
}

std::string LaunchInfo::describe() const {
  std::string s = fmt::format("{}: rank {}/{}, local rank {}/{}", to_string(launcher), rank,
                              world_size, local_rank, local_world_size);
  if (use_mpi) return s + ", rendezvous through MPI";
  return s + fmt::format(", store {}:{}{}", master_addr, master_port,
                         agent_store ? " (agent store)" : "");
}

namespace {

class EnvReader {
 public:
  explicit EnvReader(const GetEnv& getenv) : getenv_(getenv) {}

  bool has(const char* name) const {
    const char* v = get(name);
    return v && *v;
  }
  const char* get(const char* name) const { return getenv_ ? getenv_(name) : std::getenv(name); }
  std::string str(const char* name, const std::string& fallback = "") const {
    const char* v = get(name);
    return v && *v ? std::string(v) : fallback;
  }
  // Integer variable; `fallback` when unset; CommError naming the variable when malformed.
  int integer(const char* name, std::optional<int> fallback, const char* launcher) const {
    const char* v = get(name);
    if (!v || !*v) {
      if (fallback) return *fallback;
      throw_error<CommError>(
          "{} launch: environment variable {} is not set (needed to know this process's place "
          "in the job)",
          launcher, name);
    }
    int out = 0;
    const char* end = v + std::strlen(v);
    auto [ptr, ec] = std::from_chars(v, end, out);
    if (ec != std::errc() || ptr != end) {
      throw_error<CommError>("{} launch: environment variable {}='{}' is not an integer", launcher,
                             name, v);
    }
    return out;
  }

 private:
  const GetEnv& getenv_;
};

void validate(const LaunchInfo& info, const char* what) {
  PARALLAX_CHECK(info.world_size >= 1, CommError, "{} launch: world size {} must be at least 1",
                 what, info.world_size);
  PARALLAX_CHECK(info.rank >= 0 && info.rank < info.world_size, CommError,
                 "{} launch: rank {} is outside the world of {} ranks", what, info.rank,
                 info.world_size);
  PARALLAX_CHECK(
      info.local_world_size >= 1 && info.local_rank >= 0 && info.local_rank < info.local_world_size,
      CommError, "{} launch: local rank {} is outside the {} local ranks", what, info.local_rank,
      info.local_world_size);
}

void read_master(const EnvReader& env, LaunchInfo& info, const char* what) {
  info.master_addr = env.str("MASTER_ADDR");
  info.master_port =
      env.integer("MASTER_PORT", info.world_size == 1 ? std::optional<int>(0) : std::nullopt, what);
  if (info.master_addr.empty()) {
    PARALLAX_CHECK(info.world_size == 1, CommError,
                   "{} launch without MPI: MASTER_ADDR is not set (rank {} of {} needs the address "
                   "of rank 0's "
                   "TCPStore; set MASTER_ADDR and MASTER_PORT)",
                   what, info.rank, info.world_size);
    info.master_addr = "127.0.0.1";
  }
  PARALLAX_CHECK(info.master_port >= 0 && info.master_port < 65536, CommError,
                 "{} launch: MASTER_PORT={} is not a TCP port", what, info.master_port);
}

}  // namespace

LaunchInfo detect_launch(const GetEnv& getenv) {
  EnvReader env(getenv);
  LaunchInfo info;
  if (env.has("OMPI_COMM_WORLD_SIZE")) {
    const char* w = "OpenMPI";
    info.launcher = Launcher::kOpenMpi;
    info.world_size = env.integer("OMPI_COMM_WORLD_SIZE", std::nullopt, w);
    info.rank = env.integer("OMPI_COMM_WORLD_RANK", std::nullopt, w);
    info.local_rank = env.integer("OMPI_COMM_WORLD_LOCAL_RANK", 0, w);
    info.local_world_size = env.integer("OMPI_COMM_WORLD_LOCAL_SIZE", 1, w);
    info.use_mpi = true;
    validate(info, w);
    return info;
  }
  if (env.has("RANK") && env.has("WORLD_SIZE")) {
    const char* w = "torchrun";
    info.launcher = Launcher::kTorchrun;
    info.rank = env.integer("RANK", std::nullopt, w);
    info.world_size = env.integer("WORLD_SIZE", std::nullopt, w);
    info.local_rank = env.integer("LOCAL_RANK", info.rank, w);
    info.local_world_size = env.integer("LOCAL_WORLD_SIZE", info.world_size, w);
    info.use_mpi = false;
    info.agent_store = env.str("TORCHELASTIC_USE_AGENT_STORE") == "True";
    read_master(env, info, w);
    validate(info, w);
    return info;
  }
  if (env.has("SLURM_PROCID") && env.has("SLURM_NTASKS")) {
    const char* w = "Slurm";
    info.launcher = Launcher::kSlurm;
    info.rank = env.integer("SLURM_PROCID", std::nullopt, w);
    info.world_size = env.integer("SLURM_NTASKS", std::nullopt, w);
    info.local_rank = env.integer("SLURM_LOCALID", 0, w);
    // SLURM_NTASKS_PER_NODE can read "4" or "4(x2)"; SLURM_STEP_TASKS_PER_NODE likewise.
    std::string per_node = env.str("SLURM_NTASKS_PER_NODE", env.str("SLURM_STEP_TASKS_PER_NODE"));
    info.local_world_size = std::max(1, info.local_rank + 1);
    if (!per_node.empty()) {
      int n = 0;
      auto [ptr, ec] = std::from_chars(per_node.data(), per_node.data() + per_node.size(), n);
      if (ec == std::errc() && n > info.local_rank) info.local_world_size = n;
    }
    info.use_mpi = env.has("PMIX_RANK") || env.has("PMI_RANK");
    if (!info.use_mpi) read_master(env, info, w);
    validate(info, w);
    return info;
  }
  info.launcher = Launcher::kSingle;
  info.use_mpi = env.str("PARALLAX_MPI", "1") != "0";
  return info;
}

}  // namespace parallax::comm
