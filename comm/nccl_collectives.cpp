#ifdef PARALLAX_WITH_NCCL

// The nccl backend: collectives (nccl_internal.h has the class).
#include "comm/nccl_internal.h"

#include <algorithm>
#include <cstring>

namespace parallax::comm::detail::nccl {

bool is_float(c10::ScalarType t) {
  return at::isFloatingType(t);
}

ncclDataType_t nccl_type(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float:
      return ncclFloat32;
    case c10::ScalarType::Double:
      return ncclFloat64;
    case c10::ScalarType::Half:
      return ncclFloat16;
    case c10::ScalarType::BFloat16:
      return ncclBfloat16;
    case c10::ScalarType::Long:
      return ncclInt64;
    case c10::ScalarType::Int:
      return ncclInt32;
    case c10::ScalarType::Byte:
      return ncclUint8;
    case c10::ScalarType::Char:
      return ncclInt8;
    case c10::ScalarType::Bool:
      return ncclUint8;
    default:
      return ncclNumTypes;
  }
}

// Integers are averaged as a sum followed by a truncating division (the CPU backends' rule).
ncclRedOp_t nccl_op(ReduceOp op, c10::ScalarType t) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kAvg:
      return is_float(t) ? ncclAvg : ncclSum;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kMin:
      return ncclMin;
  }
  return ncclSum;
}

void divide_avg_if_needed(at::Tensor t, ReduceOp op, int n) {
  if (op == ReduceOp::kAvg && !is_float(t.scalar_type())) t.div_(n, "trunc");
}

WorkPtr NcclCommunicator::all_reduce_async(at::Tensor& tensor, ReduceOp op, AllReduceAlgo algo,
                                           CallSite site) {
  check_all_reduce_args("all_reduce", tensor);
  Ticket t = open_reduction(OpKind::kAllReduce, tensor, op, site, algo);
  if (size() == 1 || tensor.numel() == 0) return complete_now(t);
  at::Tensor target = tensor;
  if (algo == AllReduceAlgo::kRing) connect_ring_peers(t);
  return enqueue({t}, {target}, [&] { reduce_in_place(target, op, algo, t); });
}

WorkPtr NcclCommunicator::all_reduce_compressed_async(at::Tensor& tensor, ReduceOp op,
                                                      at::ScalarType wire, AllReduceAlgo algo,
                                                      CallSite site) {
  check_op_tensor("all_reduce", tensor, true);
  check_wire_dtype(*this, tensor, wire);
  if (wire == tensor.scalar_type()) return all_reduce_async(tensor, op, algo, site);
  PARALLAX_CHECK(nccl_type(wire) != ncclNumTypes, CommError,
                 "all_reduce_compressed on group '{}' (rank {}): wire dtype {} is not supported by "
                 "the nccl backend",
                 name_, rank_, c10::toString(wire));
  Ticket t = open_reduction(OpKind::kAllReduce, tensor, op, site, algo, wire);
  if (size() == 1 || tensor.numel() == 0) return complete_now(t);
  at::Tensor target = tensor;
  if (algo == AllReduceAlgo::kRing) connect_ring_peers(t);
  return enqueue({t}, {target}, [&] {
    at::Tensor copy = target.to(wire);
    reduce_in_place(copy, op, algo, t);
    target.copy_(copy);
  });
}

WorkPtr NcclCommunicator::all_reduce_coalesced_async(std::vector<at::Tensor>& tensors, ReduceOp op,
                                                     CallSite site) {
  if (tensors.empty()) return std::make_shared<DoneWork>();
  const auto dtype = tensors.front().scalar_type();
  int64_t total = 0;
  for (const auto& t : tensors) {
    check_all_reduce_args("all_reduce_coalesced", t, /*contiguous=*/false);
    // Mixed dtypes: one flat buffer per dtype (the default), each a single all-reduce.
    if (t.scalar_type() != dtype)
      return Communicator::all_reduce_coalesced_async(tensors, op, site);
    total += t.numel();
  }
  OpDesc d = tensor_desc(OpKind::kAllReduce, tensors.front(), site);
  d.reduce = op;
  d.shape = {total};
  d.numel = d.match_numel = total;
  d.tensors = static_cast<int>(tensors.size());
  Ticket t = begin(std::move(d));
  const int n = size();
  if (n == 1 || total == 0) return complete_now(t);
  return enqueue({t}, tensors, [&] {
    // A tensor whose elements are not one dense block (a strided view) is reduced through a
    // contiguous copy; gradients and parameters always are dense.
    std::vector<at::Tensor> targets;
    for (const auto& x : tensors) {
      targets.push_back(x.is_non_overlapping_and_dense() ? x : x.contiguous());
    }
    group_start(t);
    for (auto& x : targets) {
      if (x.numel() == 0) continue;
      call(ncclAllReduce(x.data_ptr(), x.data_ptr(), static_cast<size_t>(x.numel()),
                         nccl_type(dtype), nccl_op(op, dtype), comm_, stream_.stream()),
           "ncclAllReduce", t);
    }
    group_end(t, comm_);
    for (std::size_t i = 0; i < targets.size(); ++i) {
      divide_avg_if_needed(targets[i], op, n);
      if (!targets[i].is_same(tensors[i])) tensors[i].copy_(targets[i]);
    }
  });
}

