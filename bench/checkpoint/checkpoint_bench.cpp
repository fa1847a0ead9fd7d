// Checkpoint throughput and host memory: saves and loads a DDP-like (or ZeRO-like) training state
// and prints one JSON line per repetition.
//
//   mpirun -np N checkpoint_bench [--state-mb 1024] [--tensors 96] [--mode ddp|zero] [--async]
//                                 [--repeat 3] [--dir DIR] [--block-mb 64] [--keep] [--no-verify]
//
// State: a model of state_mb / 3 in `tensors` tensors of varied sizes, plus AdamW's exp_avg and
// exp_avg_sq. ddp: everything replicated on every rank (each rank writes ~1/N of it); zero: the
// optimizer state is sharded over the ranks as flat tensors (ZeRO-1). Each rank holds its state in
// memory before the save (that is training memory, not checkpoint overhead); peak RSS is measured
// from a reset high-water mark (/proc/self/clear_refs) during the save and the load, and reported
// next to the RSS before them. Loads read into the existing tensors, as a resume does: ddp ranks
// read the whole state, zero ranks the model plus their shards. "cold" loads first drop the
// checkpoint's pages from the page cache (posix_fadvise DONTNEED), "warm" ones do not.
// Throughput per rank = bytes this rank wrote (read) / wall time of the whole save (load) on that
// rank, including the commit; the JSON reports the slowest rank.
#include "checkpoint/checkpointer.h"
#include "checkpoint/reader.h"
#include "comm/factory.h"
#include "core/error.h"
#include "core/timer.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>

#include <fcntl.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

using namespace parallax;
namespace fs = std::filesystem;
namespace comm = parallax::comm;

namespace {

constexpr const char* kUsage =
    "usage: mpirun -np N checkpoint_bench [--state-mb 1024] [--tensors 96] [--mode ddp|zero]\n"
    "                                     [--async] [--repeat 3] [--dir DIR] [--block-mb 64]\n"
    "                                     [--keep] [--no-verify]\n"
    "\n"
    "Saves and loads a training state (a model of state_mb / 3 in `tensors` tensors, plus AdamW's\n"
    "two moments) and prints one JSON line per repetition: save and load GiB/s of the slowest\n"
    "rank, the RSS before the save and the peak RSS during save and load.\n"
    "\n"
    "  --state-mb MB    state per rank in MiB (default 1024)\n"
    "  --tensors N     model tensors, of varied sizes (default 96)\n"
    "  --mode M        ddp: everything replicated (each rank writes ~1/N); zero: the optimizer\n"
    "                  state sharded over the ranks as flat ranges (ZeRO-1) (default ddp)\n"
    "  --async         save in a background thread (checkpoint.async)\n"
    "  --repeat N      repetitions, one JSON line each (default 3)\n"
    "  --dir DIR       where the checkpoints go (default: <tmp>/parallax_ckpt_bench, removed)\n"
    "  --block-mb MB   largest block written at once (default 64)\n"
    "  --keep          keep the checkpoints afterwards\n"
    "  --no-verify     loads skip the checksums\n"
    "  --help          this text\n"
    "\n"
    "example: mpirun -np 2 checkpoint_bench --state-mb 1024 --mode ddp (docs/checkpoints.md)\n";

struct Options {
  bool help = false;
  double state_mb = 1024;
  int tensors = 96;
  std::string mode = "ddp";
  bool async = false;
  int repeat = 3;
  std::string dir;
  double block_mb = 64;
  bool keep = false;
  bool verify = true;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw_error<UsageError>("{} needs a value", a);
      return argv[++i];
    };
    if (a == "--help" || a == "-h")
      o.help = true;
    else if (a == "--state-mb")
      o.state_mb = std::stod(next());
    else if (a == "--tensors")
      o.tensors = std::stoi(next());
    else if (a == "--mode")
      o.mode = next();
    else if (a == "--async")
      o.async = true;
    else if (a == "--repeat")
      o.repeat = std::stoi(next());
    else if (a == "--dir")
      o.dir = next();
    else if (a == "--block-mb")
      o.block_mb = std::stod(next());
    else if (a == "--keep")
      o.keep = true;
    else if (a == "--no-verify")
      o.verify = false;
    else
      throw_error<UsageError>("unknown option '{}' (see checkpoint_bench --help)", a);
  }
  if (o.mode != "ddp" && o.mode != "zero") throw_error<UsageError>("--mode must be ddp or zero");
  return o;
}

