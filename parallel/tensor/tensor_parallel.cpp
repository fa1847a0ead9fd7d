#include "parallel/tensor/tensor_parallel.h"

#include "core/error.h"
#include "units/param_init.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <fmt/format.h>

namespace parallax::parallel::tensor {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The group travels through autograd contexts as a raw pointer: the layers (and the model) own
// the TpGroup and outlive every graph they build.
int64_t stash(const TpPtr& tp) {
  return static_cast<int64_t>(reinterpret_cast<intptr_t>(tp.get()));
}
TpGroup& unstash(AutogradContext* ctx) {
  return *reinterpret_cast<TpGroup*>(static_cast<intptr_t>(ctx->saved_data["tp"].toInt()));
}

// Orders the caller's stream after the op (NCCL) or waits for it (CPU backends).
void finish(const comm::WorkPtr& w) {
  w->wait_stream();
}

int64_t bytes_of(const at::Tensor& t) {
  return static_cast<int64_t>(t.numel()) * static_cast<int64_t>(t.element_size());
}

// The traffic counters hold the bytes each rank sends for an op on a ring of n ranks (NCCL's and
// the ring algorithm's cost; the standard bus-bandwidth accounting): all-reduce of M bytes
// 2 (n - 1) / n M, all-gather into M bytes (n - 1) / n M, reduce-scatter of M bytes (n - 1) / n M.
int64_t ring_bytes(int64_t bytes, int n, int factor) {
  return factor * bytes * (n - 1) / n;
}

at::Tensor all_reduce_sum(const at::Tensor& x, TpGroup& tp, int64_t& counter) {
  at::Tensor y = x.contiguous().clone();
  finish(tp.comm().all_reduce_async(y, comm::ReduceOp::kSum));
  counter += ring_bytes(bytes_of(y), tp.size(), 2);
  return y;
}

// [rows, D] rows of every rank, in rank order: [n * rows, D].
at::Tensor all_gather_rows(const at::Tensor& shard, TpGroup& tp, int64_t& counter) {
  const at::Tensor s = shard.contiguous();
  std::vector<int64_t> shape = s.sizes().vec();
  shape[0] *= tp.size();
  at::Tensor out = at::empty(shape, s.options());
  at::Tensor flat = out.view({-1});
  finish(tp.comm().all_gather_async(s.view({-1}), flat));
  counter += ring_bytes(bytes_of(out), tp.size(), 1);
  return out;
}

// [n * rows, D] summed over ranks, this rank's [rows, D].
at::Tensor reduce_scatter_rows(const at::Tensor& x, TpGroup& tp, int64_t& counter) {
  const at::Tensor s = x.contiguous();
  std::vector<int64_t> shape = s.sizes().vec();
  shape[0] /= tp.size();
  at::Tensor out = at::empty(shape, s.options());
  at::Tensor flat = out.view({-1});
  finish(tp.comm().reduce_scatter_async(s, flat, comm::ReduceOp::kSum));
  counter += ring_bytes(bytes_of(s), tp.size(), 1);
  return out;
}

// x as [R, D] rows padded with zero rows to `rows`.
at::Tensor pad_rows(const at::Tensor& x2, int64_t rows) {
  if (x2.size(0) == rows) return x2;
  return at::cat({x2, at::zeros({rows - x2.size(0), x2.size(1)}, x2.options())}, 0);
}

at::Tensor as_rows(const at::Tensor& x) {
  return x.reshape({-1, x.size(-1)});
}

struct CopyToTp : public torch::autograd::Function<CopyToTp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t tp) {
    ctx->saved_data["tp"] = tp;
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    TpGroup& tp = unstash(ctx);
    return {all_reduce_sum(g[0], tp, tp.traffic().column_bytes), at::Tensor()};
  }
};

struct ReduceFromTp : public torch::autograd::Function<ReduceFromTp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t tp) {
    ctx->saved_data["tp"] = tp;
    TpGroup& g = unstash(ctx);
    return all_reduce_sum(x, g, g.traffic().row_bytes);
  }
  static variable_list backward(AutogradContext*, variable_list g) { return {g[0], at::Tensor()}; }
};

