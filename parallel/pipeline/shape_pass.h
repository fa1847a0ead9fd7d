// The pipeline's shape pass: before the first step, micro-batch 0 runs through the stages in
// order (no autograd; the module's buffers and the random state put back after), as
// torch.distributed.pipelining's shape inference does, so both ends of every stage boundary know
// its messages' shapes (parallel/pipeline/p2p.h) and every receive can be posted with its buffers.
//
// Thread-safety: one training thread. Errors: parallax::Error naming the stage and pipeline rank
// (a stage that returns no tensors, too many, or tensors of too many dimensions; a header that is
// not the expected stage's), CommError / TimeoutError with the boundary as context.
#pragma once

#include "comm/communicator.h"
#include "parallel/pipeline/p2p.h"
#include "parallel/pipeline/schedule.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/nn/module.h>

#include <functional>
#include <map>
#include <vector>

namespace parallax::parallel::pipeline {

// Stage `stage`'s forward of micro-batch 0 on `in` (what the previous stage sent; ignored by stage
// 0, which takes the micro-batch itself).
using StageForward =
    std::function<std::vector<at::Tensor>(int stage, const std::vector<at::Tensor>& in)>;

// Runs the shape pass on this rank's stages of `schedule` over the pipeline group `pp`: each stage
// boundary's activations go from its rank to the next stage's (messages on `comm_device`, received
// tensors moved to `model_device`). Returns the shapes of the activations of every stage boundary
// this rank sends or receives, by producing stage. Collective over `pp`, in stage order.
std::map<int, MessageShape> infer_activation_shapes(
    const Schedule& schedule, comm::Communicator& pp, torch::nn::Module& module,
    c10::Device comm_device, c10::Device model_device, const StageForward& forward);

}  // namespace parallax::parallel::pipeline
