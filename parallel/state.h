// The training state as a checkpoint holds it: every piece under its single-process name and
// shape, so that a checkpoint of any layout loads into any other (checkpoint/ reads each piece from
// whatever saved shards overlap it). The engines give their pieces (StatePiece) in their own
// geometry (a ZeRO rank's flat ranges, a tp rank's local slices); this file defines the piece and
// maps pieces to the whole tensors. parallel/engine.h builds on it (Engine::checkpoint_model);
// this header knows no engine.
#pragma once

#include "comm/communicator.h"
#include "comm/topology.h"
#include "core/boxes.h"
#include "parallel/tensor/tensor_parallel.h"

#include <ATen/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace parallax::parallel {

// Tensor parallelism as the data-parallel engines see it (parallel/tensor/): the tp group, and the
// parameters whose tp ranks hold different pieces (column/row-parallel weights). Every other
// parameter is identical on every tp rank. The engines bucket and shard each rank's parameters
// over dp as they are, and report gradients so that clipping and the inf check sum the sharded
// ones over tp and count the replicated ones once.
struct TensorParallelInfo {
  comm::CommPtr tp;  // null or one rank: no tensor parallelism
  // The split parameters by full name, and how each is split (tensor::param_layouts of the
  // module); and the run's layout: what maps the engine's pieces to the single-process tensors a
  // checkpoint holds (parallel/state.h).
  std::map<std::string, tensor::ParamLayout> layouts;
  comm::RankLayout layout;
  bool active() const { return tp != nullptr && tp->size() > 1; }
  bool is_sharded(const std::string& name) const { return layouts.count(name) != 0; }
};

// One piece of a tensor of the training state, of the global tensor `name` (of shape
// `global_shape`): a box, [offsets, offsets + tensor.sizes()) (flat_begin < 0), or a flat range,
// elements [flat_begin, flat_begin + tensor.numel()) of the tensor's C-order flattening with
// `tensor` 1-D and `offsets` empty (flat_begin >= 0). The world ranks in `replicas` (this one
// included; empty: this rank alone) hold identical copies of that piece. `tensor` is a view into
// live state: saving reads it, loading writes into it (a flat range through its boxes,
// flat_range_boxes, each a contiguous run of `tensor`).
struct StatePiece {
  std::string name;
  at::Tensor tensor;
  std::vector<int64_t> global_shape;
  std::vector<int64_t> offsets;
  std::vector<int> replicas;
  int64_t flat_begin = -1;
};

// The geometry of pieces (core/boxes.h), named here for the engines.
using core::Box;
using core::flat_range_boxes;

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
