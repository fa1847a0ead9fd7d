// Finiteness of checkpoint tensors: a checkpoint never commits a NaN or an infinity (a diverged
// run must not replace the last good state), `parallax inspect` reports them and `parallax export`
// refuses them unless forced.
//
// Cost: host tensors are scanned in place by their bits (no copy, no temporary; vectorised), GPU
// tensors are reduced on their device (one isfinite().all() per tensor, in chunks of at most 64 Mi
// elements so the temporary stays bounded) and the flags of one device reach the host in one copy.
// Only floating dtypes can be non-finite; the others are skipped.
//
// Thread-safety: pure functions. Pass parallel = false from background threads (the async writer)
// so that the scan does not compete with training for ATen's intra-op threads.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace torch::nn {
class Module;
}

namespace parallax::checkpoint {

// True for dtypes that can hold NaN or infinity (the floating types).
bool can_be_nonfinite(at::ScalarType dtype);

// True when none of the `numel` elements of `dtype` stored at `data` (host memory, C order) is NaN
// or infinite. Reads the bits only; any dtype (non-floating ones are always finite).
bool all_finite(const void* data, int64_t numel, at::ScalarType dtype, bool parallel);

// The index in `tensors` of the first tensor holding a NaN or an infinity, or -1 if there is none.
// Tensors may live on any device and be strided.
int64_t first_nonfinite(const std::vector<at::Tensor>& tensors, bool parallel);

struct NonFiniteCount {
  int64_t nan = 0;
  int64_t inf = 0;  // +inf and -inf
  bool any() const { return nan + inf > 0; }
};
// NaN and infinity counts of `t` (any device). Reduces over the whole tensor: meant for messages,
// after first_nonfinite found a culprit.
NonFiniteCount count_nonfinite(const at::Tensor& t);

// Weights loaded from `source` into a model must be finite before anything runs on them (a NaN
// there would otherwise surface as a NaN loss or a zero metric). Throws CheckpointError
// "<source>: tensor '<name>' holds N NaN and M infinite value(s) of T; <advice>" for the first of
// `named` (name, tensor: e.g. a module's parameters and buffers) that is not finite.
void require_finite(const std::vector<std::pair<std::string, at::Tensor>>& named,
                    const std::string& source, const std::string& advice);
// The same over `module`'s parameters and buffers (named by their module paths).
void require_finite(const torch::nn::Module& module, const std::string& source,
                    const std::string& advice);

}  // namespace parallax::checkpoint
