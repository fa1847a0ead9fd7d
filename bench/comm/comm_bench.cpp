// comm_bench: bus bandwidth of all_reduce, reduce_scatter and all_gather through Parallax's
// Communicator (native and ring algorithms) against the raw library calls in the same run
// (MPI_Allreduce / MPI_Reduce_scatter_block / MPI_Allgather on CPU; ncclAllReduce /
// ncclReduceScatter / ncclAllGather on GPU). One JSON line per (op, size, impl).
//
// Point-to-point baselines on GPUs (what the ring algorithm is built from), raw NCCL only:
// op `sendrecv` is one ncclSend to the next rank and one ncclRecv from the previous, `bytes` each
// way (busbw = algbw: the bandwidth per direction); impl `raw_ring` is the all_reduce ring written
// directly on ncclSend/ncclRecv, one stream, no columns (the least a ring on send/recv can cost);
// `raw_ring_split` is the same on a blocking communicator split from the raw one (Parallax's data
// path is such a split).
//
//   mpirun -np 4 comm_bench [--backend auto|mpi|gloo|nccl] [--min-bytes 1024] [--max-bytes N]
//          [--step 4] [--ops all_reduce,reduce_scatter,all_gather,sendrecv]
//          [--impls native,ring,raw,raw_ring,raw_ring_split]
//          [--warmup 3] [--min-iters 5] [--max-iters 200] [--target-s 0.3] [--dtype float32]
//          [--ring-chunk 4M] [--nccl-blocking | --nccl-nonblocking]
//
// On GPUs the first line reports the device memory that creating the world communicator took.
//
// Method: per configuration, `warmup` untimed runs, then iterations (each preceded by a barrier
// and timed on the host until the op completed) until min-iters and target-s are both reached or
// max-iters is hit. The reported time is the median over iterations of the slowest rank's time.
// algbw = bytes / time; busbw = algbw x 2(N-1)/N (all_reduce) or (N-1)/N (the others), where
// `bytes` is the full tensor (all_reduce), the input (reduce_scatter) or the output (all_gather).
#include "comm/communicator.h"
#include "comm/factory.h"
#include "comm/world.h"
#include "core/error.h"

#include <ATen/ATen.h>
#include <mpi.h>

#ifdef PARALLAX_WITH_NCCL
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <sstream>
#include <string>
#include <vector>

using namespace parallax::comm;

namespace {

struct Args {
  std::string backend = "auto";
  int64_t min_bytes = 1024;
  int64_t max_bytes = 0;  // 0: 64 MiB on CPU, 1 GiB on GPU
  int step = 4;
  std::vector<std::string> ops = {"all_reduce", "reduce_scatter", "all_gather"};
  std::vector<std::string> impls = {"native", "ring", "raw"};
  int warmup = 3;
  int min_iters = 5;
  int max_iters = 200;
  double target_s = 0.3;
  std::string dtype = "float32";
  int64_t ring_chunk = 0;  // 0: CommOptions' default
  bool nccl_blocking = CommOptions{}.nccl_blocking;
};

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

int64_t parse_bytes(const std::string& s) {
  double v = std::atof(s.c_str());
  char unit = s.empty() ? 0 : s.back();
  if (unit == 'K' || unit == 'k') v *= 1024;
  if (unit == 'M' || unit == 'm') v *= 1024 * 1024;
  if (unit == 'G' || unit == 'g') v *= 1024.0 * 1024 * 1024;
  return static_cast<int64_t>(v);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "comm_bench: %s needs a value\n", k.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (k == "--backend")
      a.backend = next();
    else if (k == "--min-bytes")
      a.min_bytes = parse_bytes(next());
    else if (k == "--max-bytes")
      a.max_bytes = parse_bytes(next());
    else if (k == "--step")
      a.step = std::atoi(next().c_str());
    else if (k == "--ops")
      a.ops = split_list(next());
    else if (k == "--impls")
      a.impls = split_list(next());
    else if (k == "--warmup")
      a.warmup = std::atoi(next().c_str());
    else if (k == "--min-iters")
      a.min_iters = std::atoi(next().c_str());
    else if (k == "--max-iters")
      a.max_iters = std::atoi(next().c_str());
    else if (k == "--target-s")
      a.target_s = std::atof(next().c_str());
    else if (k == "--nccl-blocking")
      a.nccl_blocking = true;
    else if (k == "--nccl-nonblocking")
      a.nccl_blocking = false;
    else if (k == "--ring-chunk")
      a.ring_chunk = parse_bytes(next());
    else if (k == "--dtype")
      a.dtype = next();
    else {
      std::fprintf(stderr,
                   "comm_bench: unknown option %s (see the header of bench/comm/comm_bench.cpp)\n",
                   k.c_str());
      std::exit(2);
    }
  }
  if (a.step < 2) a.step = 2;
  return a;
}

