#include "parallel/comm/communicator.h"

#include "core/error.h"

#include <algorithm>
#include <string_view>

namespace parallax::parallel::comm {

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

}  // namespace

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

}  // namespace parallax::parallel::comm
