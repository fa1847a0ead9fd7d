// The argument checks every backend's ops share (CommBase::check_*_args, check_tensor): each
// throws CommError naming the op, group, rank and offending value before the op is opened, in one
// fixed order so that the first failure is the one reported.
#include "comm/comm_base.h"

#include "core/error.h"

#include <fmt/ranges.h>

namespace parallax::comm::detail {

void check_tensor(const CommBase& c, const char* op, const at::Tensor& t, c10::DeviceType device,
                  bool contiguous) {
  PARALLAX_CHECK(t.defined(), CommError, "{} on group '{}' (rank {}): undefined tensor", op,
                 c.name(), c.rank());
  PARALLAX_CHECK(!contiguous || t.is_contiguous(), CommError,
                 "{} on group '{}' (rank {}): tensor of shape [{}] is not contiguous", op, c.name(),
                 c.rank(), fmt::join(t.sizes(), ", "));
  PARALLAX_CHECK(t.device().type() == device, CommError,
                 "{} on group '{}' (rank {}): the {} backend needs {} tensors, got a tensor on {}",
                 op, c.name(), c.rank(), c.backend(), c10::DeviceTypeName(device, true),
                 t.device().str());
}

namespace {

// `chunk` has `whole`'s dtype and this rank's share of its elements (chunk_numel).
void check_chunk_shapes(const CommBase& c, const char* op, const at::Tensor& whole,
                        const char* whole_name, const at::Tensor& chunk, const char* chunk_name) {
  const int n = c.size();
  const int64_t m = whole.numel(), want = chunk_numel(m, n, c.rank());
  PARALLAX_CHECK(chunk.scalar_type() == whole.scalar_type(), CommError,
                 "{} on group '{}' (rank {}): {} is {} but {} is {}", op, c.name(), c.rank(),
                 whole_name, c10::toString(whole.scalar_type()), chunk_name,
                 c10::toString(chunk.scalar_type()));
  PARALLAX_CHECK(chunk.numel() == want, CommError,
                 "{} on group '{}' (rank {}): {} has {} elements but chunk {} of the {}-element {} "
                 "over {} ranks "
                 "has {}",
                 op, c.name(), c.rank(), chunk_name, chunk.numel(), c.rank(), m, whole_name, n,
                 want);
}

}  // namespace

void CommBase::check_op_tensor(const char* op, const at::Tensor& t, bool contiguous) const {
  check_tensor(*this, op, t, device_type(), contiguous);
}

void CommBase::check_all_reduce_args(const char* op, const at::Tensor& tensor,
                                     bool contiguous) const {
  check_op_tensor(op, tensor, contiguous);
  check_op_dtype(op, tensor, true);
}

void CommBase::check_reduce_scatter_args(const at::Tensor& input, const at::Tensor& output) const {
  check_op_tensor("reduce_scatter", input, true);
  check_op_tensor("reduce_scatter", output, true);
  check_op_dtype("reduce_scatter", input, true);
  check_chunk_shapes(*this, "reduce_scatter", input, "input", output, "output");
}

int64_t CommBase::check_all_gather_args(const at::Tensor& input, const at::Tensor& output) const {
  check_op_tensor("all_gather", input, true);
  check_op_tensor("all_gather", output, true);
  check_op_dtype("all_gather", input, false);
  check_chunk_shapes(*this, "all_gather", output, "output", input, "input");
  return output.numel();
}

int64_t CommBase::check_all_gather_args(const at::Tensor& input,
                                        const std::vector<at::Tensor>& outputs) const {
  check_op_tensor("all_gather", input, true);
  check_op_dtype("all_gather", input, false);
  const int n = size();
  PARALLAX_CHECK(static_cast<int>(outputs.size()) == n, CommError,
                 "all_gather on group '{}' (rank {}): {} output tensors for {} ranks", name_, rank_,
                 outputs.size(), n);
  int64_t total = 0;
  for (int r = 0; r < n; ++r) {
    const auto& o = outputs[static_cast<size_t>(r)];
    PARALLAX_CHECK(o.defined() && o.scalar_type() == input.scalar_type(), CommError,
                   "all_gather on group '{}' (rank {}): output {} is {} but the input is {}", name_,
                   rank_, r, o.defined() ? c10::toString(o.scalar_type()) : "undefined",
                   c10::toString(input.scalar_type()));
    total += o.numel();
  }
  const auto& mine = outputs[static_cast<size_t>(rank_)];
  PARALLAX_CHECK(
      mine.numel() == input.numel(), CommError,
      "all_gather on group '{}' (rank {}): output {} has {} elements but the input has {}", name_,
      rank_, rank_, mine.numel(), input.numel());
  for (const auto& o : outputs) check_op_tensor("all_gather", o, true);
  return total;
}

void CommBase::check_broadcast_args(const at::Tensor& tensor, int root) const {
  check_op_tensor("broadcast", tensor, true);
  check_op_dtype("broadcast", tensor, false);
  PARALLAX_CHECK(root >= 0 && root < size(), CommError,
                 "broadcast on group '{}' (rank {}): root {} is not a rank of {}", name_, rank_,
                 root, size());
}

void CommBase::check_p2p_args(const char* op, const at::Tensor& tensor, int peer, int tag) const {
  check_op_tensor(op, tensor, true);
  check_op_dtype(op, tensor, false);
  PARALLAX_CHECK(peer >= 0 && peer < size() && peer != rank_, CommError,
                 "{} on group '{}' (rank {}): peer {} is not another rank of this group of {}", op,
                 name_, rank_, peer, size());
  PARALLAX_CHECK(tag >= 0 && tag < kMaxUserTag, CommError,
                 "{} on group '{}' (rank {}): tag {} is outside [0, {}) (larger tags are reserved)",
                 op, name_, rank_, tag, kMaxUserTag);
}

}  // namespace parallax::comm::detail