c10::ScalarType dtype_of(const std::string& s) {
  if (s == "float32") return at::kFloat;
  if (s == "bfloat16") return at::kBFloat16;
  if (s == "float16") return at::kHalf;
  std::fprintf(stderr, "comm_bench: --dtype must be float32, bfloat16 or float16\n");
  std::exit(2);
}

double bus_factor(const std::string& op, int n) {
  if (n == 1) return 0.0;
  if (op == "sendrecv") return 1.0;
  return op == "all_reduce" ? 2.0 * (n - 1) / n : double(n - 1) / n;
}

#ifdef PARALLAX_WITH_NCCL
struct RawNccl {
  ncclComm_t comm = nullptr;
  ncclComm_t split = nullptr;  // a blocking split of comm (raw_ring_split)
  ~RawNccl() {
    if (split) ncclCommDestroy(split);
    if (comm) ncclCommDestroy(comm);
  }
};
ncclDataType_t nccl_dtype(c10::ScalarType t) {
  return t == at::kFloat ? ncclFloat32 : t == at::kBFloat16 ? ncclBfloat16 : ncclFloat16;
}
#endif

MPI_Datatype mpi_dtype(c10::ScalarType t) {
  return t == at::kFloat ? MPI_FLOAT : MPI_UINT16_T;
}

// What one measurement works on: the communicator under test and the raw baselines beside it.
struct Bench {
  const Args& args;
  CommPtr comm;
  MPI_Comm raw_comm = MPI_COMM_NULL;
#ifdef PARALLAX_WITH_NCCL
  RawNccl raw_nccl;
#endif
  bool gpu = false;
  int n = 1, rank = 0;
  c10::ScalarType dt = at::kFloat;
  int64_t elem = 4;
  at::TensorOptions opts;
};

// Buffers of one size: the whole tensor, one rank's chunk, and the point-to-point landing buffer.
struct Buffers {
  int64_t numel = 0;
  at::Tensor full, chunk, landing;
};

void sync_device(const Bench& b) {
#ifdef PARALLAX_WITH_NCCL
  if (b.gpu) cudaDeviceSynchronize();
#endif
}

// Max over ranks of a per-rank time (the slowest rank defines the op's time).
double max_over_ranks(const Bench& b, double v) {
  at::Tensor t = at::full({1}, v, at::TensorOptions().dtype(at::kDouble).device(b.opts.device()));
  b.comm->all_reduce(t, ReduceOp::kMax);
  return t.cpu().item<double>();
}

