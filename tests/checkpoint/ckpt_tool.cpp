// Helper program of the Python checkpoint tests (kill_test.py, export_test.py). Subcommands:
//   kill-loop DIR SEED KIB     save steps L+1, L+2, ... forever (L: the latest step, or 0;
//   keep_last 2),
//                              printing "committed N" after each commit; killed by the test at
//                              random times
//   save-once DIR SEED STEP    one save of STEP
//   verify DIR SEED            `latest` must load, verify and equal the state of its step; prints
//                              "OK step N"; exit 1 with the error otherwise
//   make-model RUN_DIR SEED [nan]  a small module (nested names, buffers, an int64 buffer) saved
//                              as RUN_DIR/checkpoints/step_00000003, plus a TP-like sharded model
//                              tensor; RUN_DIR/reference/<name>.bin holds each tensor's raw bytes.
//                              With `nan`: head.weight holds a NaN and head.bias an infinity,
//                              committed as an older Parallax could (allow_nonfinite)
// Runs alone or under mpirun (the state is spread over the ranks).
#include "checkpoint/checkpointer.h"
#include "checkpoint/reader.h"
#include "checkpoint/training_state.h"
#include "comm/world.h"
#include "core/error.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>

using namespace parallax;
using namespace parallax::checkpoint;
namespace fs = std::filesystem;

namespace {

std::pair<int64_t, int64_t> chunk(int64_t n, int parts, int i) {
  const int64_t base = n / parts, rem = n % parts;
  return {i * base + std::min<int64_t>(i, rem), base + (i < rem ? 1 : 0)};
}

// The global state of `step`: every tensor derived from (seed, step).
std::map<std::string, at::Tensor> globals(uint64_t seed, int64_t step, int64_t kib) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed * 7919 + static_cast<uint64_t>(step));
  std::map<std::string, at::Tensor> g;
  g["model/a"] = at::randn({kib * 256}, gen);
  g["model/b"] = at::randn({33, 17}, gen).to(at::kBFloat16);
  g["optim/flat"] = at::randn({kib * 128 + 3}, gen);
  g["optim/step"] = at::full({1}, static_cast<double>(step), at::kDouble);
  return g;
}

at::Tensor rank_tensor(uint64_t seed, int64_t step, int rank) {
  return at::full({8}, static_cast<int64_t>((seed + static_cast<uint64_t>(step * 31 + rank)) % 251),
                  at::kByte);
}

SaveState state_of(uint64_t seed, int64_t step, int64_t kib, int rank, int world) {
  const auto g = globals(seed, step, kib);
  SaveState s;
  for (const char* n : {"model/a", "model/b", "optim/step"}) s.add_replicated(n, g.at(n));
  const auto [o, l] = chunk(g.at("optim/flat").numel(), world, rank);
  s.add_shard("optim/flat", g.at("optim/flat").narrow(0, o, l), {g.at("optim/flat").numel()}, {o});
  s.add_rank_local("sampler", rank_tensor(seed, step, rank));
  s.set_extra("step", step);
  s.set_extra("kib", kib);
  return s;
}

int kill_loop(const std::string& dir, uint64_t seed, int64_t kib, int64_t first_step = 1,
              int64_t last_step = -1) {
  auto& w = comm::World::current();
  CheckpointerOptions o;
  o.keep_last = 2;
  o.timeout_s = 60;
  Checkpointer ck(dir, o);
  for (int64_t step = first_step; last_step < 0 || step <= last_step; ++step) {
    ck.save(step, state_of(seed, step, kib, w.rank(), w.size()));
    if (w.rank() == 0) {
      std::printf("committed %lld\n", static_cast<long long>(step));
      std::fflush(stdout);
    }
  }
  return 0;
}

int verify(const std::string& dir, uint64_t seed) {
  CheckpointReader r(dir);
  const Metadata& m = r.metadata();
  r.verify_all();
  const int64_t step = m.step;
  PARALLAX_CHECK(m.extra_int("step") == step, CheckpointError, "extra step {} != {}",
                 m.extra_int("step"), step);
  const auto g = globals(seed, step, m.extra_int("kib"));
  for (const auto& [n, t] : g) {
    const at::Tensor back = r.read(n);
    PARALLAX_CHECK(back.scalar_type() == t.scalar_type() && at::equal(back, t), CheckpointError,
                   "step {}: tensor '{}' differs from what was saved", step, n);
  }
  for (int q = 0; q < m.world; ++q) {
    PARALLAX_CHECK(at::equal(r.read(rank_local_name(q, "sampler")), rank_tensor(seed, step, q)),
                   CheckpointError, "step {}: per-rank state of rank {} differs", step, q);
  }
  std::printf("OK step %lld\n", static_cast<long long>(step));
  return 0;
}