WorkPtr NcclCommunicator::reduce_scatter_async(const at::Tensor& input, at::Tensor& output,
                                               ReduceOp op, CallSite site) {
  check_reduce_scatter_args(input, output);
  Ticket t = open_reduction(OpKind::kReduceScatter, input, op, site);
  const int n = size();
  const int64_t m = input.numel();
  if (m == 0) return complete_now(t);
  at::Tensor in = input, out = output;
  return enqueue({t}, {in, out}, [&] {
    const int64_t p = chunk_numel(m, n, 0);
    at::Tensor src = in.view({-1}), dst = out.view({-1});
    if (m % n != 0) {  // NCCL needs equal chunks: pad each to the largest
      at::Tensor padded = at::zeros({n * p}, in.options());
      for (int r = 0; r < n; ++r) {
        padded.narrow(0, r * p, chunk_numel(m, n, r))
            .copy_(src.narrow(0, chunk_offset(m, n, r), chunk_numel(m, n, r)));
      }
      src = padded;
      dst = at::empty({p}, in.options());
    }
    call(ncclReduceScatter(src.data_ptr(), dst.data_ptr(), static_cast<size_t>(p),
                           nccl_type(in.scalar_type()), nccl_op(op, in.scalar_type()), comm_,
                           stream_.stream()),
         "ncclReduceScatter", t);
    divide_avg_if_needed(dst, op, n);
    if (dst.data_ptr() != out.data_ptr()) out.view({-1}).copy_(dst.narrow(0, 0, out.numel()));
  });
}

WorkPtr NcclCommunicator::all_gather_async(const at::Tensor& input, at::Tensor& output,
                                           CallSite site) {
  const int64_t total = check_all_gather_args(input, output);
  Ticket t = open_all_gather(OpKind::kAllGather, input, total, site);
  if (total == 0) return complete_now(t);
  const int n = size();
  at::Tensor in = input, out = output;
  return enqueue({t}, {in, out}, [&] {
    if (total % n ==
        0) {  // equal chunks: straight into the output (in place when `in` is our chunk)
      call(ncclAllGather(in.data_ptr(), out.data_ptr(), static_cast<size_t>(total / n),
                         nccl_type(in.scalar_type()), comm_, stream_.stream()),
           "ncclAllGather", t);
      return;
    }
    // Uneven chunks only: the per-rank views of the output (their construction is host time on
    // every call, which the even path, the common one, does not need).
    std::vector<int64_t> sizes;
    std::vector<at::Tensor> outs;
    for (int r = 0; r < n; ++r) {
      sizes.push_back(chunk_numel(total, n, r));
      outs.push_back(out.view({-1}).narrow(0, chunk_offset(total, n, r), sizes.back()));
    }
    gather_padded(in, sizes, outs, t);
  });
}

WorkPtr NcclCommunicator::all_gather_async(const at::Tensor& input,
                                           std::vector<at::Tensor>& outputs, CallSite site) {
  const int64_t total = check_all_gather_args(input, outputs);
  std::vector<int64_t> sizes;
  std::vector<at::Tensor> outs;
  for (auto& o : outputs) {
    sizes.push_back(o.numel());
    outs.push_back(o.view({-1}));
  }
  Ticket t = open_all_gather(OpKind::kAllGatherList, input, total, site);
  if (total == 0) return complete_now(t);
  std::vector<at::Tensor> keep = outputs;
  keep.push_back(input);
  at::Tensor in = input;
  return enqueue({t}, keep, [&] { gather_padded(in, sizes, outs, t); });
}

WorkPtr NcclCommunicator::broadcast_async(at::Tensor& tensor, int root, CallSite site) {
  check_broadcast_args(tensor, root);
  Ticket t = open_rooted(OpKind::kBroadcast, tensor, root, site);
  if (size() == 1 || tensor.numel() == 0) return complete_now(t);
  at::Tensor x = tensor;
  return enqueue({t}, {x}, [&] {
    call(ncclBroadcast(x.data_ptr(), x.data_ptr(), static_cast<size_t>(x.numel()),
                       nccl_type(x.scalar_type()), root, comm_, stream_.stream()),
         "ncclBroadcast", t);
  });
}

