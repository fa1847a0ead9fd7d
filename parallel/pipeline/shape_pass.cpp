#include "parallel/pipeline/shape_pass.h"

#include "core/error.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/core/Generator.h>

#include <fmt/format.h>

#include <mutex>

namespace parallax::parallel::pipeline {

namespace {

// RAII: the random state of the CPU and of `device`, and the module's buffers, put back.
class SideEffectGuard {
 public:
  SideEffectGuard(torch::nn::Module& module, c10::Device device) {
    gens_.push_back(at::globalContext().defaultGenerator(c10::Device(c10::kCPU)));
    if (device.type() != c10::kCPU) gens_.push_back(at::globalContext().defaultGenerator(device));
    for (auto& g : gens_) {
      std::lock_guard<std::mutex> lock(g.mutex());
      states_.push_back(g.get_state());
    }
    for (auto& item : module.named_buffers()) {
      if (!item.value().defined()) continue;
      buffers_.push_back(item.value());
      saved_.push_back(item.value().clone());
    }
  }
  ~SideEffectGuard() {
    at::NoGradGuard no_grad;
    for (std::size_t k = 0; k < gens_.size(); ++k) {
      std::lock_guard<std::mutex> lock(gens_[k].mutex());
      gens_[k].set_state(states_[k]);
    }
    for (std::size_t k = 0; k < buffers_.size(); ++k) buffers_[k].copy_(saved_[k]);
  }

 private:
  std::vector<at::Generator> gens_;
  std::vector<at::Tensor> states_, buffers_, saved_;
};

at::Tensor to_device(const at::Tensor& t, c10::Device device) {
  at::Tensor c = t.detach();
  if (c.device() != device) c = c.to(device);
  return c.contiguous();
}

// The shapes of stage `s`'s outputs. Error: no tensors, too many, or one undefined or of too many
// dimensions.
MessageShape shape_of_outputs(int s, const std::vector<at::Tensor>& out) {
  PARALLAX_CHECK(!out.empty() && static_cast<int>(out.size()) <= kMaxMessageTensors, Error,
                 "pipeline: stage {} returned {} tensors (1 to {} cross a stage boundary)", s,
                 out.size(), kMaxMessageTensors);
  MessageShape shape;
  for (const auto& t : out) {
    PARALLAX_CHECK(t.defined() && t.dim() <= kMaxMessageDims, Error,
                   "pipeline: stage {} returns {} (defined tensors of at most {} dimensions "
                   "cross a stage boundary)",
                   s, t.defined() ? fmt::format("a {}-d tensor", t.dim()) : "an undefined tensor",
                   kMaxMessageDims);
    shape.push_back({t.scalar_type(), t.sizes().vec()});
  }
  return shape;
}

}  // namespace

std::map<int, MessageShape> infer_activation_shapes(
    const Schedule& schedule, comm::Communicator& pp, torch::nn::Module& module,
    c10::Device comm_device, c10::Device model_device, const StageForward& forward) {
  const int last = schedule.stages() - 1;
  const int me = pp.rank();
  SideEffectGuard guard(module, model_device);
  at::NoGradGuard no_grad;
  const auto context = [&](Error& e, int s, bool sending) {
    e.add_context(fmt::format(
        "the pipeline's shape pass (micro-batch 0 through every stage, before the first step): "
        "stage {} (pipeline rank {}) {} the activations of stage {} {} pipeline rank {}",
        sending ? s : s + 1, me, sending ? "sending" : "receiving", s, sending ? "to" : "from",
        schedule.rank_of(sending ? s + 1 : s)));
  };
  std::map<int, MessageShape> shapes;
  std::vector<at::Tensor> received;  // the input of this rank's next stage
  for (int s = 0; s < last; ++s) {
    if (schedule.rank_of(s) == me) {
      std::vector<at::Tensor> out = forward(s, received);
      const MessageShape shape = shape_of_outputs(s, out);
      shapes[s] = shape;
      const int peer = schedule.rank_of(s + 1);
      try {
        at::Tensor hdr = to_device(make_header(s, 0, shape), comm_device);
        pp.send_async(hdr, peer, 1)->wait();
        for (std::size_t k = 0; k < out.size(); ++k) {
          at::Tensor t = to_device(out[k], comm_device);
          pp.send_async(t, peer, 2 + static_cast<int>(k))->wait();
        }
      } catch (Error& e) {
        context(e, s, true);
        throw;
      }
      received.clear();
    }
    if (schedule.rank_of(s + 1) == me) {
      const int peer = schedule.rank_of(s);
      MessageShape shape;
      received.clear();
      try {
        at::Tensor hdr = to_device(at::zeros({kHeaderLength}, at::kLong), comm_device);
        pp.recv_async(hdr, peer, 1)->wait();
        const Header h = read_header(hdr.cpu());
        PARALLAX_CHECK(h.valid && h.stage == s, Error,
                       "pipeline: stage {} (rank {}) expected the shapes of stage {}'s activations "
                       "from pipeline rank {} and received something else (a plan mismatch "
                       "between the ranks)",
                       s + 1, me, s, peer);
        for (std::size_t k = 0; k < h.shape.size(); ++k) {
          const TensorMeta& m = h.shape[k];
          at::Tensor t = at::empty(m.shape, at::TensorOptions().dtype(m.dtype).device(comm_device));
          pp.recv_async(t, peer, 2 + static_cast<int>(k))->wait();
          received.push_back(t.device() == model_device ? t : t.to(model_device));
          shape.push_back(m);
        }
      } catch (Error& e) {
        context(e, s, false);
        throw;
      }
      shapes[s] = shape;
    }
  }
  return shapes;
}

}  // namespace parallax::parallel::pipeline