struct Block : torch::nn::Module {
  Block() {
    fc = register_module("fc", torch::nn::Linear(12, 24));
    norm = register_module("norm", torch::nn::BatchNorm1d(24));
  }
  torch::nn::Linear fc{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
};

struct Model : torch::nn::Module {
  Model() {
    encoder = register_module("encoder", torch::nn::Sequential(torch::nn::Linear(8, 12)));
    block = register_module("block", std::make_shared<Block>());
    head = register_module("head", torch::nn::Linear(24, 5));
  }
  torch::nn::Sequential encoder{nullptr};
  std::shared_ptr<Block> block;
  torch::nn::Linear head{nullptr};
};

int make_model(const std::string& run_dir, uint64_t seed, bool nonfinite) {
  auto& w = comm::World::current();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  Model model;
  {
    at::NoGradGuard g;
    for (auto& p : model.parameters()) p.copy_(at::randn(p.sizes(), gen));
    model.block->norm->running_mean.copy_(at::randn({24}, gen));
    model.block->norm->running_var.copy_(at::rand({24}, gen) + 0.5);
    model.block->norm->num_batches_tracked.fill_(123);
    if (nonfinite) {
      model.head->weight[0][0] = std::numeric_limits<float>::quiet_NaN();
      model.head->bias[1] = std::numeric_limits<float>::infinity();
    }
  }
  const at::Tensor tp = at::randn({10, 6}, gen);  // a tensor-parallel weight, split along dim 0
  SaveState s;
  add_module(s, model);
  const auto [o, l] = chunk(10, w.size(), w.rank());
  s.add_shard("model/tp_proj.weight", tp.narrow(0, o, l), {10, 6}, {o, 0});
  s.set_extra("seed", static_cast<int64_t>(seed));
  CheckpointerOptions opts;
  opts.allow_nonfinite = nonfinite;
  Checkpointer ck((fs::path(run_dir) / "checkpoints").string(), opts);
  ck.save(3, s);
  if (w.rank() == 0) {
    fs::create_directories(fs::path(run_dir) / "reference");
    auto dump = [&](const std::string& name, const at::Tensor& t) {
      const at::Tensor c = t.contiguous();
      std::ofstream out(fs::path(run_dir) / "reference" / (name + ".bin"), std::ios::binary);
      out.write(static_cast<const char*>(c.const_data_ptr()),
                static_cast<std::streamsize>(c.nbytes()));
    };
    for (const auto& p : model.named_parameters()) dump(p.key(), p.value());
    for (const auto& b : model.named_buffers()) dump(b.key(), b.value());
    dump("tp_proj.weight", tp);
  }
  return 0;
}

int usage() {
  std::fprintf(
      stderr,
      "usage: ckpt_tool kill-loop DIR SEED KIB | save-once DIR SEED STEP | verify DIR SEED | "
      "make-model RUN_DIR SEED [nan]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) return usage();
  const std::string cmd = argv[1], dir = argv[2];
  const uint64_t seed = std::stoull(argv[3]);
  try {
    if (cmd == "verify") return verify(dir, seed);
    comm::World world;
    if (cmd == "kill-loop" && argc == 5) {
      // Resume after the last committed step, as a restarted job would.
      const auto latest = latest_checkpoint(dir);
      const int64_t first = latest ? CheckpointReader(*latest).metadata().step + 1 : 1;
      return kill_loop(dir, seed, std::stoll(argv[4]), first);
    }
    if (cmd == "save-once" && argc == 5)
      return kill_loop(dir, seed, 4, std::stoll(argv[4]), std::stoll(argv[4]));
    if (cmd == "make-model")
      return make_model(dir, seed, argc == 5 && std::string(argv[4]) == "nan");
    return usage();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ckpt_tool: error: %s\n", e.what());
    return 1;
  }
}
