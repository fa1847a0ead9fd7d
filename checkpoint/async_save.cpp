#include "checkpoint/async_save.h"

#include "checkpoint/format.h"

#include <ATen/ATen.h>
#include <ATen/DeviceAccelerator.h>

#include <iterator>
#include <set>

namespace parallax::checkpoint {

AsyncSaveWorker::~AsyncSaveWorker() {
  if (thread_.joinable()) thread_.join();
}

SaveJob AsyncSaveWorker::snapshot(SaveJob job) {
  std::set<c10::DeviceIndex> devices;
  for (OwnedEntry& e : job.entries) {
    const at::Tensor& src = e.tensor;
    // By dataset, not name: a rank's pieces of one tensor each need their own buffer.
    at::Tensor& buf = snapshots_[piece_dataset(e.name, e.piece)];
    const bool pinned = src.is_cuda();
    if (!buf.defined() || buf.sizes() != src.sizes() || buf.scalar_type() != src.scalar_type() ||
        (pinned && !buf.is_pinned())) {
      buf = at::empty(src.sizes(),
                      at::TensorOptions().dtype(src.scalar_type()).pinned_memory(pinned));
    }
    buf.copy_(src, /*non_blocking=*/pinned);
    if (src.is_cuda()) devices.insert(src.device().index());
    e.tensor = buf;
  }
  for (const auto d : devices) at::accelerator::synchronizeDevice(d);
  // Drop buffers of entries this save no longer has.
  std::set<std::string> names;
  for (const auto& e : job.entries) names.insert(piece_dataset(e.name, e.piece));
  for (auto it = snapshots_.begin(); it != snapshots_.end();) {
    it = names.count(it->first) ? std::next(it) : snapshots_.erase(it);
  }
  return job;
}

void AsyncSaveWorker::start(SaveJob job, std::function<SaveStats(SaveJob&)> save) {
  running_ = true;
  done_ = false;
  thread_ = std::thread([this, job = std::move(job), save = std::move(save)]() mutable {
    try {
      stats_ = save(job);
    } catch (...) {
      error_ = std::current_exception();
    }
    done_ = true;
  });
}

std::optional<SaveStats> AsyncSaveWorker::join() {
  if (!running_) return std::nullopt;
  thread_.join();
  running_ = false;
  done_ = false;
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
  return stats_;
}

}  // namespace parallax::checkpoint
