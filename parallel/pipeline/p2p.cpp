#include "parallel/pipeline/p2p.h"

#include "core/error.h"
#include "parallel/pipeline/schedule_check.h"

#include <ATen/ATen.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <set>

namespace parallax::parallel::pipeline {

at::Tensor make_header(int stage, int micro, const MessageShape& shape) {
  at::Tensor hdr = at::zeros({kHeaderLength}, at::kLong);
  auto h = hdr.accessor<int64_t, 1>();
  h[0] = kHeaderMagic;
  h[1] = stage;
  h[2] = micro;
  h[3] = static_cast<int64_t>(shape.size());
  for (std::size_t k = 0; k < shape.size(); ++k) {
    h[4 + 8 * k] = static_cast<int64_t>(shape[k].dtype);
    h[5 + 8 * k] = static_cast<int64_t>(shape[k].shape.size());
    for (std::size_t d = 0; d < shape[k].shape.size(); ++d) h[6 + 8 * k + d] = shape[k].shape[d];
  }
  return hdr;
}

Header read_header(const at::Tensor& host) {
  auto h = host.accessor<int64_t, 1>();
  Header out;
  out.stage = h[1];
  out.micro = h[2];
  out.valid = h[0] == kHeaderMagic && h[3] >= 1 && h[3] <= kMaxMessageTensors;
  if (!out.valid) return out;
  for (int64_t k = 0; k < h[3]; ++k) {
    TensorMeta m{static_cast<at::ScalarType>(h[4 + 8 * k]), {}};
    for (int64_t d = 0; d < h[5 + 8 * k]; ++d) m.shape.push_back(h[6 + 8 * k + d]);
    out.shape.push_back(std::move(m));
  }
  return out;
}

std::string shape_string(const MessageShape& shape) {
  std::string out;
  for (const auto& m : shape)
    out += fmt::format("{}{} [{}]", out.empty() ? "" : ", ", c10::toString(m.dtype),
                       fmt::join(m.shape, ", "));
  return out;
}

bool is_act(const Op& op) {
  return op.kind == OpKind::kSendAct || op.kind == OpKind::kRecvAct;
}

std::string message_name(const Op& op) {
  return fmt::format("the {} of micro-batch {}", is_act(op) ? "activations" : "gradients",
                     op.micro);
}

P2pMessenger::P2pMessenger(comm::CommPtr pp, const Schedule& schedule, bool ordered)
    : pp_(std::move(pp)),
      schedule_(schedule),
      ordered_(ordered),
      on_device_(pp_->device_type() != c10::kCPU) {
  if (ordered_) check_posting_order(schedule_);
  for (const auto& [first, end] : comm_batches(schedule_, pp_->rank())) batch_end_[first] = end;
  const int S = schedule_.stages();
  PARALLAX_CHECK(2 * S * schedule_.micro_batches * (kMaxMessageTensors + 1) < comm::kMaxUserTag,
                 ConfigError,
                 "keys 'parallel.pp' and 'train.grad_accum': {} stages x {} micro-batches is "
                 "more messages than one step's tags can name",
                 S, schedule_.micro_batches);
}

// NCCL connects a pair of ranks per direction, lazily, inside the ncclGroupEnd of the first batch
// that uses the direction, and that setup blocks until the peer sets up its end. Under gpipe, stage
// 0 posts its last activation send with its first gradient receive in one batch while stage 1,
// which has never sent, posts only that activation's receive: stage 0's ncclGroupEnd waits for a
// send connection stage 1 makes only after the receive, which waits for stage 0's batch (the hang
// on 2 x H200; pytorch/pytorch#113281 describes the same setup; simulate_nccl(...,
// connect_up_front = false) shows it). So every pair of pipeline neighbours exchanges one element
// both ways in one batch, at once, before the first step: every connection of the plan exists
// before a batch needs it. Every backend runs it (cheap, and the same path in CPU tests).
void P2pMessenger::connect_peers(c10::Device device) {
  std::set<int> peers;
  for (const Op& c : schedule_.ops[pp_->rank()])
    if (c.is_comm() && c.peer != pp_->rank()) peers.insert(c.peer);
  if (peers.empty()) return;
  const auto options = at::TensorOptions().dtype(at::kFloat).device(device);
  std::vector<comm::P2POp> ops;
  for (int p : peers) {
    ops.push_back({comm::P2POp::Kind::kSend, at::full({1}, pp_->rank(), options), p, 0});
    ops.push_back({comm::P2POp::Kind::kRecv, at::full({1}, -1.0, options), p, 0});
  }
  try {
    pp_->batch_isend_irecv(ops)->wait();
  } catch (Error& e) {
    e.add_context(fmt::format("pipeline rank {} connecting to its neighbours (pipeline ranks {})",
                              pp_->rank(), fmt::join(peers, ", ")));
    throw;
  }
  for (const auto& op : ops) {
    if (op.kind != comm::P2POp::Kind::kRecv) continue;
    const float got = op.tensor.cpu().item<float>();
    PARALLAX_CHECK(got == static_cast<float>(op.peer), Error,
                   "pipeline: rank {} expected its neighbour's handshake from pipeline rank {} "
                   "and received {} (a plan mismatch between the ranks)",
                   pp_->rank(), op.peer, got);
  }
}

void P2pMessenger::set_activation_shapes(const std::map<int, MessageShape>& act) {
  act_shape_ = act;
  for (const auto& [s, shape] : act_shape_) {
    MessageShape g;
    for (const auto& m : shape)
      g.push_back(at::isFloatingType(m.dtype) ? m : TensorMeta{at::kFloat, {0}});
    grad_shape_[s + 1] = g;
  }
  shapes_known_ = true;
}

void P2pMessenger::begin_step(c10::Device comm_device, c10::Device model_device) {
  comm_target_ = comm_device;
  model_device_ = model_device;
  batches_.clear();
  incoming_.clear();
  unchecked_.clear();
}

int P2pMessenger::tag(const Op& op, int k) const {
  if (ordered_) return 1;  // one tag: the transport's order is the message order
  const int S = schedule_.stages(), m = schedule_.micro_batches;
  return 1 + (((is_act(op) ? 0 : 1) * S + op.stage) * m + op.micro) * (kMaxMessageTensors + 1) + k;
}

const MessageShape& P2pMessenger::shape_of(const Op& op) const {
  const auto& book = is_act(op) ? act_shape_ : grad_shape_;
  const auto it = book.find(op.stage);
  PARALLAX_CHECK(it != book.end(), Error,
                 "pipeline: rank {} has no shapes for {} from stage {} (the shape pass did not "
                 "reach it)",
                 pp_->rank(), message_name(op), op.stage);
  return it->second;
}

at::Tensor P2pMessenger::to_comm(const at::Tensor& t) const {
  at::Tensor c = t.detach();
  if (c.device() != comm_target_) c = c.to(comm_target_);
  return c.contiguous();
}

at::Tensor P2pMessenger::buffer(const std::string& pool, const TensorMeta& meta) {
  std::string key = fmt::format("{}|{}|", pool, static_cast<int>(meta.dtype));
  for (int64_t d : meta.shape) key += fmt::format("{},", d);
  auto& list = pool_[key];
  for (auto& t : list) {
    // Free once the pool holds the only reference to the tensor and to its memory.
    if (t.use_count() == 1 && t.storage().use_count() == 1) {
      if (t.requires_grad()) t.mutable_grad() = at::Tensor();
      return t;
    }
  }
  list.push_back(at::empty(meta.shape, at::TensorOptions().dtype(meta.dtype).device(comm_target_)));
  return list.back();
}

void P2pMessenger::check_payload(const Op& c, const std::vector<at::Tensor>& payload) const {
  const MessageShape& shape = shape_of(c);
  bool same = payload.size() == shape.size();
  for (std::size_t j = 0; same && j < payload.size(); ++j)
    same = payload[j].scalar_type() == shape[j].dtype && payload[j].sizes().vec() == shape[j].shape;
  if (same) return;
  MessageShape got;
  for (const auto& t : payload) got.push_back({t.scalar_type(), t.sizes().vec()});
  throw_error<Error>(
      "pipeline: stage {} (pipeline rank {}) sends {} as {}, but the shape pass found {} "
      "(micro-batch 0 before the first step): tensors that cross a stage boundary keep "
      "their shapes and dtypes in every micro-batch and step (as in Megatron-LM and "
      "torch.distributed.pipelining); keep the micro-batch size fixed (data.drop_last)",
      c.stage, pp_->rank(), message_name(c), shape_string(got), shape_string(shape));
}

void P2pMessenger::post(std::size_t first, std::size_t end, const Payload& payload_of) {
  const std::vector<Op>& ops = schedule_.ops[pp_->rank()];
  Batch b;
  std::vector<comm::P2POp> sends, recvs;
  for (std::size_t k = first; k < end; ++k) {
    const Op& c = ops[k];
    const MessageShape& shape = shape_of(c);
    Message m{&c, at::Tensor(), {}, 0};
    if (c.is_send()) {
      std::vector<at::Tensor> payload = payload_of(c);
      for (auto& t : payload) t = to_comm(t);
      check_payload(c, payload);
      m.header = to_comm(make_header(c.stage, c.micro, shape));
      sends.push_back({comm::P2POp::Kind::kSend, m.header, c.peer, tag(c, 0)});
      for (std::size_t j = 0; j < payload.size(); ++j) {
        sends.push_back(
            {comm::P2POp::Kind::kSend, payload[j], c.peer, tag(c, static_cast<int>(j) + 1)});
        m.bytes += payload[j].numel() * payload[j].element_size();
      }
      m.tensors = std::move(payload);
    } else {
      m.header = buffer("header", {at::kLong, {kHeaderLength}});
      recvs.push_back({comm::P2POp::Kind::kRecv, m.header, c.peer, tag(c, 0)});
      for (std::size_t j = 0; j < shape.size(); ++j) {
        at::Tensor t = buffer(is_act(c) ? "act" : "grad", shape[j]);
        recvs.push_back({comm::P2POp::Kind::kRecv, t, c.peer, tag(c, static_cast<int>(j) + 1)});
        m.bytes += t.numel() * t.element_size();
        m.tensors.push_back(t);
      }
      incoming_[{is_act(c) ? 0 : 1, c.micro, c.stage}] = {batches_.size(), b.messages.size()};
    }
    b.messages.push_back(std::move(m));
  }
  try {
    if (ordered_) {
      std::vector<comm::P2POp> all(sends);
      all.insert(all.end(), recvs.begin(), recvs.end());
      b.sends = b.recvs = pp_->batch_isend_irecv(all);
    } else {
      if (!sends.empty()) b.sends = pp_->batch_isend_irecv(sends);
      if (!recvs.empty()) b.recvs = pp_->batch_isend_irecv(recvs);
    }
  } catch (Error& e) {
    e.add_context(batch_context(b, "posting the batch"));
    throw;
  }
  batches_.push_back(std::move(b));
}

std::vector<at::Tensor> P2pMessenger::receive(bool act, int micro, int stage, const char* pass) {
  const auto it = incoming_.find({act ? 0 : 1, micro, stage});
  PARALLAX_CHECK(it != incoming_.end(), Error,
                 "pipeline: rank {} needs the {} of micro-batch {} from stage {} but its plan "
                 "posted no receive for it",
                 pp_->rank(), act ? "activations" : "gradients", micro, stage);
  Batch& b = batches_[it->second.first];
  Message& m = b.messages[it->second.second];
  const Op& c = *m.op;
  if (!b.received) {
    try {
      if (on_device_) {
        b.recvs->wait_stream();  // the compute stream waits, the host goes on
      } else {
        b.recvs->wait();
      }
    } catch (Error& e) {
      e.add_context(fmt::format(
          "pipeline stage {} (pipeline rank {}) receiving {} ({} bytes) for its {} pass from "
          "stage {} (pipeline rank {}), in one batch with: {}",
          act ? c.stage + 1 : c.stage - 1, pp_->rank(), message_name(c), m.bytes, pass, c.stage,
          c.peer, batch_text(b)));
      throw;
    }
    b.received = true;
  }
  if (on_device_) {
    unchecked_.push_back({m.header, &c});
  } else {
    check_header(m.header, c);
  }
  m.header = at::Tensor();
  std::vector<at::Tensor> got = std::move(m.tensors);
  m.tensors.clear();
  incoming_.erase(it);
  for (auto& t : got)
    if (t.device() != model_device_) t = t.to(model_device_);
  return got;
}

void P2pMessenger::end_step() {
  for (auto& b : batches_) {
    for (comm::WorkPtr* w : {&b.sends, &b.recvs}) {
      if (!*w || (w == &b.recvs && ordered_)) continue;
      try {
        (*w)->wait();
      } catch (Error& e) {
        e.add_context(batch_context(b, "completing the batch at the end of the step"));
        throw;
      }
    }
  }
  batches_.clear();
  PARALLAX_CHECK(incoming_.empty(), Error,
                 "pipeline: rank {} received {} message(s) no compute op consumed", pp_->rank(),
                 incoming_.size());
  if (!unchecked_.empty()) {
    std::vector<at::Tensor> headers;
    for (const auto& [h, op] : unchecked_) headers.push_back(h);
    const at::Tensor host = at::stack(headers).cpu();
    for (std::size_t k = 0; k < unchecked_.size(); ++k)
      check_header(host[k], *unchecked_[k].second);
    unchecked_.clear();
  }
}

void P2pMessenger::check_header(const at::Tensor& got, const Op& c) const {
  const at::Tensor want = make_header(c.stage, c.micro, shape_of(c));
  if (at::equal(got, want)) return;
  auto h = got.accessor<int64_t, 1>();
  const int consumer = is_act(c) ? c.stage + 1 : c.stage - 1;
  throw_error<Error>(
      "pipeline: stage {} (rank {}) expected {} from stage {} (pipeline rank {}) and received "
      "{} (a plan mismatch between the ranks)",
      consumer, pp_->rank(), message_name(c), c.stage, c.peer,
      h[0] != kHeaderMagic ? std::string("a message that is no pipeline header")
                           : fmt::format("stage {}'s message for micro-batch {}", h[1], h[2]));
}

std::string P2pMessenger::batch_text(const Batch& b) const {
  std::string out;
  for (const auto& m : b.messages) {
    const Op& c = *m.op;
    const int other = is_act(c) ? c.stage + 1 : c.stage - 1;
    out += fmt::format("{}{} {} {} stage {} (pipeline rank {}, {} bytes)", out.empty() ? "" : "; ",
                       c.is_send() ? "sending" : "receiving", message_name(c),
                       c.is_send() ? "to" : "from", c.is_send() ? other : c.stage, c.peer, m.bytes);
  }
  return out;
}

// "pipeline stage 1 (pipeline rank 1) sending the gradients of micro-batch 3 to stage 0 (pipeline
// rank 0, 16384 bytes), <when>": named from this rank's side as the receive errors are.
std::string P2pMessenger::batch_context(const Batch& b, const char* when) const {
  int mine = -1;
  if (!b.messages.empty()) {
    const Op& c = *b.messages.front().op;
    mine = c.is_send() ? c.stage : (is_act(c) ? c.stage + 1 : c.stage - 1);
  }
  return fmt::format("pipeline stage {} (pipeline rank {}) {}, {}", mine, pp_->rank(),
                     batch_text(b), when);
}

}  // namespace parallax::parallel::pipeline