// The call that runs `op` with `impl` on `buf` (empty: the pair is not measured here).
std::function<void()> make_run(Bench& bench, Buffers& buf, const std::string& op,
                               const std::string& impl) {
  // References into `bench` and `buf`, which outlive the returned call (its lambdas capture them).
  const Args& args = bench.args;
  const bool& gpu = bench.gpu;
  const int& n = bench.n;
  const int& rank = bench.rank;
  const c10::ScalarType& dt = bench.dt;
  const at::TensorOptions& opts = bench.opts;
  CommPtr& comm = bench.comm;
  MPI_Comm& raw_comm = bench.raw_comm;
#ifdef PARALLAX_WITH_NCCL
  RawNccl& raw_nccl = bench.raw_nccl;
#endif
  const int64_t& numel = buf.numel;
  at::Tensor& full = buf.full;
  at::Tensor& chunk = buf.chunk;
  at::Tensor& landing = buf.landing;
  (void)args, (void)rank, (void)raw_comm;
  std::function<void()> run;
  if (impl == "native" || impl == "ring") {
    const AllReduceAlgo algo = impl == "ring" ? AllReduceAlgo::kRing : AllReduceAlgo::kNative;
    if (op == "all_reduce") run = [&, algo] { comm->all_reduce(full, ReduceOp::kSum, algo); };
    if (op == "reduce_scatter") run = [&] { comm->reduce_scatter(full, chunk, ReduceOp::kSum); };
    if (op == "all_gather") run = [&] { comm->all_gather(chunk, full); };
  } else if (impl == "raw" && !gpu) {
    const int count = static_cast<int>(numel);
    const MPI_Datatype t = mpi_dtype(dt);
    if (dt != at::kFloat && op != "all_gather") return {};  // MPI cannot add 16-bit floats
    if (op == "all_reduce")
      run = [&, count, t] {
        MPI_Allreduce(MPI_IN_PLACE, full.data_ptr(), count, t, MPI_SUM, raw_comm);
      };
    if (op == "reduce_scatter") {
      run = [&, count, t] {
        MPI_Reduce_scatter_block(full.data_ptr(), chunk.data_ptr(), count / n, t, MPI_SUM,
                                 raw_comm);
      };
    }
    if (op == "all_gather") {
      run = [&, count, t] {
        MPI_Allgather(chunk.data_ptr(), count / n, t, full.data_ptr(), count / n, t, raw_comm);
      };
    }
  } else if (impl == "raw" && gpu) {
#ifdef PARALLAX_WITH_NCCL
    if (!raw_nccl.comm) return {};
    cudaStream_t s = c10::cuda::getCurrentCUDAStream(opts.device().index()).stream();
    const size_t count = static_cast<size_t>(numel);
    const ncclDataType_t t = nccl_dtype(dt);
    if (op == "all_reduce") {
      run = [&, s, count, t] {
        ncclAllReduce(full.data_ptr(), full.data_ptr(), count, t, ncclSum, raw_nccl.comm, s);
        cudaStreamSynchronize(s);
      };
    }
    if (op == "reduce_scatter") {
      run = [&, s, count, t] {
        ncclReduceScatter(full.data_ptr(), chunk.data_ptr(), count / n, t, ncclSum, raw_nccl.comm,
                          s);
        cudaStreamSynchronize(s);
      };
    }
    if (op == "all_gather") {
      run = [&, s, count, t] {
        ncclAllGather(chunk.data_ptr(), full.data_ptr(), count / n, t, raw_nccl.comm, s);
        cudaStreamSynchronize(s);
      };
    }
    if (op == "sendrecv") {
      landing = at::empty_like(full);
      run = [&, s, count, t] {
        ncclGroupStart();
        ncclSend(full.data_ptr(), count, t, (rank + 1) % n, raw_nccl.comm, s);
        ncclRecv(landing.data_ptr(), count, t, (rank + n - 1) % n, raw_nccl.comm, s);
        ncclGroupEnd();
        cudaStreamSynchronize(s);
      };
    }
#else
    return {};
#endif
  } else if (impl == "raw_ring" || impl == "raw_ring_split") {
#ifdef PARALLAX_WITH_NCCL
    ncclComm_t rc = impl == "raw_ring" ? raw_nccl.comm : raw_nccl.split;
    if (!rc) return {};
    cudaStream_t s = c10::cuda::getCurrentCUDAStream(opts.device().index()).stream();
    landing = at::empty({numel / n}, opts);
    run = [&, s, rc] {
      // Reduce-scatter: after step k rank r holds the sum of k+2 contributions to segment
      // (r-k-1) mod n; then all-gather circulates the reduced segments.
      const ncclDataType_t t = nccl_dtype(dt);
      const int64_t seg = numel / n;
      auto at_seg = [&](int i) { return full.narrow(0, ((i % n) + n) % n * seg, seg); };
      for (int k = 0; k < 2 * (n - 1); ++k) {
        const bool rs = k < n - 1;
        const int j = rs ? k : k - (n - 1);
        at::Tensor out = rs ? at_seg(rank - j) : at_seg(rank + 1 - j);
        at::Tensor in = rs ? at_seg(rank - j - 1) : at_seg(rank - j);
        ncclGroupStart();
        ncclSend(out.data_ptr(), static_cast<size_t>(seg), t, (rank + 1) % n, rc, s);
        ncclRecv(rs ? landing.data_ptr() : in.data_ptr(), static_cast<size_t>(seg), t,
                 (rank + n - 1) % n, rc, s);
        ncclGroupEnd();
        if (rs) in.add_(landing);  // on the current stream s, after the transfer
      }
      cudaStreamSynchronize(s);
    };
#else
    return {};
#endif
  }
  return run;
}