struct GatherFromTp : public torch::autograd::Function<GatherFromTp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t tp) {
    ctx->saved_data["tp"] = tp;
    TpGroup& g = unstash(ctx);
    // [..., c] of every rank -> [n, ..., c] -> [..., n * c].
    const at::Tensor rows = as_rows(x);
    const at::Tensor all = all_gather_rows(rows, g, g.traffic().other_bytes);
    const int64_t n = g.size(), r = rows.size(0), c = rows.size(1);
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = n * c;
    return all.view({n, r, c}).permute({1, 0, 2}).reshape(shape);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    TpGroup& tp = unstash(ctx);
    const int64_t c = g[0].size(-1) / tp.size();
    return {g[0].narrow(-1, tp.rank() * c, c).contiguous(), at::Tensor()};
  }
};

struct ScatterToTp : public torch::autograd::Function<ScatterToTp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t tp) {
    ctx->saved_data["tp"] = tp;
    TpGroup& g = unstash(ctx);
    const int64_t c = x.size(-1) / g.size();
    return x.narrow(-1, g.rank() * c, c).contiguous();
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {GatherFromTp::forward(ctx, g[0], ctx->saved_data["tp"].toInt()), at::Tensor()};
  }
};

struct ScatterToSequence : public torch::autograd::Function<ScatterToSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t tp) {
    ctx->saved_data["tp"] = tp;
    ctx->saved_data["shape"] = x.sizes().vec();
    TpGroup& g = unstash(ctx);
    const at::Tensor rows = as_rows(x);
    const int64_t rp = padded_rows(rows.size(0), g.size()), local = rp / g.size();
    return pad_rows(rows, rp).narrow(0, g.rank() * local, local).contiguous();
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    TpGroup& tp = unstash(ctx);
    const auto shape = ctx->saved_data["shape"].toIntVector();
    const int64_t rows = c10::multiply_integers(shape) / shape.back();
    at::Tensor all = all_gather_rows(g[0], tp, tp.traffic().other_bytes);
    return {all.narrow(0, 0, rows).reshape(shape), at::Tensor()};
  }
};

struct GatherFromSequence : public torch::autograd::Function<GatherFromSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& shard, int64_t rows,
                            int64_t tp) {
    ctx->saved_data["tp"] = tp;
    TpGroup& g = unstash(ctx);
    return all_gather_rows(shard, g, g.traffic().other_bytes).narrow(0, 0, rows);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    TpGroup& tp = unstash(ctx);
    const at::Tensor rows = as_rows(g[0]);
    const int64_t rp = padded_rows(rows.size(0), tp.size()), local = rp / tp.size();
    return {pad_rows(rows, rp).narrow(0, tp.rank() * local, local).contiguous(), at::Tensor(),
            at::Tensor()};
  }
};

struct AllGatherSequence : public torch::autograd::Function<AllGatherSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& shard, int64_t tp) {
    ctx->saved_data["tp"] = tp;
    TpGroup& g = unstash(ctx);
    return all_gather_rows(shard, g, g.traffic().column_bytes);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    TpGroup& tp = unstash(ctx);
    return {reduce_scatter_rows(g[0], tp, tp.traffic().column_bytes), at::Tensor()};
  }
};

struct ReduceScatterToSequence : public torch::autograd::Function<ReduceScatterToSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t tp) {
    ctx->saved_data["tp"] = tp;
    ctx->saved_data["shape"] = x.sizes().vec();
    TpGroup& g = unstash(ctx);
    const at::Tensor rows = as_rows(x);
    return reduce_scatter_rows(pad_rows(rows, padded_rows(rows.size(0), g.size())), g,
                               g.traffic().row_bytes);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    TpGroup& tp = unstash(ctx);
    const auto shape = ctx->saved_data["shape"].toIntVector();
    const int64_t rows = c10::multiply_integers(shape) / shape.back();
    at::Tensor all = all_gather_rows(g[0], tp, tp.traffic().row_bytes);
    return {all.narrow(0, 0, rows).reshape(shape), at::Tensor()};
  }
};

void check_divides(const LinearSpec& s, int64_t dim, int64_t tp, const char* what) {
  PARALLAX_CHECK(
      dim % tp == 0, ConfigError,
      "key 'parallel.tp': {} does not divide the {} of linear layer '{}' ({} features{})", tp, what,
      s.name.empty() ? "?" : s.name, dim,
      s.parts > 1 ? fmt::format(" per part, {} parts", s.parts) : "");
}

}  // namespace

