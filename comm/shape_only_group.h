// A communicator with a size and a rank and nothing else (comm/): the model's
// tensor-parallel layers take their shard shapes from it at construction, as PyTorch's
// FakeProcessGroup serves shape-only tracing. `parallax plan` builds its shape-only models over
// one (train/run.h, Purpose::kPlan). Any collective is an error: nobody runs such a model.
#pragma once

#include "comm/communicator.h"
#include "core/error.h"

#include <memory>
#include <string>
#include <vector>

namespace parallax::comm {

class ShapeOnlyGroup : public Communicator {
 public:
  ShapeOnlyGroup(int size, int rank)
      : size_(size), rank_(rank), ranks_(static_cast<std::size_t>(size)) {
    for (int i = 0; i < size; ++i) ranks_[static_cast<std::size_t>(i)] = i;
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  const std::vector<int>& world_ranks() const override { return ranks_; }
  std::string backend() const override { return "shape-only"; }
  c10::DeviceType device_type() const override { return c10::DeviceType::CPU; }
  const CommOptions& options() const override { return options_; }
  const CommStats& stats() const override { return stats_; }
  WorkPtr all_reduce_async(at::Tensor&, ReduceOp, CallSite) override { fail(); }
  WorkPtr all_reduce_async(at::Tensor&, ReduceOp, AllReduceAlgo, CallSite) override { fail(); }
  WorkPtr reduce_scatter_async(const at::Tensor&, at::Tensor&, ReduceOp, CallSite) override {
    fail();
  }
  WorkPtr all_gather_async(const at::Tensor&, at::Tensor&, CallSite) override { fail(); }
  WorkPtr all_gather_async(const at::Tensor&, std::vector<at::Tensor>&, CallSite) override {
    fail();
  }
  WorkPtr broadcast_async(at::Tensor&, int, CallSite) override { fail(); }
  WorkPtr send_async(const at::Tensor&, int, int, CallSite) override { fail(); }
  WorkPtr recv_async(at::Tensor&, int, int, CallSite) override { fail(); }
  WorkPtr barrier_async(BarrierKind, CallSite) override { fail(); }
  std::shared_ptr<Communicator> split(int, int, const std::string&, CallSite) override { fail(); }

 private:
  [[noreturn]] static void fail() {
    throw_error<Error>("the shape-only tensor-parallel group (parallax plan) runs no collective");
  }
  int size_, rank_;
  std::vector<int> ranks_;
  std::string name_ = "tp (shape only)";
  CommOptions options_;
  CommStats stats_;
};

}  // namespace parallax::comm
