#include "kernels/fp8.h"

#include "core/enum_names.h"
#include "core/error.h"
#include "units/param_init.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/autograd.h>

#include <cstdint>

#ifdef PARALLAX_WITH_CUDA_KERNELS
#include "kernels/fp8_cuda.h"
#include "kernels/launch.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace parallax::kernels::fp8 {

namespace {

constexpr core::EnumName<Recipe> kRecipes[] = {
    {Recipe::kCurrent, "current"},
    {Recipe::kDelayed, "delayed"},
};

// The FP8 GEMMs' granule: _scaled_mm needs the inner dimension and mat2's dimensions to be
// multiples of 16 (one 16-byte vector of FP8 values).
constexpr int64_t kGranule = 16;

#ifdef PARALLAX_WITH_CUDA_KERNELS
// Any alignment: the launchers take their 16-byte vector kernels only for aligned pointers (a
// weight at an odd offset of ZeRO's flat buffers gets the element-wise kernels, the same bits).
bool fused_ok(const at::Tensor& x) {
  const auto t = x.scalar_type();
  return x.is_cuda() && x.is_contiguous() &&
         (t == at::kFloat || t == at::kBFloat16 || t == at::kHalf);
}
#endif

int64_t round_up(int64_t n, int64_t k) {
  return (n + k - 1) / k * k;
}

}  // namespace

float max_finite(Format f) {
  return f == Format::kE4M3 ? 448.f : 57344.f;
}

at::ScalarType scalar_type(Format f) {
  return f == Format::kE4M3 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2;
}

const char* to_string(Format f) {
  return f == Format::kE4M3 ? "e4m3" : "e5m2";
}

Recipe parse_recipe(const std::string& name, const std::string& key) {
  return core::parse_enum(kRecipes, name, key.c_str(), "FP8 scaling recipe");
}

const char* to_string(Recipe r) {
  return core::enum_name(kRecipes, r);
}

at::Tensor amax(const at::Tensor& x, bool fused) {
#ifdef PARALLAX_WITH_CUDA_KERNELS
  if (fused && fused_ok(x)) {
    c10::cuda::CUDAGuard guard(x.device());
    at::Tensor out = at::empty({1}, x.options().dtype(at::kFloat));
    detail::check_launch(
        cuda::fp8_amax(detail::dtype_of(x), x.data_ptr(), x.numel(), out.data_ptr<float>(),
                       c10::cuda::getCurrentCUDAStream().stream()),
        "fp8", "amax");
    return out;
  }
#endif
  (void)fused;
  if (x.numel() == 0) return at::zeros({1}, x.options().dtype(at::kFloat));
  return x.abs().amax().to(at::kFloat).reshape({1});
}

at::Tensor scale_from_amax(const at::Tensor& amax, Format f) {
  // fmax / clamp_min(amax, floor) as one IEEE fp32 division, what the cast kernel computes.
  return at::div(at::full({1}, max_finite(f), amax.options().dtype(at::kFloat)),
                 amax.to(at::kFloat).clamp_min(kAmaxFloor));
}