// ---- layouts ---------------------------------------------------------------------------------

std::vector<int64_t> global_shape(const std::vector<int64_t>& local, const ParamLayout& l) {
  std::vector<int64_t> g = local;
  g.at(static_cast<std::size_t>(l.dim)) *= l.size;
  return g;
}

std::vector<SplitBox> split_boxes(const at::Tensor& local, const ParamLayout& l) {
  const std::vector<int64_t> shape = local.sizes().vec();
  const auto d = static_cast<std::size_t>(l.dim);
  const int64_t per_part = shape.at(d) / l.parts;  // this rank's rows of each part
  std::vector<SplitBox> out;
  for (int64_t k = 0; k < l.parts; ++k) {
    std::vector<int64_t> off(shape.size(), 0);
    // Part k spans [k, k + 1) * per_part * size of the global dimension; this rank's piece of
    // it starts rank * per_part further.
    off[d] = (k * l.size + l.rank) * per_part;
    out.push_back({local.narrow(l.dim, k * per_part, per_part), off});
  }
  return out;
}

at::Tensor gather_split(const at::Tensor& local, const ParamLayout& l, comm::Communicator& tp) {
  const at::Tensor x = local.detach().contiguous();
  std::vector<int64_t> shape = x.sizes().vec();
  shape.insert(shape.begin(), tp.size());
  at::Tensor all = at::empty(shape, x.options());  // [tp, *local]
  at::Tensor flat = all.view({-1});
  tp.all_gather_async(x.view({-1}), flat)->wait();
  // [tp, ..., parts * p, ...] viewed [tp, ..., parts, p, ...]; the tp axis moves right after the
  // parts axis, which gives the global order [..., parts, tp, p, ...].
  std::vector<int64_t> split = x.sizes().vec();
  const auto d = static_cast<int64_t>(l.dim);
  split[static_cast<std::size_t>(d)] /= l.parts;
  split.insert(split.begin() + d, l.parts);
  split.insert(split.begin(), tp.size());
  std::vector<int64_t> perm;
  for (int64_t i = 1; i <= d + 1; ++i) perm.push_back(i);
  perm.push_back(0);
  for (int64_t i = d + 2; i < static_cast<int64_t>(split.size()); ++i) perm.push_back(i);
  return all.view(split).permute(perm).reshape(global_shape(x.sizes().vec(), l));
}

std::map<std::string, ParamLayout> param_layouts(const torch::nn::Module& module) {
  std::map<std::string, ParamLayout> out;
  for (const auto& item : module.named_modules()) {
    const auto* provider = dynamic_cast<const LayoutProvider*>(item.value().get());
    if (provider == nullptr) continue;
    const std::string prefix = item.key().empty() ? "" : item.key() + ".";
    for (auto& [name, layout] : provider->param_layouts()) out[prefix + name] = layout;
  }
  return out;
}

// ---- the group -------------------------------------------------------------------------------

TpGroup::TpGroup(comm::CommPtr comm, bool sequence_parallel)
    : comm_(std::move(comm)), sequence_parallel_(sequence_parallel) {
  PARALLAX_CHECK(comm_ != nullptr, Error, "tensor parallel: no tp communicator");
}

void TpGroup::mark_sequence_parallel(const at::Tensor& param) {
  if (sequence_parallel_ && param.defined()) sp_params_.push_back(param);
}

LinearFactory TpGroup::linear_factory() {
  return parallel_linear_factory(shared_from_this());
}

at::Tensor TpGroup::scatter_to_sequence(const at::Tensor& x) {
  return tensor::scatter_to_sequence(x, shared_from_this());
}

at::Tensor TpGroup::gather_from_sequence(const at::Tensor& shard, int64_t rows) {
  return tensor::gather_from_sequence(shard, rows, shared_from_this());
}

void install_sequence_parallel_hooks(const TpPtr& tp) {
  if (!tp || tp->size() == 1) return;
  TpGroup* g = tp.get();
  for (const at::Tensor& p : tp->sequence_parallel_params()) {
    at::Tensor param = p;  // register_hook is non-const on the handle
    param.register_hook(
        [g](const at::Tensor& grad) { return all_reduce_sum(grad, *g, g->traffic().other_bytes); });
  }
}

