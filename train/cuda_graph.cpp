#include "train/cuda_graph.h"

#include "core/error.h"

#ifdef PARALLAX_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <chrono>
#include <deque>
#include <optional>
#include <thread>
#endif

namespace parallax::train {

#ifdef PARALLAX_WITH_CUDA

struct CudaStepGraph::Impl {
  Impl(c10::Device device, int rank, double timeout_s)
      : device(device),
        rank(rank),
        timeout_s(timeout_s),
        side(c10::cuda::getStreamFromPool(false, device.index())) {
    // The side stream starts after everything queued so far (model initialisation, DDP's
    // broadcast).
    at::cuda::CUDAEvent ready;
    ready.record(c10::cuda::getCurrentCUDAStream(device.index()));
    ready.block(side);
    guard.emplace(side);
  }

  ~Impl() {
    if (hung) {
      // A replay never finished: waiting for it would hang, and destroying a running graph is not
      // allowed. The process is on its way out with the TimeoutError; leave both to it.
      (void)graph.release();
      return;
    }
    // Nothing the graph launched may outlive it (its memory pool goes with it); never throws.
    try {
      side.synchronize();
    } catch (const std::exception&) {
    }
  }

  void wait_for(at::cuda::CUDAEvent& done, int64_t step) {
    using Clock = std::chrono::steady_clock;
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(timeout_s));
    while (!done.query()) {
      if (Clock::now() > deadline) {
        hung = true;
        throw_error<TimeoutError>(
            "rank {}: training step {} (one CUDA graph replay: forward, backward, the gradient "
            "all-reduces and the "
            "optimizer) did not finish within {} s (parallel.timeout_s): a peer rank may have died "
            "or stopped "
            "issuing collectives; run without train.cuda_graph for the per-collective timeout "
            "report",
            rank, step, timeout_s);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  c10::Device device;
  int rank;
  double timeout_s;
  c10::cuda::CUDAStream side;
  std::optional<c10::cuda::CUDAStreamGuard> guard;
  std::unique_ptr<at::cuda::CUDAGraph> graph;
  std::deque<std::pair<int64_t, at::cuda::CUDAEvent>> launched;  // (step, end event), oldest first
  bool hung = false;  // a replay did not finish within timeout_s
};

CudaStepGraph::CudaStepGraph(c10::Device device, int rank, double timeout_s) {
  PARALLAX_CHECK(device.is_cuda(), ConfigError,
                 "key 'train.cuda_graph': needs a CUDA device, the model runs on {}", device.str());
  impl_ = std::make_unique<Impl>(device, rank, timeout_s);
}

CudaStepGraph::~CudaStepGraph() = default;

void CudaStepGraph::capture(const std::function<void()>& body) {
  PARALLAX_CHECK(!impl_->graph, Error, "CudaStepGraph: the step is already captured");
  auto graph = std::make_unique<at::cuda::CUDAGraph>();
  graph->capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
  try {
    body();
  } catch (...) {
    try {
      graph->capture_end();
    } catch (const std::exception&) {
      // The capture was invalidated by the same failure; the original error says why.
    }
    throw;
  }
  graph->capture_end();
  impl_->graph = std::move(graph);
}

bool CudaStepGraph::captured() const {
  return impl_->graph != nullptr;
}

void CudaStepGraph::replay(int64_t step) {
  PARALLAX_CHECK(impl_->graph, Error, "CudaStepGraph: replay() before capture()");
  auto& launched = impl_->launched;
  while (launched.size() >= 2) {
    impl_->wait_for(launched.front().second, launched.front().first);
    launched.pop_front();
  }
  impl_->graph->replay();
  launched.emplace_back(step, at::cuda::CUDAEvent());
  launched.back().second.record(impl_->side);
}

void CudaStepGraph::drain() {
  auto& launched = impl_->launched;
  while (!launched.empty()) {
    impl_->wait_for(launched.front().second, launched.front().first);
    launched.pop_front();
  }
}

#else  // no CUDA

struct CudaStepGraph::Impl {};

CudaStepGraph::CudaStepGraph(c10::Device device, int, double) {
  throw_error<ConfigError>(
      "key 'train.cuda_graph': this build of Parallax has no CUDA (LibTorch without CUDA); "
      "set train.cuda_graph=false");
}

CudaStepGraph::~CudaStepGraph() = default;
void CudaStepGraph::capture(const std::function<void()>&) {}
bool CudaStepGraph::captured() const {
  return false;
}
void CudaStepGraph::replay(int64_t) {}
void CudaStepGraph::drain() {}

#endif

}  // namespace parallax::train