Casted cast_to_fp8(const at::Tensor& x, const at::Tensor& amax_for_scale, Format f, bool rowmajor,
                   bool transposed, int64_t pad_t, const at::Tensor& amax_out, bool fused,
                   bool col_sum, bool gelu) {
  PARALLAX_CHECK(x.dim() == 2, Error, "fp8 cast: expected a 2-D tensor, got {} dims", x.dim());
  PARALLAX_CHECK(pad_t >= 1, Error, "fp8 cast: pad_t must be >= 1, got {}", pad_t);
  const int64_t rows = x.size(0), cols = x.size(1), rows_pad = round_up(rows, pad_t);
  const auto fp8 = x.options().dtype(scalar_type(f));
  Casted c;
#ifdef PARALLAX_WITH_CUDA_KERNELS
  if (fused && fused_ok(x) && cols > 0 && amax_for_scale.is_cuda() &&
      amax_for_scale.scalar_type() == at::kFloat && amax_for_scale.is_contiguous() &&
      (!amax_out.defined() || (amax_out.is_cuda() && amax_out.scalar_type() == at::kFloat))) {
    c10::cuda::CUDAGuard guard(x.device());
    if (rowmajor) c.data = at::empty({rows, cols}, fp8);
    if (transposed) c.data_t = at::empty({cols, rows_pad}, fp8);
    c.inv_scale = at::empty({1}, x.options().dtype(at::kFloat));
    at::Tensor partial;
    if (col_sum) {
      const int64_t tiles = (rows + cuda::kFp8CastTileRows - 1) / cuda::kFp8CastTileRows;
      partial = at::empty({tiles, cols}, x.options().dtype(at::kFloat));
    }
    detail::check_launch(cuda::fp8_cast(detail::dtype_of(x), x.data_ptr(), rows, cols,
                                        amax_for_scale.data_ptr<float>(), max_finite(f), kAmaxFloor,
                                        f == Format::kE5M2, rowmajor ? c.data.data_ptr() : nullptr,
                                        transposed ? c.data_t.data_ptr() : nullptr, rows_pad,
                                        c.inv_scale.data_ptr<float>(),
                                        amax_out.defined() ? amax_out.data_ptr<float>() : nullptr,
                                        col_sum ? partial.data_ptr<float>() : nullptr, gelu,
                                        c10::cuda::getCurrentCUDAStream().stream()),
                         "fp8", "cast");
    if (col_sum) {
      c.col_sum = at::empty({cols}, x.options().dtype(at::kFloat));
      detail::check_launch(cuda::fp8_col_sum(partial.data_ptr<float>(), partial.size(0), cols,
                                             c.col_sum.data_ptr<float>(),
                                             c10::cuda::getCurrentCUDAStream().stream()),
                           "fp8", "column sum");
    }
    return c;
  }
#endif
  (void)fused;
  const float fmax = max_finite(f);
  const at::Tensor scale = scale_from_amax(amax_for_scale, f);
  // The folded GELU: what gelu_run() writes, cast.
  const at::Tensor src = gelu ? at::gelu(x) : x;
  const at::Tensor q = (src.to(at::kFloat) * scale).clamp(-fmax, fmax).to(scalar_type(f));
  if (rowmajor) c.data = q;
  if (transposed) {
    c.data_t = rows_pad == rows ? q.t().contiguous() : at::zeros({cols, rows_pad}, fp8);
    if (rows_pad != rows) c.data_t.narrow(1, 0, rows).copy_(q.t());
  }
  c.inv_scale = scale.reciprocal();
  if (amax_out.defined()) amax_out.copy_(at::maximum(amax_out, amax(src, false)));
  if (col_sum) c.col_sum = src.sum(0, false, at::kFloat);
  return c;
}

std::string fp8_device_blocker(const c10::Device& device) {
  if (!device.is_cuda())
    return fmt::format("the run is on {}, and FP8 training runs on GPUs", device.str());
#ifdef PARALLAX_WITH_CUDA_KERNELS
  const auto* p = at::cuda::getDeviceProperties(device.index());
  if (p->major * 10 + p->minor < 89)
    return fmt::format(
        "{} ({}) has compute capability {}.{}; FP8 tensor cores need 8.9 or newer "
        "(Ada, Hopper, Blackwell)",
        device.str(), p->name, p->major, p->minor);
  return "";
#else
  return fmt::format("this build of Parallax has no CUDA kernels, so {} cannot run FP8",
                     device.str());
#endif
}

bool fp8_linear_supported(int64_t in_features, int64_t out_features) {
  return in_features > 0 && out_features > 0 && in_features % kGranule == 0 &&
         out_features % kGranule == 0;
}