WorkPtr NcclCommunicator::barrier_async(BarrierKind kind, CallSite site) {
  Ticket t = open_barrier(kind, site);
  if (size() == 1) return complete_now(t);
  // NCCL has no barrier: a one-element all-reduce, which completes only when every rank issued
  // it.
  if (!barrier_buf_.defined()) {
    c10::cuda::CUDAGuard g(device_);
    barrier_buf_ = at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(device_));
  }
  at::Tensor b = barrier_buf_;
  return enqueue({t}, {b}, [&] {
    call(ncclAllReduce(b.data_ptr(), b.data_ptr(), 1, ncclInt32, ncclSum, comm_, stream_.stream()),
         "ncclAllReduce", t);
  });
}

std::vector<std::vector<uint8_t>> NcclCommunicator::allgather_bytes(
    const std::vector<uint8_t>& mine, const Ticket& t) {
  const int n = size();
  const int64_t len = static_cast<int64_t>(mine.size());
  c10::cuda::CUDAGuard g(device_);
  at::Tensor host = at::empty({len}, at::kByte);
  std::memcpy(host.data_ptr(), mine.data(), mine.size());
  at::Tensor in = host.to(device_);
  at::Tensor out = at::empty({n * len}, in.options());
  auto w = enqueue(
      {t}, {in, out},
      [&] {
        call(ncclAllGather(in.data_ptr(), out.data_ptr(), static_cast<size_t>(len), ncclUint8,
                           comm_, stream_.stream()),
             "ncclAllGather", t);
      },
      /*record=*/false);
  w->wait();
  at::Tensor all = out.cpu();
  std::vector<std::vector<uint8_t>> res(static_cast<size_t>(n));
  const auto* p = all.data_ptr<uint8_t>();
  for (int r = 0; r < n; ++r) res[static_cast<size_t>(r)].assign(p + r * len, p + (r + 1) * len);
  return res;
}

void NcclCommunicator::check_op_tensor(const char* op, const at::Tensor& t, bool contiguous) const {
  check_tensor(*this, op, t, c10::DeviceType::CUDA, contiguous);
  PARALLAX_CHECK(t.device() == device_, CommError,
                 "{} on group '{}' (rank {}): tensor on {} but the communicator uses {}", op, name_,
                 rank_, t.device().str(), device_.str());
}

void NcclCommunicator::check_op_dtype(const char* op, const at::Tensor& t, bool reduces) const {
  PARALLAX_CHECK(nccl_type(t.scalar_type()) != ncclNumTypes, CommError,
                 "{} on group '{}' (rank {}): dtype {} is not supported by the nccl backend", op,
                 name_, rank_, c10::toString(t.scalar_type()));
  PARALLAX_CHECK(!reduces || t.scalar_type() != c10::ScalarType::Bool, CommError,
                 "{} on group '{}' (rank {}): bool tensors cannot be reduced", op, name_, rank_);
}

void NcclCommunicator::call(ncclResult_t rc, const char* what, const Ticket& t, ncclComm_t comm) {
  if (!comm) comm = comm_;
  if (rc == ncclSuccess) return;
  if (rc == ncclInProgress) {
    wait_ready(comm, t.deadline, what);
    return;
  }
  throw CommError(fmt::format("{}: {}", what, nccl_error(rc, comm)));
}

void NcclCommunicator::reduce_in_place(at::Tensor& x, ReduceOp op, AllReduceAlgo algo,
                                       const Ticket& t) {
  if (algo == AllReduceAlgo::kRing) {
    ring(x.view({-1}), op, t);
    return;
  }
  call(ncclAllReduce(x.data_ptr(), x.data_ptr(), static_cast<size_t>(x.numel()),
                     nccl_type(x.scalar_type()), nccl_op(op, x.scalar_type()), comm_,
                     stream_.stream()),
       "ncclAllReduce", t);
  divide_avg_if_needed(x, op, size());
}

void NcclCommunicator::gather_padded(const at::Tensor& in, const std::vector<int64_t>& sizes,
                                     std::vector<at::Tensor>& outs, const Ticket& t) {
  const int n = size();
  const int64_t p = *std::max_element(sizes.begin(), sizes.end());
  at::Tensor src = at::zeros({p}, in.options());
  src.narrow(0, 0, in.numel()).copy_(in.view({-1}));
  at::Tensor dst = at::empty({n * p}, in.options());
  call(ncclAllGather(src.data_ptr(), dst.data_ptr(), static_cast<size_t>(p),
                     nccl_type(in.scalar_type()), comm_, stream_.stream()),
       "ncclAllGather", t);
  for (int r = 0; r < n; ++r)
    outs[static_cast<size_t>(r)].copy_(dst.narrow(0, r * p, sizes[static_cast<size_t>(r)]));
}

}  // namespace parallax::comm::detail::nccl

#endif  // PARALLAX_WITH_NCCL