// ---- mappings --------------------------------------------------------------------------------

at::Tensor copy_to_tp(const at::Tensor& x, const TpPtr& tp) {
  return CopyToTp::apply(x, stash(tp));
}
at::Tensor reduce_from_tp(const at::Tensor& x, const TpPtr& tp) {
  return ReduceFromTp::apply(x, stash(tp));
}
at::Tensor gather_from_tp(const at::Tensor& x, const TpPtr& tp) {
  return GatherFromTp::apply(x, stash(tp));
}
at::Tensor scatter_to_tp(const at::Tensor& x, const TpPtr& tp) {
  PARALLAX_CHECK(x.size(-1) % tp->size() == 0, Error,
                 "tensor parallel: last dimension {} is not divisible by tp {}", x.size(-1),
                 tp->size());
  return ScatterToTp::apply(x, stash(tp));
}

int64_t padded_rows(int64_t rows, int n) {
  return (rows + n - 1) / n * n;
}
at::Tensor scatter_to_sequence(const at::Tensor& x, const TpPtr& tp) {
  return ScatterToSequence::apply(x, stash(tp));
}
at::Tensor gather_from_sequence(const at::Tensor& shard, int64_t rows, const TpPtr& tp) {
  PARALLAX_CHECK(shard.dim() == 2 && rows <= shard.size(0) * tp->size(), Error,
                 "sequence parallel: a shard of {} rows on {} ranks cannot hold {} rows",
                 shard.dim() == 2 ? shard.size(0) : -1, tp->size(), rows);
  return GatherFromSequence::apply(shard, rows, stash(tp));
}
at::Tensor all_gather_sequence(const at::Tensor& shard, const TpPtr& tp) {
  return AllGatherSequence::apply(shard, stash(tp));
}
at::Tensor reduce_scatter_to_sequence(const at::Tensor& x, const TpPtr& tp) {
  return ReduceScatterToSequence::apply(x, stash(tp));
}

// ---- slices ----------------------------------------------------------------------------------

at::Tensor column_slice(const at::Tensor& full, int64_t parts, int rank, int size) {
  const int64_t per_part = full.size(0) / parts, local = per_part / size;
  std::vector<at::Tensor> pieces;
  for (int64_t k = 0; k < parts; ++k)
    pieces.push_back(full.narrow(0, k * per_part + rank * local, local));
  return at::cat(pieces, 0).contiguous();
}

at::Tensor row_slice(const at::Tensor& full, int rank, int size) {
  const int64_t local = full.size(1) / size;
  return full.narrow(1, rank * local, local).contiguous();
}

// ---- layers ----------------------------------------------------------------------------------

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const LinearSpec& spec, TpPtr tp)
    : spec_(spec), tp_(std::move(tp)) {
  const int n = tp_->size();
  PARALLAX_CHECK(spec.parts >= 1 && spec.out_features % spec.parts == 0, Error,
                 "linear layer '{}': {} outputs are not {} equal parts", spec.name,
                 spec.out_features, spec.parts);
  check_divides(spec, spec.out_features / spec.parts, n, "outputs");
  PARALLAX_CHECK(!(spec.gather_output && spec.parts > 1), Error,
                 "linear layer '{}': gather_output with fused parts is not supported", spec.name);
  // The same draws as the dense layer (models/layers.cpp), then this rank's rows (under deferred
  // construction, the recipe of this rank's rows: units/param_init.h).
  const int64_t out = spec.out_features, in = spec.in_features, parts = spec.parts;
  const int rank = tp_->rank();
  weight = register_parameter("weight", units::init_tensor({out / n, in}, [=]() {
                                return column_slice(at::randn({out, in}) * 0.02, parts, rank, n);
                              }));
  if (spec.bias) {
    bias = register_parameter("bias", units::init_zeros({spec.out_features / n}));
  }
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& x) {
  const at::Tensor in = sequence_parallel() ? all_gather_sequence(x, tp_) : copy_to_tp(x, tp_);
  at::Tensor y = fp8.is_empty() ? at::linear(in, weight, bias) : fp8->forward(in, weight, bias);
  return spec_.gather_output ? gather_from_tp(y, tp_) : y;
}

