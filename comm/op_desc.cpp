// What one op is (op_desc.h): its names, descriptor and the texts that name it in messages.
#include "comm/op_desc.h"

#include "core/strings.h"

#include <fmt/ranges.h>

namespace parallax::comm::detail {

const char* op_name(OpKind kind) {
  switch (kind) {
    case OpKind::kAllReduce:
      return "all_reduce";
    case OpKind::kReduceScatter:
      return "reduce_scatter";
    case OpKind::kAllGather:
      return "all_gather";
    case OpKind::kAllGatherList:
      return "all_gather(list)";
    case OpKind::kBroadcast:
      return "broadcast";
    case OpKind::kBarrier:
      return "barrier";
    case OpKind::kSplit:
      return "split";
    case OpKind::kSend:
      return "send";
    case OpKind::kRecv:
      return "recv";
  }
  return "?";
}

bool is_p2p(OpKind kind) {
  return kind == OpKind::kSend || kind == OpKind::kRecv;
}

// The first line of an error text (c10's messages carry a stack trace after it).
std::string first_line(const std::string& text) {
  const std::string line = text.substr(0, text.find('\n'));
  return line.size() > 300 ? line.substr(0, 300) + "..." : line;
}

std::string dtype_name(c10::ScalarType t) {
  if (t == c10::ScalarType::Undefined) return "";
  switch (t) {
    case c10::ScalarType::Float:
      return "float32";
    case c10::ScalarType::Double:
      return "float64";
    case c10::ScalarType::Half:
      return "float16";
    case c10::ScalarType::BFloat16:
      return "bfloat16";
    case c10::ScalarType::Long:
      return "int64";
    case c10::ScalarType::Int:
      return "int32";
    case c10::ScalarType::Byte:
      return "uint8";
    case c10::ScalarType::Char:
      return "int8";
    case c10::ScalarType::Bool:
      return "bool";
    default:
      return c10::toString(t);
  }
}

std::string op_detail(const OpDesc& d) {
  switch (d.kind) {
    case OpKind::kAllReduce:
      if (d.tensors > 1)
        return fmt::format("{}, {}, {} tensors", to_string(d.reduce), to_string(d.algo), d.tensors);
      return fmt::format("{}, {}", to_string(d.reduce), to_string(d.algo));
    case OpKind::kReduceScatter:
      return to_string(d.reduce);
    case OpKind::kBroadcast:
      return fmt::format("root {}", d.root);
    case OpKind::kBarrier:
      return d.barrier == BarrierKind::kCheckpoint ? "checkpoint" : "default";
    case OpKind::kSend:
      return fmt::format("to {}, tag {}", d.root, d.tag);
    case OpKind::kRecv:
      return fmt::format("from {}, tag {}", d.root, d.tag);
    default:
      return "";
  }
}

int64_t OpDesc::bytes() const {
  if (dtype == c10::ScalarType::Undefined) return 0;
  return numel * static_cast<int64_t>(c10::elementSize(dtype));
}

std::string OpDesc::tensor_text() const {
  if (dtype == c10::ScalarType::Undefined) return "no tensor";
  return fmt::format("{}[{}] ({})", dtype_name(dtype), fmt::join(shape, ", "),
                     core::human_bytes(double(bytes())));
}

std::string OpDesc::summary() const {
  std::string d = op_detail(*this);
  std::string s = d.empty() ? std::string(op_name(kind)) : fmt::format("{}({})", op_name(kind), d);
  if (dtype != c10::ScalarType::Undefined)
    s += fmt::format(" {}[{}]", dtype_name(dtype), fmt::join(shape, ", "));
  return s;
}

OpDesc tensor_desc(OpKind kind, const at::Tensor& t, CallSite site) {
  OpDesc d;
  d.kind = kind;
  d.site = site;
  if (t.defined()) {
    d.dtype = t.scalar_type();
    d.shape = t.sizes().vec();
    d.numel = t.numel();
    d.match_numel = d.numel;
  }
  return d;
}

std::string op_label(const Ticket& t, const std::vector<int>& world_ranks) {
  const OpDesc& d = t.desc;
  if (d.kind == OpKind::kSend || d.kind == OpKind::kRecv) {
    return fmt::format("{} {} rank {} (world {}), tag {}, p2p #{}", op_name(d.kind),
                       d.kind == OpKind::kSend ? "to" : "from", d.root,
                       world_ranks.at(static_cast<size_t>(d.root)), d.tag, t.p2p_seq);
  }
  std::string det = op_detail(d);
  return det.empty() ? fmt::format("{} #{}", op_name(d.kind), t.seq)
                     : fmt::format("{}({}) #{}", op_name(d.kind), det, t.seq);
}

}  // namespace parallax::comm::detail
