// The training state as a checkpoint holds it: every piece under its single-process name and
// shape, so that a checkpoint of any layout loads into any other (checkpoint/ reads each piece from
// whatever saved shards overlap it). The engines give their pieces in their own geometry (a ZeRO
// rank's flat ranges, a tp rank's local slices); this file maps them to the whole tensors.
#pragma once

#include "parallel/engine.h"

#include <torch/nn/module.h>

#include <vector>

namespace parallax::parallel {

// The module's parameters and buffers, each one whole piece replicated over `replicas`.
std::vector<StatePiece> module_pieces(const torch::nn::Module& module,
                                      const std::vector<int>& replicas);

// `pieces` under tensor parallelism `tp` in the single-process names and shapes: each piece of a
// tp-split tensor (a whole local tensor, or a ZeRO rank's flat range of one) as the boxes of the
// whole tensor it holds, written by this rank (several pieces of one tensor per rank file:
// checkpoint/format.h, version 4); every other piece is the same on all tp ranks, so its replica
// set grows by the tp peers. A piece belongs to a split tensor when it is one ("<param>") or its
// optimizer state ("<param>.<state>"). Without tensor parallelism the pieces are returned as
// they are. To load, fill the same pieces.
std::vector<StatePiece> global_pieces(std::vector<StatePiece> pieces, const TensorParallelInfo& tp);

}  // namespace parallax::parallel