std::vector<std::pair<std::string, ParamLayout>> ColumnParallelLinearImpl::param_layouts() const {
  const ParamLayout l{0, spec_.parts, tp_->rank(), tp_->size()};
  std::vector<std::pair<std::string, ParamLayout>> out{{"weight", l}};
  if (bias.defined()) out.emplace_back("bias", l);
  return out;
}

RowParallelLinearImpl::RowParallelLinearImpl(const LinearSpec& spec, TpPtr tp)
    : spec_(spec), tp_(std::move(tp)) {
  const int n = tp_->size();
  check_divides(spec, spec.in_features, n, "inputs");
  const int64_t out = spec.out_features, in = spec.in_features;
  const int rank = tp_->rank();
  weight = register_parameter("weight", units::init_tensor({out, in / n}, [=]() {
                                return row_slice(at::randn({out, in}) * 0.02, rank, n);
                              }));
  if (spec.bias) {
    bias = register_parameter("bias", units::init_zeros({spec.out_features}));
    if (sequence_parallel()) tp_->mark_sequence_parallel(bias);
  }
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& x) {
  const at::Tensor in = spec_.input_is_parallel ? x : scatter_to_tp(x, tp_);
  const at::Tensor partial = fp8.is_empty() ? at::linear(in, weight) : fp8->forward(in, weight);
  at::Tensor y =
      sequence_parallel() ? reduce_scatter_to_sequence(partial, tp_) : reduce_from_tp(partial, tp_);
  return bias.defined() ? y + bias : y;
}

std::vector<std::pair<std::string, ParamLayout>> RowParallelLinearImpl::param_layouts() const {
  return {{"weight", ParamLayout{1, 1, tp_->rank(), tp_->size()}}};
}

namespace {

// Enables FP8 on a tp layer's local GEMM: `options` with the tp group's MAX all-reduce.
kernels::fp8::Fp8Linear tp_fp8(torch::nn::Module& layer, const at::Tensor& weight,
                               const LinearSpec& spec, const TpPtr& tp,
                               kernels::fp8::Fp8Options options) {
  PARALLAX_CHECK(
      kernels::fp8::fp8_linear_supported(weight.size(1), weight.size(0)), ConfigError,
      "key 'precision.mode': fp8 needs linear layers whose in and out features are "
      "multiples of 16; layer '{}' holds a weight [out {}, in {}] on each of {} tp ranks",
      spec.name, weight.size(0), weight.size(1), tp->size());
  if (tp->size() > 1) {
    TpGroup* g = tp.get();
    options.reduce = [g](at::Tensor& amax) {
      finish(g->comm().all_reduce_async(amax, comm::ReduceOp::kMax));
    };
  }
  return layer.register_module("fp8", kernels::fp8::Fp8Linear(std::move(options)));
}

}  // namespace

void ColumnParallelLinearImpl::enable_fp8(const kernels::fp8::Fp8Options& layer_options) {
  kernels::fp8::Fp8Options options = layer_options;
  PARALLAX_CHECK(fp8.is_empty(), Error, "FP8: layer '{}' is FP8 already", spec_.name);
  // The input arrives whole (all-gathered under SP); the weight's rows and the output gradient's
  // columns are this rank's.
  options.input_sharded = false;
  options.weight_sharded = options.grad_sharded = true;
  fp8 = tp_fp8(*this, weight, spec_, tp_, std::move(options));
}

void RowParallelLinearImpl::enable_fp8(const kernels::fp8::Fp8Options& layer_options) {
  kernels::fp8::Fp8Options options = layer_options;
  PARALLAX_CHECK(fp8.is_empty(), Error, "FP8: layer '{}' is FP8 already", spec_.name);
  // The input's and the weight's columns are this rank's; the partial output's gradient is whole
  // (g's backward is the identity; under SP it is all-gathered).
  options.input_sharded = options.weight_sharded = true;
  options.grad_sharded = false;
  fp8 = tp_fp8(*this, weight, spec_, tp_, std::move(options));
}

LinearFactory parallel_linear_factory(TpPtr tp) {
  return [tp](const LinearSpec& spec) {
    if (spec.role == LinearRole::kColumn)
      return torch::nn::AnyModule(ColumnParallelLinear(spec, tp));
    return torch::nn::AnyModule(RowParallelLinear(spec, tp));
  };
}

}  // namespace parallax::parallel::tensor
