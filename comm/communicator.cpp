#include "comm/communicator.h"

#include "core/error.h"

#include <algorithm>
#include <string_view>

namespace parallax::comm {

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kMin:
      return "min";
  }
  return "?";
}

const char* to_string(AllReduceAlgo algo) {
  switch (algo) {
    case AllReduceAlgo::kNative:
      return "native";
    case AllReduceAlgo::kRing:
      return "ring";
  }
  return "?";
}

const char* to_string(OpState state) {
  switch (state) {
    case OpState::kIssued:
      return "issued";
    case OpState::kCompleted:
      return "completed";
    case OpState::kTimedOut:
      return "timed_out";
    case OpState::kFailed:
      return "failed";
    case OpState::kCaptured:
      return "captured";
  }
  return "?";
}

AllReduceAlgo parse_allreduce_algo(const std::string& name) {
  if (name == "native") return AllReduceAlgo::kNative;
  if (name == "ring") return AllReduceAlgo::kRing;
  throw_error<ConfigError>(
      "parallel.allreduce: unknown all-reduce algorithm '{}' (use native|ring)", name);
}

std::string format_site(const CallSite& site) {
  std::string_view file = site.file_name();
  // Keep the last two path components: "comm/comm_test.cpp" is specific and short.
  auto last = file.rfind('/');
  if (last != std::string_view::npos && last > 0) {
    auto prev = file.rfind('/', last - 1);
    if (prev != std::string_view::npos) file = file.substr(prev + 1);
  }
  std::string_view fn = site.function_name();
  // "void ns::Class::method(args)": keep the qualified name, drop the return type and arguments.
  if (auto paren = fn.find('('); paren != std::string_view::npos) fn = fn.substr(0, paren);
  if (auto space = fn.rfind(' '); space != std::string_view::npos) fn = fn.substr(space + 1);
  if (fn.empty()) return fmt::format("{}:{}", file, site.line());
  return fmt::format("{}:{} ({})", file, site.line(), fn);
}

namespace {

// Completes when every part has.
class AllOfWork final : public Work {
 public:
  explicit AllOfWork(std::vector<WorkPtr> parts) : parts_(std::move(parts)) {}
  void wait() override {
    for (auto& p : parts_) p->wait();
  }
  void wait_stream() override {
    for (auto& p : parts_) p->wait_stream();
  }
  bool is_completed() override {
    bool all = true;
    for (auto& p : parts_) all = p->is_completed() && all;
    return all;
  }

 private:
  std::vector<WorkPtr> parts_;
};

// A flat all-reduce whose result is copied back into the tensors it was gathered from, once.
class CopyBackWork final : public Work {
 public:
  CopyBackWork(WorkPtr inner, at::Tensor flat, std::vector<at::Tensor> targets)
      : inner_(std::move(inner)), flat_(std::move(flat)), targets_(std::move(targets)) {}
  void wait() override {
    inner_->wait();
    copy_back();
  }
  void wait_stream() override {
    inner_->wait_stream();
    copy_back();
  }
  bool is_completed() override {
    if (!inner_->is_completed()) return false;
    copy_back();
    return true;
  }

 private:
  void copy_back() {
    if (done_) return;
    at::NoGradGuard no_grad;
    int64_t off = 0;
    for (auto& t : targets_) {
      t.copy_(flat_.narrow(0, off, t.numel()).view(t.sizes()));
      off += t.numel();
    }
    done_ = true;
  }
  WorkPtr inner_;
  at::Tensor flat_;
  std::vector<at::Tensor> targets_;
  bool done_ = false;
};

}  // namespace

WorkPtr Communicator::all_reduce_coalesced_async(std::vector<at::Tensor>& tensors, ReduceOp op,
                                                 CallSite site) {
  // One flat buffer per (dtype, device), in first-appearance order so every rank issues the same
  // sequence of collectives.
  std::vector<std::vector<at::Tensor>> groups;
  for (const auto& t : tensors) {
    PARALLAX_CHECK(t.defined(), CommError,
                   "all_reduce_coalesced on group '{}' (rank {}): undefined tensor", name(),
                   rank());
    auto same = [&](const std::vector<at::Tensor>& g) {
      return g.front().scalar_type() == t.scalar_type() && g.front().device() == t.device();
    };
    auto it = std::find_if(groups.begin(), groups.end(), same);
    if (it == groups.end()) {
      groups.push_back({t});
    } else {
      it->push_back(t);
    }
  }
  std::vector<WorkPtr> parts;
  for (auto& g : groups) {
    std::vector<at::Tensor> flat_parts;
    for (const auto& t : g) flat_parts.push_back(t.detach().reshape({-1}));
    at::Tensor flat = at::cat(flat_parts);
    WorkPtr w = all_reduce_async(flat, op, AllReduceAlgo::kNative, site);
    parts.push_back(std::make_shared<CopyBackWork>(std::move(w), flat, g));
  }
  if (parts.size() == 1) return parts.front();
  return std::make_shared<AllOfWork>(std::move(parts));
}

void check_wire_dtype(const Communicator& c, const at::Tensor& t, at::ScalarType wire) {
  PARALLAX_CHECK(t.defined(), CommError,
                 "all_reduce_compressed on group '{}' (rank {}): undefined tensor", c.name(),
                 c.rank());
  PARALLAX_CHECK(c10::isFloatingType(t.scalar_type()) && c10::isFloatingType(wire) &&
                     c10::elementSize(wire) <= c10::elementSize(t.scalar_type()),
                 CommError,
                 "all_reduce_compressed on group '{}' (rank {}): cannot reduce a {} tensor through "
                 "{}: the wire "
                 "dtype must be a floating type no wider than the tensor's",
                 c.name(), c.rank(), c10::toString(t.scalar_type()), c10::toString(wire));
}

WorkPtr Communicator::all_reduce_compressed_async(at::Tensor& tensor, ReduceOp op,
                                                  at::ScalarType wire, AllReduceAlgo algo,
                                                  CallSite site) {
  check_wire_dtype(*this, tensor, wire);
  if (wire == tensor.scalar_type()) return all_reduce_async(tensor, op, algo, site);
  at::Tensor copy = tensor.detach().to(wire).reshape({-1});
  WorkPtr w = all_reduce_async(copy, op, algo, site);
  return std::make_shared<CopyBackWork>(std::move(w), copy, std::vector<at::Tensor>{tensor});
}

WorkPtr Communicator::batch_isend_irecv(std::vector<P2POp>& ops, CallSite site) {
  std::vector<WorkPtr> parts;
  parts.reserve(ops.size());
  for (auto& op : ops) {
    parts.push_back(op.kind == P2POp::Kind::kSend ? send_async(op.tensor, op.peer, op.tag, site)
                                                  : recv_async(op.tensor, op.peer, op.tag, site));
  }
  return std::make_shared<AllOfWork>(std::move(parts));
}

int64_t chunk_numel(int64_t numel, int parts, int index) {
  PARALLAX_CHECK(parts > 0 && index >= 0 && index < parts, Error,
                 "chunk_numel: index {} out of range for {} parts", index, parts);
  const int64_t base = numel / parts, extra = numel % parts;
  return base + (index < extra ? 1 : 0);
}

int64_t chunk_offset(int64_t numel, int parts, int index) {
  PARALLAX_CHECK(parts > 0 && index >= 0 && index <= parts, Error,
                 "chunk_offset: index {} out of range for {} parts", index, parts);
  const int64_t base = numel / parts, extra = numel % parts;
  return base * index + std::min<int64_t>(index, extra);
}

}  // namespace parallax::comm