// kB fields of /proc/self/status.
double status_mb(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) return std::stod(line.substr(std::strlen(key))) / 1024.0;
  }
  return -1;
}

bool reset_peak_rss() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  return static_cast<bool>(out);
}

void drop_page_cache(const std::string& dir) {
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    const int fd = ::open(e.path().c_str(), O_RDONLY);
    if (fd < 0) continue;
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

// The state one rank saves and loads: the model (replicated), and the optimizer's moments
// (replicated under ddp, one flat shard per rank under zero).
struct BenchState {
  std::vector<at::Tensor> params, m, v;
  at::Tensor flat_m, flat_v;
  int64_t shard_off = 0;
  checkpoint::SaveState state;
  // What a load reads back into the live tensors.
  std::vector<checkpoint::LoadTarget> targets(const Options& opt);
};

std::vector<checkpoint::LoadTarget> BenchState::targets(const Options& opt) {
  std::vector<checkpoint::LoadTarget> targets;
  for (int i = 0; i < opt.tensors; ++i) {
    targets.push_back({fmt::format("model/layer{}.weight", i), params[static_cast<size_t>(i)], {}});
    if (opt.mode == "ddp") {
      targets.push_back(
          {fmt::format("optim/layer{}.weight.exp_avg", i), m[static_cast<size_t>(i)], {}});
      targets.push_back(
          {fmt::format("optim/layer{}.weight.exp_avg_sq", i), v[static_cast<size_t>(i)], {}});
    }
  }
  if (opt.mode == "zero") {
    targets.push_back({"optim/flat.exp_avg", flat_m, {shard_off}});
    targets.push_back({"optim/flat.exp_avg_sq", flat_v, {shard_off}});
  }
  return targets;
}

BenchState make_state(const Options& opt, int rank, int n) {
  BenchState bs;
  // Tensor sizes: a geometric spread (like a transformer's mix of big matrices and small
  // vectors), scaled so the model totals state_mb / 3.
  const double model_bytes = opt.state_mb * 1024 * 1024 / 3;
  std::vector<double> w;
  double wsum = 0;
  for (int i = 0; i < opt.tensors; ++i) {
    w.push_back(std::pow(0.93, i % 48) * (i % 3 == 2 ? 0.01 : 1.0));
    wsum += w.back();
  }
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
  std::vector<at::Tensor>& params = bs.params;
  std::vector<at::Tensor>& m = bs.m;
  std::vector<at::Tensor>& v = bs.v;
  for (int i = 0; i < opt.tensors; ++i) {
    const int64_t numel = std::max<int64_t>(1, static_cast<int64_t>(model_bytes * w[i] / wsum / 4));
    params.push_back(at::randn({numel}, gen));
    if (opt.mode == "ddp") {
      m.push_back(at::randn({numel}, gen));
      v.push_back(at::rand({numel}, gen));
    }
  }
  int64_t model_numel = 0;
  for (const auto& p : params) model_numel += p.numel();
  const int64_t shard = (model_numel + n - 1) / n;
  const int64_t shard_off = bs.shard_off = std::min<int64_t>(model_numel, shard * rank);
  const int64_t shard_len = std::min<int64_t>(shard, model_numel - shard_off);
  at::Tensor& flat_m = bs.flat_m;
  at::Tensor& flat_v = bs.flat_v;
  if (opt.mode == "zero") {
    flat_m = at::randn({shard_len}, gen);
    flat_v = at::rand({shard_len}, gen);
  }
  checkpoint::SaveState& state = bs.state;
  for (int i = 0; i < opt.tensors; ++i) {
    state.add_replicated(fmt::format("model/layer{}.weight", i), params[static_cast<size_t>(i)]);
    if (opt.mode == "ddp") {
      state.add_replicated(fmt::format("optim/layer{}.weight.exp_avg", i),
                           m[static_cast<size_t>(i)]);
      state.add_replicated(fmt::format("optim/layer{}.weight.exp_avg_sq", i),
                           v[static_cast<size_t>(i)]);
    }
  }
  if (opt.mode == "zero") {
    state.add_shard("optim/flat.exp_avg", flat_m, {model_numel}, {shard_off});
    state.add_shard("optim/flat.exp_avg_sq", flat_v, {model_numel}, {shard_off});
  }
  return bs;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options opt = parse(argc, argv);
    if (opt.help) {
      std::fputs(kUsage, stdout);
      return 0;
    }
    comm::World world;
    comm::CommPtr wc = comm::make_world_communicator(world, "mpi");
    const int rank = world.rank(), n = world.size();
    std::string dir = opt.dir;
    if (dir.empty()) dir = (fs::temp_directory_path() / "parallax_ckpt_bench").string();
    if (rank == 0) fs::remove_all(dir);
    wc->barrier();

    BenchState bs = make_state(opt, rank, n);
    checkpoint::SaveState& state = bs.state;
    checkpoint::CheckpointerOptions co;
    co.async = opt.async;
    co.keep_last = 1;
    co.block_bytes = static_cast<int64_t>(opt.block_mb * 1024 * 1024);
    checkpoint::Checkpointer ck(dir, co);
    const double state_mb = static_cast<double>(state.nbytes()) / (1024.0 * 1024.0);

    for (int rep = 0; rep < opt.repeat; ++rep) {
      wc->barrier();
      const double rss_before_save = status_mb("VmRSS:");
      const bool hwm_ok = reset_peak_rss();
      core::Stopwatch sw;
      ck.save(rep + 1, state);
      const double blocking_s = sw.elapsed_s();
      ck.wait();
      const double save_s = sw.elapsed_s();
      const double peak_save = status_mb("VmHWM:");
      const double wrote = static_cast<double>(ck.last_save()->bytes);
      wc->barrier();

      // Loads into the live tensors: warm (page cache) and cold (pages dropped first).
      double load_s[2] = {0, 0}, peak_load = 0, read_bytes = 0;
      for (int cold = 0; cold < 2; ++cold) {
        if (cold) drop_page_cache(ck.last_save()->path);
        wc->barrier();
        reset_peak_rss();
        core::Stopwatch lw;
        checkpoint::CheckpointReader reader(ck.last_save()->path);
        std::vector<checkpoint::LoadTarget> targets = bs.targets(opt);
        checkpoint::ReadOptions ro;
        ro.verify = opt.verify;
        reader.load(targets, ro);
        load_s[cold] = lw.elapsed_s();
        peak_load = std::max(peak_load, status_mb("VmHWM:"));
        read_bytes = static_cast<double>(reader.stats().bytes_read);
        wc->barrier();
      }
      // Slowest rank / largest memory over the world.
      at::Tensor mx = at::tensor(
          {save_s, blocking_s, load_s[0], load_s[1], peak_save, peak_load, rss_before_save, wrote,
           -wrote / save_s, -read_bytes / load_s[0], -read_bytes / load_s[1]},
          at::kDouble);
      wc->all_reduce(mx, comm::ReduceOp::kMax);
      const auto x = mx.accessor<double, 1>();
      if (rank == 0) {
        const double gib = 1024.0 * 1024.0 * 1024.0;
        std::printf(
            "{\"bench\": \"checkpoint\", \"mode\": \"%s\", \"async\": %s, \"world\": %d, \"rep\": "
            "%d, "
            "\"state_mb_per_rank\": %.1f, \"max_rank_write_mb\": %.1f, \"save_s\": %.3f, "
            "\"save_blocking_s\": %.3f, "
            "\"save_gib_s_per_rank\": %.3f, \"load_warm_s\": %.3f, \"load_cold_s\": %.3f, "
            "\"load_warm_gib_s_per_rank\": %.3f, \"load_cold_gib_s_per_rank\": %.3f, "
            "\"read_mb_per_rank\": %.1f, "
            "\"rss_before_mb\": %.1f, \"peak_rss_save_mb\": %.1f, \"peak_rss_load_mb\": %.1f, "
            "\"save_rss_overhead_mb\": %.1f, \"peak_rss_valid\": %s, \"block_mb\": %.0f, "
            "\"verify\": %s}\n",
            opt.mode.c_str(), opt.async ? "true" : "false", n, rep, state_mb,
            x[7] / (1024.0 * 1024.0), x[0], x[1], -x[8] / gib, x[2], x[3], -x[9] / gib,
            -x[10] / gib, read_bytes / (1024.0 * 1024.0), x[6], x[4], x[5], x[4] - x[6],
            hwm_ok ? "true" : "false", opt.block_mb, opt.verify ? "true" : "false");
        std::fflush(stdout);
      }
    }
    wc->barrier();
    if (rank == 0 && !opt.keep) fs::remove_all(dir);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "checkpoint_bench: error: %s\n", e.what());
    return 1;
  }
}
