// Megatron tensor parallelism (and sequence parallelism) for the linear layers of the model zoo:
// the conjugate communication operators, ColumnParallelLinear / RowParallelLinear, the factory the
// models build them through, and the checkpoint layout of every parameter.
//
// Vocabulary (Megatron-Core tensor_parallel/layers.py and mappings.py):
//   copy_to_tp      f: identity forward, all-reduce of the gradient backward
//   reduce_from_tp  g: all-reduce forward, identity backward
//   gather_from_tp  all-gather along the last dimension forward, this rank's slice backward
//   scatter_to_tp   this rank's slice of the last dimension forward, all-gather backward
// A column-parallel layer splits W [out, in] along `out` (each rank computes out/tp features of
// every token), a row-parallel layer along `in` (each rank computes a partial sum of every output
// feature, summed by g). An attention or MLP block is f -> column -> local work -> row -> g: two
// all-reduces forward and two backward per block, none in between.
//
// Fused parts. A LinearSpec with parts > 1 (the packed qkv, [3, H, hd] along the output) is split
// per part: rank r holds rows [k * out/parts + r * out/(parts tp), ...) of every part k, so its
// local output is again [3, H/tp, hd]: its own heads' q, k and v (Megatron's `stride`). A
// contiguous split of the packed rows would give rank 0 all of q and part of k.
//
// Sequence parallelism (TpGroup::sequence_parallel). Between blocks the token stream is sharded
// along the tokens: LayerNorm, dropout and the residual adds run on 1/tp of the tokens. Layout:
// the stream [B, T, D] is taken as its flattened rows [B*T, D] (batch first, as the model keeps
// it), padded with zero rows to a multiple of tp (Rp rows), and rank r holds rows [r Rp/tp,
// (r + 1) Rp/tp) as a 2-D [Rp/tp, D] tensor. A contiguous range of rows is a contiguous range of
// memory, so every collective here (all-gather and reduce-scatter over dim 0 of the flat buffer)
// needs no transpose copy. Padding rows carry finite values and get zero gradient (every exit from
// the region drops them), so they never change a result. The column layer all-gathers its input
// rows (reduce-scatter of the gradient) instead of f; the row layer reduce-scatters its output
// rows (all-gather of the gradient) instead of g. Parameters replicated across tp ranks whose
// gradient inside the region is a partial sum over that rank's tokens (LayerNorm weights, the row
// layer's bias) are registered with mark_sequence_parallel(); install_sequence_parallel_hooks()
// all-reduces their gradients over tp as autograd produces them (Megatron-LM#1446: without it the
// final LayerNorm's gradient differed across tp ranks).
//
// Thread-safety: the training thread only. Errors: ConfigError for shapes tp does not divide
// (naming both numbers), CommError/TimeoutError from the communicator.
#pragma once