// Warm-up, then timed calls until the budget is spent (every rank agrees on when to stop); rank 0
// prints the median as one JSON line.
void time_run(Bench& bench, const Buffers& buf, const std::string& op, const std::string& impl,
              const std::function<void()>& run) {
  const Args& args = bench.args;
  const int64_t numel = buf.numel, elem = bench.elem;
  const int n = bench.n, rank = bench.rank;
  const bool gpu = bench.gpu;
  CommPtr& comm = bench.comm;
  for (int i = 0; i < args.warmup; ++i) run();
  sync_device(bench);
  std::vector<double> times;
  double spent = 0;
  while (static_cast<int>(times.size()) < args.max_iters &&
         (static_cast<int>(times.size()) < args.min_iters || spent < args.target_s)) {
    comm->barrier();
    sync_device(bench);
    const auto t0 = std::chrono::steady_clock::now();
    run();
    sync_device(bench);
    const double dtm = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    spent += dtm;
    // Every rank must agree on whether to continue: use the slowest rank's time.
    times.push_back(max_over_ranks(bench, dtm));
    spent = max_over_ranks(bench, spent);
  }
  std::sort(times.begin(), times.end());
  const double median = times[times.size() / 2];
  const double payload = double(numel * elem);
  const double algbw = payload / median / 1e9;
  if (rank == 0) {
    std::printf(
        "{\"op\": \"%s\", \"impl\": \"%s\", \"backend\": \"%s\", \"ranks\": %d, \"dtype\": "
        "\"%s\", \"bytes\": %lld, "
        "\"iters\": %zu, \"median_us\": %.2f, \"algbw_GBps\": %.4f, \"busbw_GBps\": %.4f}\n",
        op.c_str(), impl == "raw" ? (gpu ? "raw_nccl" : "raw_mpi") : impl.c_str(),
        comm->backend().c_str(), n, args.dtype.c_str(), static_cast<long long>(numel * elem),
        times.size(), median * 1e6, algbw, algbw * bus_factor(op, n));
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  World world;
  CommOptions copts;
  if (args.ring_chunk > 0) copts.ring_chunk_bytes = args.ring_chunk;
  copts.nccl_blocking = args.nccl_blocking;
  // Device memory taken by creating the world communicator (NCCL buffers and streams).
  size_t free_before = 0, free_after = 0;
  [[maybe_unused]] size_t total_mem = 0;
#ifdef PARALLAX_WITH_NCCL
  const bool on_gpu = world.device().has_value() && world.device()->is_cuda();
  if (on_gpu) {
    cudaSetDevice(world.device()->index());
    cudaFree(nullptr);
    cudaMemGetInfo(&free_before, &total_mem);
  }
#endif
  Bench bench{args};
  bench.comm = make_world_communicator(world, args.backend, copts);
  const CommPtr& comm = bench.comm;
#ifdef PARALLAX_WITH_NCCL
  if (on_gpu) cudaMemGetInfo(&free_after, &total_mem);
#endif
  const bool gpu = bench.gpu = comm->device_type() == c10::DeviceType::CUDA;
  const int n = bench.n = comm->size(), rank = bench.rank = comm->rank();
  if (gpu && rank == 0) {
    std::printf("{\"comm_create_MiB\": %.1f, \"nccl_blocking\": %s}\n",
                (double(free_before) - double(free_after)) / double(1 << 20),
                copts.nccl_blocking ? "true" : "false");
    std::fflush(stdout);
  }
  const c10::ScalarType dt = bench.dt = dtype_of(args.dtype);
  const int64_t elem = bench.elem = static_cast<int64_t>(c10::elementSize(dt));
  const int64_t max_bytes =
      args.max_bytes > 0 ? args.max_bytes : (gpu ? (int64_t(1) << 30) : (int64_t(64) << 20));
  const at::TensorOptions opts = bench.opts =
      at::TensorOptions().dtype(dt).device(gpu ? *world.device() : c10::Device(c10::kCPU));
  PARALLAX_CHECK(
      world.has_mpi() ||
          (std::find(args.impls.begin(), args.impls.end(), "raw") == args.impls.end() &&
           std::find(args.impls.begin(), args.impls.end(), "raw_ring") == args.impls.end() &&
           std::find(args.impls.begin(), args.impls.end(), "raw_ring_split") == args.impls.end()),
      parallax::Error, "comm_bench: the raw baseline needs an MPI launch (mpirun)");

  if (world.has_mpi()) MPI_Comm_dup(MPI_COMM_WORLD, &bench.raw_comm);
#ifdef PARALLAX_WITH_NCCL
  RawNccl& raw_nccl = bench.raw_nccl;
  if (gpu && world.has_mpi()) {
    ncclUniqueId id;
    if (rank == 0) ncclGetUniqueId(&id);
    MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
    c10::cuda::CUDAGuard g(*world.device());
    ncclCommInitRank(&raw_nccl.comm, n, id, rank);
    if (std::find(args.impls.begin(), args.impls.end(), "raw_ring_split") != args.impls.end())
      ncclCommSplit(raw_nccl.comm, 0, rank, &raw_nccl.split, nullptr);
  }
#endif

  for (const auto& op : args.ops) {
    for (int64_t bytes = args.min_bytes; bytes <= max_bytes; bytes *= args.step) {
      Buffers buf;
      buf.numel = std::max<int64_t>(n, (bytes / elem / n) * n);  // divisible by N
      buf.full = at::randn({buf.numel}, opts.dtype(at::kFloat)).to(dt);
      buf.chunk = at::empty({buf.numel / n}, opts);
      for (const auto& impl : args.impls) {
        const std::function<void()> run = make_run(bench, buf, op, impl);
        if (run) time_run(bench, buf, op, impl, run);
      }
    }
  }
  bench.comm.reset();
  if (bench.raw_comm != MPI_COMM_NULL) MPI_Comm_free(&bench.raw_comm);
  return 0;
}
