#include "checkpoint/finite.h"

#include "core/error.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <utility>

namespace parallax::checkpoint {
namespace {

// Elements whose bits satisfy (x & mask) == match are NaN or infinite: an all-ones exponent for
// the IEEE-like formats, the single NaN pattern for the float8 formats without infinities.
template <class U>
bool scan_bits(const void* data, int64_t n, U mask, U match, bool parallel) {
  const auto* p = static_cast<const U*>(data);
  auto any_bad = [&](int64_t begin, int64_t end) {
    // An OR over the range rather than an early exit: the loop vectorises, and non-finite values
    // are the rare case.
    unsigned bad = 0;
    for (int64_t i = begin; i < end; ++i) {
      U x;
      std::memcpy(&x, p + i, sizeof(U));
      bad |= static_cast<unsigned>((x & mask) == match);
    }
    return bad != 0;
  };
  constexpr int64_t kGrain = int64_t{1} << 18;
  if (!parallel || n < 2 * kGrain || at::get_num_threads() < 2) return !any_bad(0, n);
  std::atomic<bool> bad{false};
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    if (!bad.load(std::memory_order_relaxed) && any_bad(begin, end)) bad = true;
  });
  return !bad.load();
}

// One 0-d bool tensor on `t`'s device: true when `t` is finite. Contiguous tensors are reduced in
// chunks so that the temporary stays bounded.
at::Tensor finite_flag_on_device(const at::Tensor& t) {
  constexpr int64_t kChunk = int64_t{64} << 20;
  auto flag = [](const at::Tensor& x) -> at::Tensor {
    switch (x.scalar_type()) {
      case at::kFloat8_e4m3fn:
        return (x.view(at::kByte).bitwise_and(0x7f) != 0x7f).all();
      case at::kFloat8_e5m2:
        return (x.view(at::kByte).bitwise_and(0x7c) != 0x7c).all();
      case at::kFloat8_e4m3fnuz:
      case at::kFloat8_e5m2fnuz:
        return (x.view(at::kByte) != 0x80).all();
      default:
        return at::isfinite(x).all();
    }
  };
  if (!t.is_contiguous() || t.numel() <= kChunk) return flag(t);
  std::vector<at::Tensor> parts;
  for (const at::Tensor& c : t.reshape({-1}).split(kChunk)) parts.push_back(flag(c));
  return at::stack(parts).all();
}

}  // namespace

bool can_be_nonfinite(at::ScalarType dtype) {
  return at::isFloatingType(dtype) || at::isComplexType(dtype);
}

bool all_finite(const void* data, int64_t numel, at::ScalarType dtype, bool parallel) {
  if (numel <= 0) return true;
  switch (dtype) {
    case at::kFloat:
      return scan_bits<uint32_t>(data, numel, 0x7f800000u, 0x7f800000u, parallel);
    case at::kComplexFloat:
      return scan_bits<uint32_t>(data, 2 * numel, 0x7f800000u, 0x7f800000u, parallel);
    case at::kDouble:
      return scan_bits<uint64_t>(data, numel, 0x7ff0000000000000ull, 0x7ff0000000000000ull,
                                 parallel);
    case at::kComplexDouble:
      return scan_bits<uint64_t>(data, 2 * numel, 0x7ff0000000000000ull, 0x7ff0000000000000ull,
                                 parallel);
    case at::kHalf:
      return scan_bits<uint16_t>(data, numel, 0x7c00, 0x7c00, parallel);
    case at::kBFloat16:
      return scan_bits<uint16_t>(data, numel, 0x7f80, 0x7f80, parallel);
    case at::kFloat8_e5m2:
      return scan_bits<uint8_t>(data, numel, 0x7c, 0x7c, parallel);
    case at::kFloat8_e4m3fn:
      return scan_bits<uint8_t>(data, numel, 0x7f, 0x7f, parallel);
    case at::kFloat8_e4m3fnuz:
    case at::kFloat8_e5m2fnuz:
      return scan_bits<uint8_t>(data, numel, 0xff, 0x80, parallel);
    default:
      break;
  }
  if (!can_be_nonfinite(dtype)) return true;
  // Another floating format: let ATen decide, on a float copy (rare; never a checkpoint dtype).
  const at::Tensor t =
      at::from_blob(const_cast<void*>(data), {numel}, at::TensorOptions().dtype(dtype));
  return at::isfinite(t.to(at::kDouble)).all().item<bool>();
}

int64_t first_nonfinite(const std::vector<at::Tensor>& tensors, bool parallel) {
  int64_t first = -1;  // the first culprit among host tensors scanned in place
  // Per device: the indices of its tensors and their finite flags, fetched with one copy.
  std::vector<std::pair<c10::Device, std::pair<std::vector<int64_t>, std::vector<at::Tensor>>>>
      pending;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (!t.defined() || t.numel() == 0 || !can_be_nonfinite(t.scalar_type())) continue;
    if (t.is_cpu() && t.is_contiguous()) {
      if (first < 0 && !all_finite(t.const_data_ptr(), t.numel(), t.scalar_type(), parallel))
        first = static_cast<int64_t>(i);
      continue;
    }
    auto it = std::find_if(pending.begin(), pending.end(),
                           [&](const auto& p) { return p.first == t.device(); });
    if (it == pending.end()) {
      pending.emplace_back(t.device(),
                           std::make_pair(std::vector<int64_t>{}, std::vector<at::Tensor>{}));
      it = std::prev(pending.end());
    }
    it->second.first.push_back(static_cast<int64_t>(i));
    it->second.second.push_back(finite_flag_on_device(t));
  }
  for (const auto& [device, p] : pending) {
    const at::Tensor ok = at::stack(p.second).to(at::kCPU);
    const bool* f = ok.const_data_ptr<bool>();
    for (size_t k = 0; k < p.first.size(); ++k) {
      if (!f[k]) {
        if (first < 0 || p.first[k] < first) first = p.first[k];
        break;
      }
    }
  }
  return first;
}

NonFiniteCount count_nonfinite(const at::Tensor& t) {
  NonFiniteCount c;
  if (!t.defined() || t.numel() == 0 || !can_be_nonfinite(t.scalar_type())) return c;
  at::Tensor x = t;
  if (c10::isFloat8Type(t.scalar_type())) x = t.to(at::kFloat);
  c.nan = at::isnan(x).sum().item<int64_t>();
  c.inf = at::isinf(x).sum().item<int64_t>();
  return c;
}

void require_finite(const std::vector<std::pair<std::string, at::Tensor>>& named,
                    const std::string& source, const std::string& advice) {
  std::vector<at::Tensor> tensors;
  tensors.reserve(named.size());
  for (const auto& [name, t] : named) tensors.push_back(t.detach());
  const int64_t bad = first_nonfinite(tensors, /*parallel=*/true);
  if (bad < 0) return;
  const auto& [name, t] = named[static_cast<size_t>(bad)];
  const NonFiniteCount c = count_nonfinite(t.detach());
  throw_error<CheckpointError>("{}: tensor '{}' holds {} NaN and {} infinite value(s) of {}; {}",
                               source, name, c.nan, c.inf, t.numel(), advice);
}

void require_finite(const torch::nn::Module& module, const std::string& source,
                    const std::string& advice) {
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (const auto& p : module.named_parameters()) named.emplace_back(p.key(), p.value());
  for (const auto& b : module.named_buffers()) named.emplace_back(b.key(), b.value());
  require_finite(named, source, advice);
}

}  // namespace parallax::checkpoint
