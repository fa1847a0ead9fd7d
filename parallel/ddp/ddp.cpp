#include "parallel/ddp/ddp.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <map>

namespace parallax::parallel::ddp {

namespace {

void broadcast_coalesced(comm::Communicator& group, std::vector<at::Tensor> tensors) {
  if (group.size() == 1) return;
  // One flat broadcast per (dtype, device); the key is a string because c10::Device has no order.
  std::map<std::string, std::vector<at::Tensor>> groups;
  for (auto& t : tensors) {
    if (t.defined() && t.numel() > 0)
      groups[fmt::format("{}/{}", c10::toString(t.scalar_type()), t.device().str())].push_back(t);
  }
  for (auto& [key, list] : groups) {
    std::vector<at::Tensor> flat_parts;
    for (auto& t : list) flat_parts.push_back(t.detach().reshape({-1}));
    at::Tensor flat = at::cat(flat_parts);
    group.broadcast(flat, 0);
    int64_t off = 0;
    for (auto& t : list) {
      t.detach().copy_(flat.narrow(0, off, t.numel()).view(t.sizes()));
      off += t.numel();
    }
  }
}

}  // namespace

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<torch::nn::Module> module,
                                                 comm::CommPtr dp_group, DdpOptions options)
    : GradBuckets(std::move(module), std::move(dp_group), std::move(options)) {
  // Identical replicas: parameters and buffers from rank 0.
  broadcast_module(*module_, *group_);
}

void DistributedDataParallel::before_forward() {
  if (options_.broadcast_buffers) broadcast_buffers(*module_, *group_);
}

void broadcast_module(torch::nn::Module& module, comm::Communicator& group) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> all;
  for (auto& p : module.parameters()) all.push_back(p);
  for (auto& b : module.buffers()) all.push_back(b);
  broadcast_coalesced(group, all);
}

void broadcast_buffers(torch::nn::Module& module, comm::Communicator& group) {
  if (group.size() == 1) return;
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> bufs;
  for (auto& b : module.buffers()) bufs.push_back(b);
  if (!bufs.empty()) broadcast_coalesced(group, bufs);
}

}  // namespace parallax::parallel::ddp
