// FP8 linear layers (kernels layer): y = x W^T + b with both GEMMs of the backward, all three on
// FP8 tensor cores through ATen's _scaled_mm, as torchao's Float8Linear and Transformer Engine do.
//
//   Fp8Linear fp8(options);                       // one per linear layer: its scaling state
//   at::Tensor y = fp8.forward(x, weight, bias);  // autograd: grads of x, weight and bias
//
// Formats (the OCP FP8 formats of Hopper's tensor cores): the forward's operands, the input x and
// the weight W, are cast to E4M3 (max 448, 3 mantissa bits); the gradient of the output to E5M2
// (max 57344, 2 mantissa bits, the range gradients need). The input gradient dX = dY W runs as
// E5M2 x E4M3 and the weight gradient dW = dY^T X as E5M2 x E4M3; both accumulate in fp32 inside
// the tensor cores. The forward's output and dX are bf16; dW is fp32 (the master weights' dtype),
// so nothing the optimizer sees is rounded to FP8 other than through the GEMM's operands.
//
// Scaling (per tensor, torchao's amax_to_scale): scale = fmax / max(amax, 1e-12) in fp32, the cast
// is saturate(x * scale) rounded to nearest even, and the GEMM multiplies its fp32 accumulator by
// 1 / scale_a * 1 / scale_b. Every scale stays on the device, so no step waits on the host.
//   - current (torchao's default "dynamic"): amax of the tensor being cast, one reduction kernel
//     before each cast;
//   - delayed (Transformer Engine's recipe): the largest amax of the last `history` steps, so the
//     cast needs no reduction before it; the cast kernel records this step's amax as it goes, and
//     roll_histories() pushes the step's amaxes into the histories (after a MAX over the replicas,
//     so that every rank keeps the same history and a checkpoint holds one copy). Until the first
//     roll a layer scales by the current amax.
// Sharded tensors (tensor parallelism): Fp8Options's reducers take the amax (a 1-element fp32
// device tensor) and all-reduce it with MAX over the group, so every rank of a TP group casts with
// one scale; the current recipe calls them in forward and backward, the delayed recipe never (the
// histories are reduced in roll_histories()).
//
// Shapes: x [..., K], W [N, K]; K and N must be multiples of 16 (fp8_linear_supported(); the
// tensor cores' FP8 tile), any number of rows. Rows are padded to a multiple of 16 with zeros
// where the weight gradient's inner dimension needs it.
//
// The fused CUDA kernels (CUDA inputs of fp32/bf16/fp16) compute bit for bit what the ATen
// composition does (cast_to_fp8 with fused = false), which runs on any device; _scaled_mm itself
// runs on CUDA devices of compute capability >= 8.9 and on the CPU (tests).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace parallax::kernels::fp8 {

enum class Format { kE4M3, kE5M2 };
// 448 (E4M3) or 57344 (E5M2): the largest finite value.
float max_finite(Format f);
at::ScalarType scalar_type(Format f);
const char* to_string(Format f);

enum class Recipe { kCurrent, kDelayed };
// "current" | "delayed"; ConfigError naming `key` otherwise.
Recipe parse_recipe(const std::string& name, const std::string& key);
const char* to_string(Recipe r);

// The smallest amax a scale is taken from (torchao's EPS): an all-zero tensor gets a finite scale.
constexpr float kAmaxFloor = 1e-12f;

// max |x| over all elements as a 1-element fp32 tensor on x's device; NaN if any element is NaN.
at::Tensor amax(const at::Tensor& x, bool fused = true);
// fmax / max(amax, kAmaxFloor), fp32, on amax's device.
at::Tensor scale_from_amax(const at::Tensor& amax, Format f);

struct Casted {
  at::Tensor data;       // [M, K] fp8, row-major (undefined unless asked for)
  at::Tensor data_t;     // [K, Mp] fp8 contiguous, the transpose, Mp = M rounded up to pad_t
                         // (columns M.. are zero); undefined unless asked for
  at::Tensor inv_scale;  // [1] fp32: 1 / scale, what _scaled_mm multiplies by
  at::Tensor col_sum;    // [K] fp32: x's column sums (undefined unless asked for)
};
// Casts the 2-D tensor x (fp32, bf16 or fp16) to format f with scale_from_amax(amax_for_scale).
// `amax_out` (optional, 1-element fp32 on x's device): max-accumulates max |x| into it (the
// delayed recipe's record of this step). `col_sum`: also x's column sums in fp32, from the same
// read of x (an output gradient's: the bias gradient), summed in a fixed order, so bitwise
// reproducible though not in ATen's order. `fused` = false: the ATen composition. `gelu`: casts
// gelu(x) (what gelu() below writes, never stored) instead of x; the amax and sums are its.
Casted cast_to_fp8(const at::Tensor& x, const at::Tensor& amax_for_scale, Format f, bool rowmajor,
                   bool transposed, int64_t pad_t = 1, const at::Tensor& amax_out = {},
                   bool fused = true, bool col_sum = false, bool gelu = false);

// Why `device` cannot run FP8 GEMMs ("" when it can): the CPU (training in FP8 runs on GPUs
// only), or a CUDA device of compute capability below 8.9 (no FP8 tensor cores: before Ada and
// Hopper), named with its capability.
std::string fp8_device_blocker(const c10::Device& device);

// Whether a [N, K] weight can run as an FP8 GEMM (K, N multiples of 16).
bool fp8_linear_supported(int64_t in_features, int64_t out_features);

// MAX all-reduce, elementwise and in place, of a small fp32 tensor on the layers' device over a
// group (see the header comment); it must not wait on the host.
using AmaxReducer = std::function<void(at::Tensor& amax)>;