#include "comm/communicator.h"
#include "kernels/fp8.h"
#include "units/linear_spec.h"
#include "units/tp_layers.h"

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace parallax::parallel::tensor {

// The layer spec and the factory interface (units/linear_spec.h, units/tp_layers.h); this file
// implements the factory (parallel_linear_factory, TpGroup).
using units::LinearFactory;
using units::LinearRole;
using units::LinearSpec;

// How a tensor-parallel layer splits one parameter: along `dim` (0: the output features of a
// column-parallel layer, 1: the input features of a row-parallel weight) into `size` equal pieces
// per part, of which this rank holds piece `rank` of every one of the `parts` fused parts
// (qkv: 3, stacked along dim 0). Parameters no layer describes are whole and identical on every
// tp rank. Checkpoints keep the global (single-process) shape: a piece is `parts` boxes of it
// (split_boxes), which is how any tp size loads any other.
struct ParamLayout {
  int dim = 0;
  int64_t parts = 1;
  int rank = 0;
  int size = 1;
};

// Implemented by the parallel linears. Names are relative to the module ("weight", "bias").
class LayoutProvider {
 public:
  virtual ~LayoutProvider() = default;
  virtual std::vector<std::pair<std::string, ParamLayout>> param_layouts() const = 0;
};

// The layout of every tp-split parameter of `module`, by full parameter name.
std::map<std::string, ParamLayout> param_layouts(const torch::nn::Module& module);

// The global shape of a parameter of local shape `local` split by `l`.
std::vector<int64_t> global_shape(const std::vector<int64_t>& local, const ParamLayout& l);

// One box of a split parameter: `local` (a view of the local tensor) is the box at `offsets` of
// the global tensor.
struct SplitBox {
  at::Tensor local;
  std::vector<int64_t> offsets;
};
// The boxes of the global tensor that `local` (this rank's piece of the parameter, or a tensor of
// the same shape such as its optimizer state) holds: one per part, each a view of `local`.
std::vector<SplitBox> split_boxes(const at::Tensor& local, const ParamLayout& l);

// The whole parameter from every tp rank's `local` piece: collective over `tp` (all-gather).
at::Tensor gather_split(const at::Tensor& local, const ParamLayout& l, comm::Communicator& tp);

// The tensor-parallel group of a model and its settings; shared by the layers built for it. As
// units::TpLayers it is what models::build_model takes: the models reach the layers and the
// sequence-parallel region below through it. Always owned by a shared_ptr (make_shared): the
// factory and the region operators hand the layers shared_from_this().
class TpGroup : public units::TpLayers, public std::enable_shared_from_this<TpGroup> {
 public:
  TpGroup(comm::CommPtr comm, bool sequence_parallel);
  int size() const override { return comm_->size(); }
  int rank() const { return comm_->rank(); }
  bool sequence_parallel() const override { return sequence_parallel_; }
  comm::Communicator& comm() const { return *comm_; }
  const comm::CommPtr& comm_ptr() const { return comm_; }

  // units::TpLayers: parallel_linear_factory, scatter_to_sequence and gather_from_sequence below,
  // over this group.
  LinearFactory linear_factory() override;
  at::Tensor scatter_to_sequence(const at::Tensor& x) override;
  at::Tensor gather_from_sequence(const at::Tensor& shard, int64_t rows) override;

  // Sequence parallel: `param`'s gradient is a partial sum over this rank's tokens (LayerNorm
  // weights and biases inside the sharded region, row-parallel biases).
  void mark_sequence_parallel(const at::Tensor& param) override;
  const std::vector<at::Tensor>& sequence_parallel_params() const { return sp_params_; }

  // Byte counters of the TP collectives since construction (or the caller's reset), by layer
  // type: the bytes each rank sends on a ring of tp ranks (all-reduce 2 (n - 1) / n M, all-gather
  // and reduce-scatter (n - 1) / n M, M the whole tensor's bytes), for docs/PERFORMANCE.md's
  // communication table (bench/tensor/tp_comm.cpp).
  struct Traffic {
    int64_t column_bytes = 0;  // f backward / SP all-gather forward and reduce-scatter backward
    int64_t row_bytes = 0;     // g forward / SP reduce-scatter forward and all-gather backward
    int64_t other_bytes = 0;   // region entry and exit, gathered outputs, SP gradient all-reduces
  };
  Traffic& traffic() { return traffic_; }

 private:
  comm::CommPtr comm_;
  bool sequence_parallel_;
  std::vector<at::Tensor> sp_params_;
  Traffic traffic_;
};
using TpPtr = std::shared_ptr<TpGroup>;

// The conjugate operators (see the file comment). `x` of any shape; last-dimension ops need the
// last dimension divisible by tp (gather: every rank the same width).
at::Tensor copy_to_tp(const at::Tensor& x, const TpPtr& tp);
at::Tensor reduce_from_tp(const at::Tensor& x, const TpPtr& tp);
at::Tensor gather_from_tp(const at::Tensor& x, const TpPtr& tp);
at::Tensor scatter_to_tp(const at::Tensor& x, const TpPtr& tp);

// Sequence parallelism over the flattened rows (see the file comment).
// Rows padded to a multiple of `n`.
int64_t padded_rows(int64_t rows, int n);
// Enters the sharded region: x [..., D] (the same on every tp rank) -> this rank's [Rp/tp, D]
// rows. Backward: all-gather.
at::Tensor scatter_to_sequence(const at::Tensor& x, const TpPtr& tp);
// Leaves it: this rank's rows -> the first `rows` rows [rows, D], the same on every rank (for a
// replicated consumer). Backward: this rank's rows of the (identical) gradient.
at::Tensor gather_from_sequence(const at::Tensor& shard, int64_t rows, const TpPtr& tp);
// Column layer input: this rank's rows -> all Rp rows [Rp, D]. Backward: reduce-scatter (each
// rank's gradient is a partial sum over its output features).
at::Tensor all_gather_sequence(const at::Tensor& shard, const TpPtr& tp);
// Row layer output: partial sums [..., D] over R rows -> padded to Rp, summed over tp, this
// rank's [Rp/tp, D] rows. Backward: all-gather (and the first R rows).
at::Tensor reduce_scatter_to_sequence(const at::Tensor& x, const TpPtr& tp);

// All-reduces (sum) the gradient of every parameter marked with mark_sequence_parallel() over tp
// as autograd produces it, before it is accumulated (so DDP's and ZeRO's hooks see the sum).
void install_sequence_parallel_hooks(const TpPtr& tp);

// W [out, in] split along out (per part). Parameters "weight" [out/tp, in], "bias" [out/tp],
// initialised like the dense layer (N(0, 0.02), zero) from the full matrix, which every rank draws
// from the same generator state, so the layer holds exactly its slice of the single-process
// layer's initial weights.
class ColumnParallelLinearImpl : public torch::nn::Module,
                                 public LayoutProvider,
                                 public kernels::fp8::Fp8Capable {
 public:
  ColumnParallelLinearImpl(const LinearSpec& spec, TpPtr tp);
  at::Tensor forward(const at::Tensor& x);
  std::vector<std::pair<std::string, ParamLayout>> param_layouts() const override;
  const LinearSpec& spec() const { return spec_; }
  // The local GEMM in FP8 (kernels/fp8.h), the amax of every tensor sharded over the tp group
  // all-reduced with MAX so that all tp ranks cast with one scale. ConfigError when the local
  // weight's shape does not take the FP8 GEMMs.
  void enable_fp8(const kernels::fp8::Fp8Options& options) override;

  at::Tensor weight, bias;
  kernels::fp8::Fp8Linear fp8{nullptr};  // empty unless FP8

 private:
  bool sequence_parallel() const { return tp_->sequence_parallel() && spec_.in_sequence_region; }
  LinearSpec spec_;
  TpPtr tp_;
};
TORCH_MODULE(ColumnParallelLinear);

// W [out, in] split along in. Parameters "weight" [out, in/tp] and "bias" [out] (whole, added
// after the reduction; sequence parallel: on this rank's rows, so marked sequence-parallel).
class RowParallelLinearImpl : public torch::nn::Module,
                              public LayoutProvider,
                              public kernels::fp8::Fp8Capable {
 public:
  RowParallelLinearImpl(const LinearSpec& spec, TpPtr tp);
  at::Tensor forward(const at::Tensor& x);
  std::vector<std::pair<std::string, ParamLayout>> param_layouts() const override;
  const LinearSpec& spec() const { return spec_; }
  // The local GEMM in FP8 (kernels/fp8.h), the amax of every tensor sharded over the tp group
  // all-reduced with MAX so that all tp ranks cast with one scale. ConfigError when the local
  // weight's shape does not take the FP8 GEMMs.
  void enable_fp8(const kernels::fp8::Fp8Options& options) override;

  at::Tensor weight, bias;
  kernels::fp8::Fp8Linear fp8{nullptr};  // empty unless FP8

 private:
  bool sequence_parallel() const { return tp_->sequence_parallel() && spec_.in_sequence_region; }
  LinearSpec spec_;
  TpPtr tp_;
};
TORCH_MODULE(RowParallelLinear);

// The factory of tensor-parallel linears over `tp`: kColumn specs give ColumnParallelLinear,
// kRow specs RowParallelLinear. ConfigError naming the layer when tp does not divide its split
// dimension (per part).
LinearFactory parallel_linear_factory(TpPtr tp);

// Slices `full` (the whole parameter, [out, in] or [out]) to what a layer of `spec` on tp rank
// `rank` of `size` holds; for tests and the factory's initialisation.
at::Tensor column_slice(const at::Tensor& full, int64_t parts, int rank, int size);
at::Tensor row_slice(const at::Tensor& full, int rank, int size);

}  // namespace parallax::parallel::tensor