namespace {

// The amax a tensor's scale comes from: slot 0 input, 1 weight, 2 output gradient. `handed`: t's
// amax from the kernel that wrote it (undefined: computed here).
at::Tensor scale_source(Fp8LinearImpl& self, int slot, const at::Tensor& t, bool sharded,
                        const at::Tensor& handed = {}) {
  const Fp8Options& o = self.options();
  if (o.recipe == Recipe::kDelayed && self.initialized())
    return self.history_amax.narrow(0, slot, 1);
  at::Tensor a = handed.defined() ? handed : amax(t, o.fused);
  if (sharded && o.reduce) o.reduce(a);
  return a;
}

// Where the delayed recipe records this step's amax of `slot` (undefined: nothing recorded).
at::Tensor record_slot(Fp8LinearImpl& self, int slot) {
  if (self.options().recipe != Recipe::kDelayed) return {};
  return self.step_amax.narrow(0, slot, 1);
}

// Writes gelu(x) or, with dy, dy * gelu'(x); `amax` (wanted or not) of the result as stored.
at::Tensor gelu_run(const at::Tensor& x, const at::Tensor& dy, bool want_amax,
                    at::Tensor& amax_out) {
#ifdef PARALLAX_WITH_CUDA_KERNELS
  if (fused_ok(x) && (!dy.defined() || (fused_ok(dy) && dy.scalar_type() == x.scalar_type() &&
                                        dy.sizes() == x.sizes()))) {
    c10::cuda::CUDAGuard guard(x.device());
    at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
    if (want_amax) amax_out = at::empty({1}, x.options().dtype(at::kFloat));
    detail::check_launch(
        cuda::fp8_gelu(detail::dtype_of(x), x.data_ptr(), dy.defined() ? dy.data_ptr() : nullptr,
                       out.data_ptr(), x.numel(), want_amax ? amax_out.data_ptr<float>() : nullptr,
                       c10::cuda::getCurrentCUDAStream().stream()),
        "fp8", "gelu");
    return out;
  }
#endif
  at::Tensor out = dy.defined() ? at::gelu_backward(dy, x) : at::gelu(x);
  if (want_amax) amax_out = amax(out, false);
  return out;
}

// y = x W^T + b in FP8. `gelu_producer` >= 0: x is the GELU's input `pre` and the layer's input is
// gelu(pre), computed by the input's cast and never stored (Fp8LinearImpl::forward_gelu); the
// backward then returns d pre, and hands its amax to the producer (an Fp8LinearImpl*, 0: none)
// as GeluFn does. -1: a plain layer.
struct Fp8LinearFn : public torch::autograd::Function<Fp8LinearFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, const at::Tensor& bias,
                            const at::Tensor& x_amax, int64_t self_ptr, int64_t gelu_producer) {
    auto& self = *reinterpret_cast<Fp8LinearImpl*>(self_ptr);
    const Fp8Options& o = self.options();
    const bool gelu = gelu_producer >= 0;
    const int64_t k = x.size(-1), n = weight.size(0);
    at::Tensor x2 = x.reshape({-1, k});
    if (!x2.is_contiguous()) x2 = x2.contiguous();
    at::Tensor w = weight.is_contiguous() ? weight : weight.contiguous();
    const bool need_dw = weight.requires_grad(), need_dx = x.requires_grad();
    PARALLAX_CHECK(!gelu || (o.recipe == Recipe::kDelayed && self.initialized()), Error,
                   "fp8 linear: the folded GELU needs the delayed recipe's scale (its input's "
                   "amax is not known before the cast)");

    const Casted cx = cast_to_fp8(
        x2, scale_source(self, 0, x2, o.input_sharded, x_amax.numel() ? x_amax : at::Tensor()),
        Format::kE4M3, true, need_dw, kGranule, record_slot(self, 0), o.fused, false, gelu);
    const Casted cw = cast_to_fp8(w, scale_source(self, 1, w, o.weight_sharded), Format::kE4M3,
                                  true, need_dx, 1, record_slot(self, 1), o.fused);
    const bool has_bias = bias.numel() > 0;
    std::optional<at::Tensor> b;
    if (has_bias) b = bias.to(at::kBFloat16);
    // Output GEMM with fast accumulation, the grads without (torchao's Float8LinearConfig).
    at::Tensor y = at::_scaled_mm(cx.data, cw.data.t(), cx.inv_scale, cw.inv_scale, b, std::nullopt,
                                  at::kBFloat16, /*use_fast_accum=*/true);
    ctx->save_for_backward(
        {cx.data_t, cx.inv_scale, cw.data_t, cw.inv_scale, gelu ? x : at::Tensor()});
    ctx->saved_data["self"] = self_ptr;
    ctx->saved_data["gelu_producer"] = gelu_producer;
    ctx->saved_data["has_bias"] = has_bias;
    ctx->saved_data["bias_dtype"] = bias.scalar_type();
    ctx->saved_data["weight_dtype"] = weight.scalar_type();
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = n;
    return y.view(shape);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto& self = *reinterpret_cast<Fp8LinearImpl*>(ctx->saved_data["self"].toInt());
    const Fp8Options& o = self.options();
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x_t = saved[0], &inv_x = saved[1], &w_t = saved[2], &inv_w = saved[3];
    at::Tensor g = grads[0];
    if (!g.defined())
      return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    const at::Tensor g_amax = self.take_grad_amax(g);
    const int64_t n = g.size(-1);
    at::Tensor g2 = g.reshape({-1, n});
    if (!g2.is_contiguous()) g2 = g2.contiguous();
    const bool need_dx = w_t.defined(), need_dw = x_t.defined();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    // The bias gradient (the columns' sums of g) comes from the cast's read of g.
    const Casted cg =
        cast_to_fp8(g2, scale_source(self, 2, g2, o.grad_sharded, g_amax), Format::kE5M2, need_dx,
                    need_dw, kGranule, record_slot(self, 2), o.fused, has_bias);
    at::Tensor dx, dw, db;
    if (need_dx) {
      // [M, N] x [N, K]: w_t is [K, N] contiguous, so w_t.t() is the column-major mat2.
      dx = at::_scaled_mm(cg.data, w_t.t(), cg.inv_scale, inv_w, std::nullopt, std::nullopt,
                          at::kBFloat16, false);
      std::vector<int64_t> shape = g.sizes().vec();
      shape.back() = dx.size(1);
      dx = dx.view(shape);
    }
    if (need_dw) {
      // [N, Mp] x [Mp, K]: rows padded with zeros to the granule on both operands.
      dw = at::_scaled_mm(cg.data_t, x_t.t(), cg.inv_scale, inv_x, std::nullopt, std::nullopt,
                          at::kFloat, false)
               .to(ctx->saved_data["weight_dtype"].toScalarType());
    }
    if (has_bias) db = cg.col_sum.to(ctx->saved_data["bias_dtype"].toScalarType());
    const int64_t gelu_producer = ctx->saved_data["gelu_producer"].toInt();
    if (gelu_producer >= 0 && dx.defined()) {
      // d pre = dx * gelu'(pre), as GeluFn's backward computes it.
      auto* producer = reinterpret_cast<Fp8LinearImpl*>(gelu_producer);
      const bool want = producer != nullptr && producer->wants_current_amax();
      at::Tensor a;
      dx = gelu_run(saved[4], dx, want, a);
      if (want) producer->hand_off_grad_amax(dx, a);
    }
    return {dx, dw, db, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct GeluFn : public torch::autograd::Function<GeluFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& pre,
                            int64_t producer_ptr, int64_t consumer_ptr) {
    auto* consumer = reinterpret_cast<Fp8LinearImpl*>(consumer_ptr);
    const bool want = consumer != nullptr && consumer->wants_current_amax();
    at::Tensor a;
    at::Tensor h = gelu_run(pre, {}, want, a);
    if (want) consumer->hand_off_input_amax(h, a);
    ctx->save_for_backward({pre});
    ctx->saved_data["producer"] = producer_ptr;
    return h;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor& dh = grads[0];
    if (!dh.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const at::Tensor pre = ctx->get_saved_variables()[0];
    auto* producer = reinterpret_cast<Fp8LinearImpl*>(ctx->saved_data["producer"].toInt());
    const bool want = producer != nullptr && producer->wants_current_amax();
    at::Tensor a;
    at::Tensor dpre = gelu_run(pre, dh, want, a);
    if (want) producer->hand_off_grad_amax(dpre, a);
    return {dpre, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

Fp8LinearImpl::Fp8LinearImpl(Fp8Options options) : opts_(std::move(options)) {
  PARALLAX_CHECK(opts_.amax_history >= 1, ConfigError,
                 "key 'precision.fp8.amax_history': must be >= 1, got {}", opts_.amax_history);
  if (opts_.recipe == Recipe::kDelayed) {
    // Through units::init_zeros, so that a model built without storage records its recipe.
    amax_history = register_buffer("amax_history", units::init_zeros({3, opts_.amax_history}));
  }
}

void Fp8LinearImpl::history_loaded() {
  if (opts_.recipe != Recipe::kDelayed) return;
  history_amax = amax_history.amax(1);
  initialized_ = history_amax.max().item<float>() > 0.f;
}

at::Tensor Fp8LinearImpl::forward(const at::Tensor& x, const at::Tensor& weight,
                                  const at::Tensor& bias) {
  PARALLAX_CHECK(x.dim() >= 1 && weight.dim() == 2 && x.size(-1) == weight.size(1), Error,
                 "fp8 linear: input [..., {}] does not fit the weight [{}, {}]",
                 x.dim() ? x.size(-1) : 0, weight.size(0), weight.size(1));
  PARALLAX_CHECK(fp8_linear_supported(weight.size(1), weight.size(0)), Error,
                 "fp8 linear: weight [{}, {}] needs both dimensions to be multiples of {}",
                 weight.size(0), weight.size(1), kGranule);
  if (opts_.recipe == Recipe::kDelayed &&
      (!step_amax.defined() || step_amax.device() != amax_history.device()))
    step_amax = at::zeros({3}, amax_history.options());
  // Autograd functions take no undefined tensor: no bias (or no handed amax) is an empty one.
  at::Tensor x_amax = take_input_amax(x);
  if (!x_amax.defined()) x_amax = at::empty({0}, weight.options().dtype(at::kFloat));
  return Fp8LinearFn::apply(x, weight, bias.defined() ? bias : at::empty({0}, weight.options()),
                            x_amax, reinterpret_cast<int64_t>(this), int64_t{-1});
}

bool Fp8LinearImpl::folds_gelu() const {
  return opts_.recipe == Recipe::kDelayed && initialized_ && opts_.fused;
}

at::Tensor Fp8LinearImpl::forward_gelu(const at::Tensor& pre, const at::Tensor& weight,
                                       const at::Tensor& bias, Fp8LinearImpl* producer) {
  PARALLAX_CHECK(folds_gelu(), Error,
                 "fp8 linear: forward_gelu needs the delayed recipe after its first step");
  PARALLAX_CHECK(pre.dim() >= 1 && weight.dim() == 2 && pre.size(-1) == weight.size(1), Error,
                 "fp8 linear: input [..., {}] does not fit the weight [{}, {}]",
                 pre.dim() ? pre.size(-1) : 0, weight.size(0), weight.size(1));
  if (!step_amax.defined() || step_amax.device() != amax_history.device())
    step_amax = at::zeros({3}, amax_history.options());
  return Fp8LinearFn::apply(pre, weight, bias.defined() ? bias : at::empty({0}, weight.options()),
                            at::empty({0}, weight.options().dtype(at::kFloat)),
                            reinterpret_cast<int64_t>(this), reinterpret_cast<int64_t>(producer));
}

void Fp8LinearImpl::hand_off_input_amax(const at::Tensor& x, const at::Tensor& amax) {
  pending_input_ = {x, amax};
}

void Fp8LinearImpl::hand_off_grad_amax(const at::Tensor& g, const at::Tensor& amax) {
  pending_grad_ = {g, amax};
}

at::Tensor Fp8LinearImpl::take(HandOff& slot, const at::Tensor& t) {
  at::Tensor a;
  if (slot.tensor.defined() && t.defined() &&
      slot.tensor.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) {
    a = slot.amax;
    ++hand_offs_taken_;
  }
  slot = {};
  return a;
}

at::Tensor gelu(const at::Tensor& pre, Fp8LinearImpl* producer, Fp8LinearImpl* consumer) {
  return GeluFn::apply(pre, reinterpret_cast<int64_t>(producer),
                       reinterpret_cast<int64_t>(consumer));
}

Fp8LinearImpl* fp8_child(torch::nn::Module& layer) {
  for (const auto& item : layer.named_children()) {
    if (item.key() == "fp8") return dynamic_cast<Fp8LinearImpl*>(item.value().get());
  }
  return nullptr;
}

void roll_histories(const std::vector<Fp8LinearImpl*>& layers, const AmaxReducer& reduce) {
  std::vector<Fp8LinearImpl*> delayed;
  std::vector<at::Tensor> steps;
  for (Fp8LinearImpl* l : layers) {
    if (l->opts_.recipe != Recipe::kDelayed) continue;
    if (!l->step_amax.defined()) l->step_amax = at::zeros({3}, l->amax_history.options());
    delayed.push_back(l);
    steps.push_back(l->step_amax);
  }
  if (delayed.empty()) return;
  at::Tensor flat = at::cat(steps);
  if (reduce) reduce(flat);
  for (std::size_t i = 0; i < delayed.size(); ++i) {
    Fp8LinearImpl& l = *delayed[i];
    const int64_t h = l.amax_history.size(1);
    at::NoGradGuard no_grad;
    if (h > 1) {
      l.amax_history.narrow(1, 1, h - 1).copy_(l.amax_history.narrow(1, 0, h - 1).clone());
    }
    l.amax_history.select(1, 0).copy_(flat.narrow(0, static_cast<int64_t>(3 * i), 3));
    l.step_amax.zero_();
    // In place: a CUDA graph that captured this step (train.cuda_graph) reads the scales from the
    // address it saw, so the tensor must stay the same one step after step.
    if (l.history_amax.defined() && l.history_amax.device() == l.amax_history.device()) {
      l.history_amax.copy_(l.amax_history.amax(1));
    } else {
      l.history_amax = l.amax_history.amax(1);
    }
    l.initialized_ = true;
  }
}

std::vector<Fp8LinearImpl*> fp8_layers(torch::nn::Module& module) {
  std::vector<Fp8LinearImpl*> out;
  for (const auto& m : module.modules(/*include_self=*/true)) {
    if (auto* l = dynamic_cast<Fp8LinearImpl*>(m.get())) out.push_back(l);
  }
  return out;
}

}  // namespace parallax::kernels::fp8