struct Fp8Options {
  Recipe recipe = Recipe::kCurrent;
  int64_t amax_history = 16;  // delayed: steps of history
  // Tensor parallelism: which of the three tensors are sharded over the group, and its MAX
  // all-reduce. Unset: nothing is reduced.
  AmaxReducer reduce;
  bool input_sharded = false, weight_sharded = false, grad_sharded = false;
  bool fused = true;  // false: the ATen composition (tests)
};

// A linear layer whose GEMM can run in FP8: models/layers.h's DenseLinear and parallel/tensor's
// column- and row-parallel layers, so that models::enable_fp8 switches every linear a block's
// factory built without naming the tensor-parallel types. Errors: as each layer states (its shape
// does not take the FP8 GEMMs, it is FP8 already).
class Fp8Capable {
 public:
  virtual ~Fp8Capable() = default;
  virtual void enable_fp8(const Fp8Options& options) = 0;
};

// One linear layer's FP8 state. Under the delayed recipe it holds the buffer "amax_history"
// [3, H] fp32 (rows: input, weight, output gradient; column 0 the newest step) and this step's
// running amaxes (not a buffer: roll_histories() empties it at each step's end); under the current
// recipe no state at all. A torch Module so that the history is checkpointed with the model.
class Fp8LinearImpl : public torch::nn::Module {
 public:
  explicit Fp8LinearImpl(Fp8Options options);
  // y = x W^T + b in FP8 (see the header comment); bias optional. Under autograd.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias = {});

  const Fp8Options& options() const { return opts_; }

  // y = gelu(pre) W^T + b, the GELU folded into this layer's input cast (bench/NOTES.md, lever
  // 39): gelu(pre) is never written in bf16, and the backward returns d pre (handing its amax to
  // `producer`, the layer that computed pre, as gelu() does). The same bits as gelu() followed by
  // forward(). Only where folds_gelu(): the delayed recipe's scale is known before the cast (the
  // current recipe would need the amax of gelu(pre) first), on the fused kernels.
  bool folds_gelu() const;
  at::Tensor forward_gelu(const at::Tensor& pre, const at::Tensor& weight, const at::Tensor& bias,
                          Fp8LinearImpl* producer);

  // Hand-offs from the kernel that wrote a tensor this layer will cast (gelu() below): the amax of
  // its next input (forward) or of its next output gradient (backward), so that the layer need not
  // read the tensor once more for it. Taken by the next forward or backward only, and only when it
  // gets that very tensor (the hand-off keeps it alive, and the layer compares identity); anything
  // else (a dropout between the two) falls back to the layer's own amax pass.
  void hand_off_input_amax(const at::Tensor& x, const at::Tensor& amax);
  void hand_off_grad_amax(const at::Tensor& g, const at::Tensor& amax);
  // Whether the next cast scales by a current amax (the current recipe, or the delayed recipe
  // before its first roll): only then is a hand-off of use.
  bool wants_current_amax() const { return opts_.recipe == Recipe::kCurrent || !initialized_; }
  // How many hand-offs were taken (tests: whether the fused path ran).
  int64_t hand_offs_taken() const { return hand_offs_taken_; }
  // The hand-off for `t` (undefined when there is none for it); clears the slot either way.
  at::Tensor take_input_amax(const at::Tensor& x) { return take(pending_input_, x); }
  at::Tensor take_grad_amax(const at::Tensor& g) { return take(pending_grad_, g); }
  // Delayed: whether a step has been rolled into the history (else the layer scales by the
  // current amax). Recomputed from the history after a checkpoint load by history_loaded().
  bool initialized() const { return initialized_; }
  void history_loaded();

  at::Tensor amax_history;  // delayed only
  at::Tensor step_amax;     // delayed only: [3] this step's running max, on the history's device
  at::Tensor history_amax;  // delayed only: [3] the history's max per row, the scales' source

 private:
  friend void roll_histories(const std::vector<Fp8LinearImpl*>&, const AmaxReducer&);
  struct HandOff {
    at::Tensor tensor, amax;
  };
  at::Tensor take(HandOff& slot, const at::Tensor& t);
  Fp8Options opts_;
  bool initialized_ = false;
  HandOff pending_input_, pending_grad_;
  int64_t hand_offs_taken_ = 0;
};
TORCH_MODULE(Fp8Linear);

// h = gelu(pre), the erf form, between two FP8 linear layers: `producer` computed pre and
// `consumer` takes h (either may be null). On CUDA one kernel writes h and its amax, handed to the
// consumer, and the backward's one kernel writes d pre and its amax, handed to the producer: each
// layer skips an amax pass over the MLP's widest tensor (bench/NOTES.md lever 35). The values are
// ATen's gelu and gelu_backward arithmetic (fp32, rounded once to pre's dtype); elsewhere, or for
// inputs the kernel does not take, ATen's ops and the layers' own amax passes.
at::Tensor gelu(const at::Tensor& pre, Fp8LinearImpl* producer, Fp8LinearImpl* consumer);

// The Fp8Linear a linear layer registered as its child "fp8" (models/layers.h, the tp layers), or
// nullptr.
Fp8LinearImpl* fp8_child(torch::nn::Module& layer);

// Delayed recipe, at the end of each optimizer step: MAX-reduces every layer's step amaxes over
// the replicas with `reduce` (one collective for all layers; unset: none), pushes them into the
// histories (dropping the oldest column) and zeroes the running amaxes. Layers of the current
// recipe are skipped. All layers must be on one device.
void roll_histories(const std::vector<Fp8LinearImpl*>& layers, const AmaxReducer& reduce);

// Every Fp8Linear inside `module` (recursively).
std::vector<Fp8LinearImpl*> fp8_layers(torch::nn::Module& module);

}  // namespace parallax::kernels::fp8
