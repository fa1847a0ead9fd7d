// The tensor-parallel group as a model sees it: the factory of its column- and row-parallel linear
// layers, and the entry to and exit from the sequence-parallel region. parallel/tensor implements
// it (parallel::tensor::TpGroup); whoever builds a model (the trainer's setup, the planner, the
// verbs) passes its group to models::build_model. So the model zoo builds tensor-parallel blocks
// without including parallel/ (ARCHITECTURE §1): a model never calls a collective itself, only the
// layers and region operators this interface hands it do.
//
// Thread-safety: the training thread only. Errors: ConfigError for shapes the group's size does
// not divide (naming both numbers), CommError/TimeoutError from the group's communicator.
#pragma once

#include "units/linear_spec.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>

namespace parallax::units {

class TpLayers {
 public:
  virtual ~TpLayers() = default;

  // Ranks in the group (1: the parallel layers with trivial collectives).
  virtual int size() const = 0;
  // Whether the token stream between blocks is sharded along the tokens
  // (parallel.sequence_parallel).
  virtual bool sequence_parallel() const = 0;

  // The factory of linear layers over this group: kColumn specs give column-parallel layers, kRow
  // specs row-parallel ones. A layer it builds throws ConfigError naming the layer when the
  // group's size does not divide its split dimension (per part).
  virtual LinearFactory linear_factory() = 0;

  // Sequence parallel: `param`'s gradient is a partial sum over this rank's tokens (a LayerNorm
  // inside the sharded region); the group all-reduces it over its ranks as autograd produces it.
  virtual void mark_sequence_parallel(const at::Tensor& param) = 0;
  // Enters the sharded region: x [..., D] (the same on every rank) -> this rank's rows of the
  // flattened tokens, [Rp/size, D] (Rp: the rows padded to a multiple of size()).
  virtual at::Tensor scatter_to_sequence(const at::Tensor& x) = 0;
  // Leaves it: this rank's rows -> the first `rows` rows [rows, D], the same on every rank.
  virtual at::Tensor gather_from_sequence(const at::Tensor& shard, int64_t rows) = 0;
};
using TpLayersPtr = std::shared_ptr<TpLayers>;

}  // namespace parallax::units
