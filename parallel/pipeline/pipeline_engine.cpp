#include "parallel/pipeline/pipeline_engine.h"

#include "core/error.h"
#include "core/timer.h"
#include "parallel/pipeline/split_backward.h"

#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <torch/csrc/autograd/autograd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <tuple>

namespace parallax::parallel::pipeline {

namespace {

constexpr int64_t kMagic = 0x50504C58;  // "PPLX"
constexpr int64_t kHeader = 64;
constexpr int kMaxTensors = 7;  // 4 + 8 * 7 < kHeader
constexpr int kMaxDims = 6;

int64_t dtype_code(at::ScalarType t) {
  return static_cast<int64_t>(t);
}

}  // namespace

std::vector<int> partition(const std::vector<double>& costs, int stages,
                           const std::vector<int>& explicit_counts,
                           const std::vector<double>& activation_bytes,
                           const std::vector<int>& in_flight) {
  const int n = static_cast<int>(costs.size());
  PARALLAX_CHECK(n >= stages, ConfigError,
                 "keys 'parallel.pp' and 'parallel.pp_virtual_stages': {} pipeline stages but the "
                 "model has only {} units to spread over them",
                 stages, n);
  std::vector<int> bounds{0};
  if (!explicit_counts.empty()) {
    PARALLAX_CHECK(static_cast<int>(explicit_counts.size()) == stages, ConfigError,
                   "key 'parallel.pp_layout': {} entries for {} stages (pp x pp_virtual_stages)",
                   explicit_counts.size(), stages);
    for (std::size_t s = 0; s < explicit_counts.size(); ++s) {
      PARALLAX_CHECK(explicit_counts[s] >= 1, ConfigError,
                     "key 'parallel.pp_layout': stage {} has {} units (at least 1)", s,
                     explicit_counts[s]);
      bounds.push_back(bounds.back() + explicit_counts[s]);
    }
    PARALLAX_CHECK(bounds.back() == n, ConfigError,
                   "key 'parallel.pp_layout': the stages hold {} units, the model has {}",
                   bounds.back(), n);
    return bounds;
  }
  // Contiguous split minimising the largest stage cost (dynamic programming over prefixes).
  std::vector<double> prefix(static_cast<std::size_t>(n) + 1, 0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + std::max(costs[i], 0.0);
  const double inf = std::numeric_limits<double>::infinity();
  // best[s][i]: the smallest max cost of splitting units [0, i) into s stages; cut[s][i] its last
  // cut.
  std::vector<std::vector<double>> best(stages + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<int>> cut(stages + 1, std::vector<int>(n + 1, 0));
  best[0][0] = 0;
  for (int s = 1; s <= stages; ++s) {
    for (int i = s; i <= n; ++i) {
      for (int j = s - 1; j < i; ++j) {
        const double c = std::max(best[s - 1][j], prefix[i] - prefix[j]);
        if (c < best[s][i]) {
          best[s][i] = c;
          cut[s][i] = j;
        }
      }
    }
  }
  if (activation_bytes.size() == costs.size() && static_cast<int>(in_flight.size()) == stages) {
    // Second criterion: every stage within the optimum's largest cost (up to rounding), the
    // largest in_flight x activation bytes as small as it can be.
    const double cap = best[stages][n] * (1 + 1e-9);
    std::vector<double> act(static_cast<std::size_t>(n) + 1, 0);
    for (int i = 0; i < n; ++i) act[i + 1] = act[i] + std::max(activation_bytes[i], 0.0);
    std::vector<std::vector<double>> mem(stages + 1, std::vector<double>(n + 1, inf));
    mem[0][0] = 0;
    for (int s = 1; s <= stages; ++s) {
      for (int i = s; i <= n; ++i) {
        for (int j = s - 1; j < i; ++j) {
          if (mem[s - 1][j] == inf || prefix[i] - prefix[j] > cap) continue;
          const double c = std::max(mem[s - 1][j], in_flight[s - 1] * (act[i] - act[j]));
          if (c < mem[s][i]) {
            mem[s][i] = c;
            cut[s][i] = j;
          }
        }
      }
    }
  }
  std::vector<int> rev{n};
  for (int s = stages, i = n; s > 0; --s) {
    i = cut[s][i];
    rev.push_back(i);
  }
  return {rev.rbegin(), rev.rend()};
}

struct PipelineEngine::Slot {
  std::vector<at::Tensor> inputs;        // received (leaves) or the begin() values
  std::vector<at::Tensor> outputs;       // what the stage returned (not on the last stage)
  at::Tensor loss;                       // the last stage
  std::vector<at::Tensor> out_grads;     // received gradient of each output
  std::vector<at::Tensor> in_grads;      // gradient of each input, to send
  std::unique_ptr<SplitBackward> split;  // zb: between B and W
  std::vector<at::Tensor> roots() const {
    if (loss.defined()) return {loss};
    std::vector<at::Tensor> r;
    for (const auto& o : outputs)
      if (o.defined() && o.requires_grad()) r.push_back(o);
    return r;
  }
  std::vector<at::Tensor> root_grads() const {
    if (loss.defined()) return {};
    std::vector<at::Tensor> g;
    for (std::size_t k = 0; k < outputs.size(); ++k)
      if (outputs[k].defined() && outputs[k].requires_grad()) g.push_back(out_grads.at(k));
    return g;
  }
};

PipelineEngine::PipelineEngine(std::shared_ptr<torch::nn::Module> module,
                               std::vector<core::Unit> units, const std::vector<double>& costs,
                               comm::CommPtr pp, int micro_batches, const PipelineOptions& options,
                               const std::function<std::unique_ptr<Engine>()>& make_inner)
    : module_(std::move(module)), units_(std::move(units)), pp_(std::move(pp)) {
  schedule_ = build_schedule(options.schedule, pp_->size(), micro_batches, options.virtual_stages);
  check(schedule_);
  ordered_ = options.ordered_p2p || pp_->device_type() != c10::kCPU;
  if (ordered_) check_posting_order(schedule_);
  for (const auto& [first, end] : comm_batches(schedule_, pp_->rank())) batch_end_[first] = end;
  const int S = schedule_.stages();
  PARALLAX_CHECK(2 * S * micro_batches * (kMaxTensors + 1) < comm::kMaxUserTag, ConfigError,
                 "keys 'parallel.pp' and 'train.grad_accum': {} stages x {} micro-batches is "
                 "more messages than one step's tags can name",
                 S, micro_batches);
  PARALLAX_CHECK(costs.size() == units_.size(), Error, "pipeline: {} unit costs for {} units",
                 costs.size(), units_.size());
  bounds_ =
      partition(costs, S, options.layout, options.activation_bytes, in_flight_per_stage(schedule_));
  for (int s = 0; s < S; ++s) {
    if (schedule_.rank_of(s) == pp_->rank()) my_stages_.push_back(s);
    for (int u = bounds_[s]; u < bounds_[s + 1]; ++u)
      for (const auto& name : units_[u].param_names) owner_[name] = schedule_.rank_of(s);
  }
  // Parameters of other ranks' stages: frozen and released (their shapes kept for gathering).
  at::NoGradGuard no_grad;
  for (auto& item : module_->named_parameters()) {
    const auto it = owner_.find(item.key());
    PARALLAX_CHECK(it != owner_.end(), Error, "pipeline: parameter '{}' is in no unit", item.key());
    at::Tensor& p = item.value();
    if (it->second == pp_->rank()) {
      stage_params_.push_back(item.key());
      continue;
    }
    foreign_[item.key()] = p.sizes().vec();
    p.set_requires_grad(false);
    p.set_data(at::empty({0}, p.options()));
  }
  inner_ = make_inner();
  // The optimizer's step counter is one value on every stage: its replicas are every stage's
  // data-parallel ranks (gathered over the pipeline).
  const std::vector<int> mine = inner_->model_replicas();
  at::Tensor local = at::tensor(std::vector<int64_t>(mine.begin(), mine.end()), at::kLong);
  if (pp_->device_type() != c10::kCPU) local = local.to(comm_device());
  at::Tensor all = at::empty({static_cast<int64_t>(mine.size()) * pp_->size()}, local.options());
  pp_->all_gather_async(local, all)->wait();
  all = all.cpu();
  for (int64_t k = 0; k < all.numel(); ++k)
    step_replicas_.push_back(static_cast<int>(all[k].item<int64_t>()));
  std::sort(step_replicas_.begin(), step_replicas_.end());
  connect_peers();
}

// NCCL connects a pair of ranks per direction, lazily, inside the ncclGroupEnd of the first batch
// that uses the direction, and that setup blocks until the peer sets up its end. Under gpipe, stage
// 0 posts its last activation send with its first gradient receive in one batch while stage 1,
// which has never sent, posts only that activation's receive: stage 0's ncclGroupEnd waits for a
// send connection stage 1 makes only after the receive, which waits for stage 0's batch (the hang
// on 2 x H200; pytorch/pytorch#113281 describes the same setup). So every pair of pipeline
// neighbours exchanges one element both ways in one batch, at once, before the first step: every
// connection of the plan exists before a batch needs it. Every backend runs it (cheap, and the
// same path in CPU tests).
void PipelineEngine::connect_peers() {
  std::set<int> peers;
  for (const Op& c : schedule_.ops[pp_->rank()])
    if (c.is_comm() && c.peer != pp_->rank()) peers.insert(c.peer);
  if (peers.empty()) return;
  const auto options = at::TensorOptions().dtype(at::kFloat).device(comm_device());
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

std::vector<StatePiece> PipelineEngine::optimizer_state() {
  std::vector<StatePiece> pieces = inner_->optimizer_state();
  for (auto& p : pieces)
    if (p.name == "step") p.replicas = step_replicas_;
  return pieces;
}

std::string PipelineEngine::describe() const {
  std::string stages;
  for (int s : my_stages_)
    stages += fmt::format("{}{} (units {}..{})", stages.empty() ? "" : ", ", s, bounds_[s],
                          bounds_[s + 1] - 1);
  return fmt::format(
      "pipeline '{}' over group '{}' of {} ranks, {} stages, {} micro-batches; "
      "this rank: stage{} {}; data parallel: {}",
      schedule_.name(), pp_->name(), pp_->size(), schedule_.stages(), schedule_.micro_batches,
      my_stages_.size() > 1 ? "s" : "", stages, inner_->describe());
}

void PipelineEngine::forward_backward(int, const std::function<at::Tensor(int)>&, bool) {
  throw_error<Error>(
      "pipeline engine: forward_backward() of the whole model is not available under "
      "parallel.pp > 1; run step() with the model's chain of units");
}

void PipelineEngine::forward_backward_split(int, const MicroStepFns&, bool) {
  throw_error<Error>(
      "pipeline engine: forward_backward_split() of the whole model is not available under "
      "parallel.pp > 1; run step() with the model's chain of units");
}

LossTerms PipelineEngine::step(int micro_batches, const StepFns& fns, bool sync_buffers) {
  PARALLAX_CHECK(fns.begin && fns.run && fns.finish, Error,
                 "pipeline engine: step() needs the model's chain of units (StepFns::begin, run "
                 "and finish)");
  LossTerms terms;
  StageFns stages;
  stages.begin = fns.begin;
  stages.run = fns.run;
  stages.finish = [&](int micro, const std::vector<at::Tensor>& out) {
    MicroLoss l = fns.finish(micro, out);
    add_terms(terms, l.terms);
    return l.backprop;
  };
  forward_backward_stages(micro_batches, stages, sync_buffers);
  sync_terms(terms);
  return terms;
}

void PipelineEngine::sync_terms(LossTerms& terms) {
  const int root = pp_->size() - 1;
  const bool is_root = pp_->rank() == root;
  const c10::Device dev = comm_device();
  if (term_keys_.empty()) {
    std::string joined;
    if (is_root) {
      for (const auto& [k, v] : terms) joined += k + "\n";
    }
    at::Tensor len = at::full({1}, static_cast<int64_t>(joined.size()), at::kLong).to(dev);
    pp_->broadcast(len, root);
    const int64_t n = len.cpu().item<int64_t>();
    at::Tensor chars = at::zeros({n}, at::kByte);
    if (is_root) std::memcpy(chars.data_ptr(), joined.data(), joined.size());
    chars = chars.to(dev);
    pp_->broadcast(chars, root);
    chars = chars.cpu();
    const std::string text(static_cast<const char*>(chars.data_ptr()), static_cast<std::size_t>(n));
    std::size_t at = 0;
    while (at < text.size()) {
      const std::size_t nl = text.find('\n', at);
      term_keys_.push_back(text.substr(at, nl - at));
      at = nl + 1;
    }
  }
  at::Tensor vals = at::zeros({static_cast<int64_t>(term_keys_.size())}, at::kFloat).to(dev);
  if (is_root) {
    std::vector<at::Tensor> v;
    for (const auto& k : term_keys_) {
      const auto it = terms.find(k);
      PARALLAX_CHECK(it != terms.end(), Error,
                     "pipeline: loss term '{}' missing on the last stage in this step", k);
      v.push_back(it->second.to(at::kFloat).reshape({1}).to(dev));
    }
    if (!v.empty()) vals = at::cat(v);
  }
  pp_->broadcast(vals, root);
  if (!is_root) {
    terms.clear();
    const c10::Device to = model_device();
    for (std::size_t i = 0; i < term_keys_.size(); ++i)
      terms[term_keys_[i]] = vals[static_cast<int64_t>(i)].to(to);
  }
}

c10::Device PipelineEngine::comm_device() const {
  const c10::DeviceType type = pp_->device_type();
  if (type == c10::kCPU) return c10::Device(c10::kCPU);
  for (const auto& p : module_->parameters())
    if (p.device().type() == type) return p.device();
  return c10::Device(type);
}

c10::Device PipelineEngine::model_device() const {
  for (const auto& p : module_->parameters())
    if (p.numel() > 0) return p.device();
  return c10::Device(c10::kCPU);
}

at::Tensor PipelineEngine::to_comm(const at::Tensor& t) const {
  at::Tensor c = t.detach();
  if (c.device() != comm_target_) c = c.to(comm_target_);
  return c.contiguous();
}

int PipelineEngine::tag(const Op& op, int k) const {
  if (ordered_) return 1;  // one tag: the transport's order is the message order
  const bool act = op.kind == OpKind::kSendAct || op.kind == OpKind::kRecvAct;
  const int S = schedule_.stages(), m = schedule_.micro_batches;
  return 1 + (((act ? 0 : 1) * S + op.stage) * m + op.micro) * (kMaxTensors + 1) + k;
}

namespace {

bool is_act(const Op& op) {
  return op.kind == OpKind::kSendAct || op.kind == OpKind::kRecvAct;
}

std::string message_name(const Op& op) {
  return fmt::format("the {} of micro-batch {}", is_act(op) ? "activations" : "gradients",
                     op.micro);
}

}  // namespace

const PipelineEngine::Layout& PipelineEngine::layout_of(const Op& op) const {
  const auto& book = is_act(op) ? act_layout_ : grad_layout_;
  const auto it = book.find(op.stage);
  PARALLAX_CHECK(it != book.end(), Error,
                 "pipeline: rank {} has no shapes for {} from stage {} (the shape pass did not "
                 "reach it)",
                 pp_->rank(), message_name(op), op.stage);
  return it->second;
}

at::Tensor PipelineEngine::buffer(const std::string& pool, const TensorMeta& meta) {
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

namespace {

// The header of a message of `layout` from `stage` for micro-batch `micro` (int64[kHeader], CPU).
template <typename Layout>
at::Tensor make_header(int stage, int micro, const Layout& layout) {
  at::Tensor hdr = at::zeros({kHeader}, at::kLong);
  auto h = hdr.accessor<int64_t, 1>();
  h[0] = kMagic;
  h[1] = stage;
  h[2] = micro;
  h[3] = static_cast<int64_t>(layout.size());
  for (std::size_t k = 0; k < layout.size(); ++k) {
    h[4 + 8 * k] = dtype_code(layout[k].dtype);
    h[5 + 8 * k] = static_cast<int64_t>(layout[k].shape.size());
    for (std::size_t d = 0; d < layout[k].shape.size(); ++d) h[6 + 8 * k + d] = layout[k].shape[d];
  }
  return hdr;
}

template <typename Layout>
std::string layout_string(const Layout& layout) {
  std::string out;
  for (const auto& m : layout)
    out += fmt::format("{}{} [{}]", out.empty() ? "" : ", ", c10::toString(m.dtype),
                       fmt::join(m.shape, ", "));
  return out;
}

// RAII: the random state of the CPU and of `device`, and the module's buffers, put back.
class SideEffectGuard {
 public:
  SideEffectGuard(torch::nn::Module& module, c10::Device device) {
    gens_.push_back(at::globalContext().defaultGenerator(c10::Device(c10::kCPU)));
    if (device.type() != c10::kCPU) gens_.push_back(at::globalContext().defaultGenerator(device));
    for (auto& g : gens_) {
      std::lock_guard<std::mutex> lock(g.mutex());
      states_.push_back(g.get_state());
    }
    for (auto& item : module.named_buffers()) {
      if (!item.value().defined()) continue;
      buffers_.push_back(item.value());
      saved_.push_back(item.value().clone());
    }
  }
  ~SideEffectGuard() {
    at::NoGradGuard no_grad;
    for (std::size_t k = 0; k < gens_.size(); ++k) {
      std::lock_guard<std::mutex> lock(gens_[k].mutex());
      gens_[k].set_state(states_[k]);
    }
    for (std::size_t k = 0; k < buffers_.size(); ++k) buffers_[k].copy_(saved_[k]);
  }

 private:
  std::vector<at::Generator> gens_;
  std::vector<at::Tensor> states_, buffers_, saved_;
};

}  // namespace

void PipelineEngine::infer_layouts(const StageFns& fns) {
  const int last = schedule_.stages() - 1;
  const int me = pp_->rank();
  const c10::Device model_device = this->model_device();
  SideEffectGuard guard(*module_, model_device);
  at::NoGradGuard no_grad;
  const auto context = [&](Error& e, int s, bool sending) {
    e.add_context(fmt::format(
        "the pipeline's shape pass (micro-batch 0 through every stage, before the first step): "
        "stage {} (pipeline rank {}) {} the activations of stage {} {} pipeline rank {}",
        sending ? s : s + 1, me, sending ? "sending" : "receiving", s, sending ? "to" : "from",
        schedule_.rank_of(sending ? s + 1 : s)));
  };
  std::vector<at::Tensor> received;  // the input of this rank's next stage
  for (int s = 0; s < last; ++s) {
    if (schedule_.rank_of(s) == me) {
      std::vector<at::Tensor> in = s == 0 ? fns.begin(0) : received;
      std::vector<at::Tensor> out = fns.run(0, bounds_[s], bounds_[s + 1], in);
      PARALLAX_CHECK(!out.empty() && static_cast<int>(out.size()) <= kMaxTensors, Error,
                     "pipeline: stage {} returned {} tensors (1 to {} cross a stage boundary)", s,
                     out.size(), kMaxTensors);
      Layout layout;
      for (const auto& t : out) {
        PARALLAX_CHECK(t.defined() && t.dim() <= kMaxDims, Error,
                       "pipeline: stage {} returns {} (defined tensors of at most {} dimensions "
                       "cross a stage boundary)",
                       s,
                       t.defined() ? fmt::format("a {}-d tensor", t.dim()) : "an undefined tensor",
                       kMaxDims);
        layout.push_back({t.scalar_type(), t.sizes().vec()});
      }
      act_layout_[s] = layout;
      const int peer = schedule_.rank_of(s + 1);
      try {
        at::Tensor hdr = to_comm(make_header(s, 0, layout));
        pp_->send_async(hdr, peer, 1)->wait();
        for (std::size_t k = 0; k < out.size(); ++k) {
          at::Tensor t = to_comm(out[k]);
          pp_->send_async(t, peer, 2 + static_cast<int>(k))->wait();
        }
      } catch (Error& e) {
        context(e, s, true);
        throw;
      }
      received.clear();
    }
    if (schedule_.rank_of(s + 1) == me) {
      const int peer = schedule_.rank_of(s);
      Layout layout;
      received.clear();
      try {
        at::Tensor hdr = to_comm(at::zeros({kHeader}, at::kLong));
        pp_->recv_async(hdr, peer, 1)->wait();
        const at::Tensor host = hdr.cpu();
        auto h = host.accessor<int64_t, 1>();
        PARALLAX_CHECK(h[0] == kMagic && h[1] == s && h[3] >= 1 && h[3] <= kMaxTensors, Error,
                       "pipeline: stage {} (rank {}) expected the shapes of stage {}'s activations "
                       "from pipeline rank {} and received something else (a plan mismatch "
                       "between the ranks)",
                       s + 1, me, s, peer);
        for (int64_t k = 0; k < h[3]; ++k) {
          TensorMeta m{static_cast<at::ScalarType>(h[4 + 8 * k]), {}};
          for (int64_t d = 0; d < h[5 + 8 * k]; ++d) m.shape.push_back(h[6 + 8 * k + d]);
          at::Tensor t =
              at::empty(m.shape, at::TensorOptions().dtype(m.dtype).device(comm_target_));
          pp_->recv_async(t, peer, 2 + static_cast<int>(k))->wait();
          received.push_back(t.device() == model_device ? t : t.to(model_device));
          layout.push_back(std::move(m));
        }
      } catch (Error& e) {
        context(e, s, false);
        throw;
      }
      act_layout_[s] = layout;
    }
  }
  // The gradient of stage s's inputs goes back as stage s - 1's outputs: floating ones in their
  // dtype and shape, the others as empty float placeholders.
  for (const auto& [s, layout] : act_layout_) {
    Layout g;
    for (const auto& m : layout)
      g.push_back(at::isFloatingType(m.dtype) ? m : TensorMeta{at::kFloat, {0}});
    grad_layout_[s + 1] = g;
  }
  layouts_known_ = true;
}

void PipelineEngine::forward_backward_stages(int micro_steps, const StageFns& fns,
                                             bool sync_buffers) {
  PARALLAX_CHECK(micro_steps == schedule_.micro_batches, Error,
                 "pipeline: the schedule was planned for {} micro-batches, the step has {}",
                 schedule_.micro_batches, micro_steps);
  if (sync_buffers) inner_->broadcast_buffers();
  comm_target_ = comm_device();
  if (!layouts_known_) infer_layouts(fns);
  const int last = schedule_.stages() - 1;
  const std::vector<Op>& ops = schedule_.ops[pp_->rank()];
  std::map<std::pair<int, int>, Slot> slots;  // (micro, stage)
  const bool on_device = pp_->device_type() != c10::kCPU;
  const c10::Device model_device = this->model_device();
  compute_ms_ = 0;
  // One plan slot's batch: its messages (header and tensors each) and the work moving them (on an
  // ordered transport one batch for both directions; otherwise the receives apart, so that
  // waiting for them never waits for this rank's own sends to be taken).
  struct Message {
    const Op* op;
    at::Tensor header;
    std::vector<at::Tensor> tensors;
    int64_t bytes = 0;
  };
  struct Batch {
    std::vector<Message> messages;
    comm::WorkPtr sends, recvs;
    bool received = false;
  };
  std::vector<Batch> batches;
  std::map<std::tuple<int, int, int>, std::pair<std::size_t, std::size_t>> incoming;
  std::vector<std::pair<at::Tensor, const Op*>> unchecked;  // device: headers checked at the end
  const auto batch_text = [&](const Batch& b) {
    std::string out;
    for (const auto& m : b.messages) {
      const Op& c = *m.op;
      const int other = is_act(c) ? c.stage + 1 : c.stage - 1;
      out +=
          fmt::format("{}{} {} {} stage {} (pipeline rank {}, {} bytes)", out.empty() ? "" : "; ",
                      c.is_send() ? "sending" : "receiving", message_name(c),
                      c.is_send() ? "to" : "from", c.is_send() ? other : c.stage, c.peer, m.bytes);
    }
    return out;
  };
  // The context of a failed batch, named from this rank's side as the receive errors are:
  // "pipeline stage 1 (pipeline rank 1) sending the gradients of micro-batch 3 to stage 0
  // (pipeline rank 0, 16384 bytes), <when>".
  const auto batch_context = [&](const Batch& b, const char* when) {
    int mine = -1;
    if (!b.messages.empty()) {
      const Op& c = *b.messages.front().op;
      mine = c.is_send() ? c.stage : (is_act(c) ? c.stage + 1 : c.stage - 1);
    }
    return fmt::format("pipeline stage {} (pipeline rank {}) {}, {}", mine, pp_->rank(),
                       batch_text(b), when);
  };
  const auto check_header = [&](const at::Tensor& got, const Op& c) {
    const at::Tensor want = make_header(c.stage, c.micro, layout_of(c));
    if (at::equal(got, want)) return;
    auto h = got.accessor<int64_t, 1>();
    const int consumer = is_act(c) ? c.stage + 1 : c.stage - 1;
    throw_error<Error>(
        "pipeline: stage {} (rank {}) expected {} from stage {} (pipeline rank {}) and received "
        "{} (a plan mismatch between the ranks)",
        consumer, pp_->rank(), message_name(c), c.stage, c.peer,
        h[0] != kMagic ? std::string("a message that is no pipeline header")
                       : fmt::format("stage {}'s message for micro-batch {}", h[1], h[2]));
  };
  // Posts plan ops [first, end) (one slot's communication) as one batch.
  const auto post = [&](std::size_t first, std::size_t end) {
    Batch b;
    std::vector<comm::P2POp> sends, recvs;
    for (std::size_t k = first; k < end; ++k) {
      const Op& c = ops[k];
      const Layout& layout = layout_of(c);
      Message m{&c, at::Tensor(), {}, 0};
      if (c.is_send()) {
        Slot& slot = slots.at({c.micro, c.stage});
        std::vector<at::Tensor> payload;
        if (c.kind == OpKind::kSendAct) {
          for (const auto& t : slot.outputs) payload.push_back(to_comm(t));
        } else {
          for (std::size_t j = 0; j < slot.inputs.size(); ++j) {
            const at::Tensor& g = j < slot.in_grads.size() ? slot.in_grads[j] : at::Tensor();
            const at::Tensor& x = slot.inputs[j];
            payload.push_back(g.defined() ? to_comm(g)
                              : at::isFloatingType(x.scalar_type())
                                  ? to_comm(at::zeros_like(x))
                                  : to_comm(at::zeros({0}, x.options().dtype(at::kFloat))));
          }
          slot.in_grads.clear();
          if (!schedule_.split_backward()) slots.erase({c.micro, c.stage});
        }
        bool same = payload.size() == layout.size();
        for (std::size_t j = 0; same && j < payload.size(); ++j)
          same = payload[j].scalar_type() == layout[j].dtype &&
                 payload[j].sizes().vec() == layout[j].shape;
        if (!same) {
          Layout got;
          for (const auto& t : payload) got.push_back({t.scalar_type(), t.sizes().vec()});
          throw_error<Error>(
              "pipeline: stage {} (pipeline rank {}) sends {} as {}, but the shape pass found {} "
              "(micro-batch 0 before the first step): tensors that cross a stage boundary keep "
              "their shapes and dtypes in every micro-batch and step (as in Megatron-LM and "
              "torch.distributed.pipelining); keep the micro-batch size fixed (data.drop_last)",
              c.stage, pp_->rank(), message_name(c), layout_string(got), layout_string(layout));
        }
        m.header = to_comm(make_header(c.stage, c.micro, layout));
        sends.push_back({comm::P2POp::Kind::kSend, m.header, c.peer, tag(c, 0)});
        for (std::size_t j = 0; j < payload.size(); ++j) {
          sends.push_back(
              {comm::P2POp::Kind::kSend, payload[j], c.peer, tag(c, static_cast<int>(j) + 1)});
          m.bytes += payload[j].numel() * payload[j].element_size();
        }
        m.tensors = std::move(payload);
      } else {
        m.header = buffer("header", {at::kLong, {kHeader}});
        recvs.push_back({comm::P2POp::Kind::kRecv, m.header, c.peer, tag(c, 0)});
        for (std::size_t j = 0; j < layout.size(); ++j) {
          at::Tensor t = buffer(is_act(c) ? "act" : "grad", layout[j]);
          recvs.push_back({comm::P2POp::Kind::kRecv, t, c.peer, tag(c, static_cast<int>(j) + 1)});
          m.bytes += t.numel() * t.element_size();
          m.tensors.push_back(t);
        }
        incoming[{is_act(c) ? 0 : 1, c.micro, c.stage}] = {batches.size(), b.messages.size()};
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
    batches.push_back(std::move(b));
  };
  // Completes the receive of message `key` for the compute op `pass` (F or B) of `consumer`.
  const auto complete = [&](const std::tuple<int, int, int>& key, const char* pass) {
    const auto it = incoming.find(key);
    PARALLAX_CHECK(it != incoming.end(), Error,
                   "pipeline: rank {} needs the {} of micro-batch {} from stage {} but its plan "
                   "posted no receive for it",
                   pp_->rank(), std::get<0>(key) == 0 ? "activations" : "gradients",
                   std::get<1>(key), std::get<2>(key));
    Batch& b = batches[it->second.first];
    Message& m = b.messages[it->second.second];
    const Op& c = *m.op;
    const bool act = is_act(c);
    if (!b.received) {
      try {
        if (on_device) {
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
    if (on_device) {
      unchecked.push_back({m.header, &c});
    } else {
      check_header(m.header, c);
    }
    m.header = at::Tensor();
    std::vector<at::Tensor> got = std::move(m.tensors);
    m.tensors.clear();
    incoming.erase(it);
    for (auto& t : got)
      if (t.device() != model_device) t = t.to(model_device);
    if (act) {
      Slot& slot = slots[{c.micro, c.stage + 1}];
      for (auto& t : got)
        if (at::isFloatingType(t.scalar_type())) t.set_requires_grad(true);
      slot.inputs = std::move(got);
      return;
    }
    Slot& slot = slots.at({c.micro, c.stage - 1});
    for (std::size_t k = 0; k < got.size() && k < slot.outputs.size(); ++k) {
      const at::Tensor& o = slot.outputs[k];
      if (o.requires_grad() && got[k].scalar_type() != o.scalar_type())
        got[k] = got[k].to(o.scalar_type());
    }
    slot.out_grads = std::move(got);
  };
  // The parameters of each of this rank's stages that train (the weight-gradient targets).
  std::map<int, std::vector<at::Tensor>> trainable_of;
  {
    std::map<std::string, at::Tensor> by_name;
    for (const auto& item : module_->named_parameters()) by_name[item.key()] = item.value();
    for (int s : my_stages_)
      for (int u = bounds_[s]; u < bounds_[s + 1]; ++u)
        for (const auto& n : units_[u].param_names)
          if (by_name.at(n).requires_grad()) trainable_of[s].push_back(by_name.at(n));
  }
  const bool split = schedule_.split_backward();
  // The ops that produce parameter gradients: B, or W under zb. Each runs as one micro-step of the
  // inner engine (see the file comment of pipeline_engine.h).
  const auto param_op = [&](const Op& op) {
    return split ? op.kind == OpKind::kWeight : op.kind == OpKind::kBackward;
  };
  std::size_t i = 0;
  // Runs the plan from op i up to the next parameter-gradient op (left at i; true) or its end.
  const auto advance = [&]() -> bool {
    while (i < ops.size()) {
      const Op& op = ops[i];
      if (op.is_comm()) {
        const std::size_t end = batch_end_.at(i);
        post(i, end);
        i = end;
        continue;
      }
      if (param_op(op)) return true;
      if (op.kind == OpKind::kForward && op.stage > 0) complete({0, op.micro, op.stage - 1}, "F");
      if (op.kind == OpKind::kBackward && op.stage < last)
        complete({1, op.micro, op.stage + 1}, "B");
      core::Stopwatch clock;
      Slot& slot = slots[{op.micro, op.stage}];
      if (op.kind == OpKind::kForward) {
        std::vector<at::Tensor> in = op.stage == 0 ? fns.begin(op.micro) : slot.inputs;
        std::vector<at::Tensor> out =
            fns.run(op.micro, bounds_[op.stage], bounds_[op.stage + 1], in);
        if (op.stage == 0) slot.inputs = std::move(in);
        if (op.stage == last) {
          slot.loss = fns.finish(op.micro, out);
        } else {
          slot.outputs = std::move(out);
        }
      } else {
        // zb's B: the inputs' gradients, keeping what W needs; the graph below stays for W.
        slot.split = std::make_unique<SplitBackward>(
            slot.roots(), slot.root_grads(),
            op.stage == 0 ? std::vector<at::Tensor>{} : slot.inputs, trainable_of[op.stage]);
        if (op.stage > 0) slot.in_grads = slot.split->input_grads();
        slot.outputs.clear();
        slot.loss = at::Tensor();
        slot.out_grads.clear();
      }
      compute_ms_ += clock.elapsed_ms();
      ++i;
    }
    return false;
  };
  int param_ops = 0;
  for (const Op& op : ops)
    if (param_op(op)) ++param_ops;
  // A rank with several stages (interleaved): the inner engine expects every parameter of the
  // rank in a synced micro-step, so an op's backward also reaches the other stages' parameters
  // with zero gradients (through an empty slice of each).
  const auto others_of = [&](int stage) {
    std::vector<at::Tensor> zero_roots;
    for (const auto& [st, ps] : trainable_of) {
      if (st == stage) continue;
      for (const auto& p : ps) zero_roots.push_back(p.reshape({-1}).narrow(0, 0, 0).sum());
    }
    return zero_roots;
  };
  inner_->forward_backward_split(
      param_ops,
      MicroStepFns{[&](int) {
                     PARALLAX_CHECK(advance(), Error,
                                    "pipeline: rank {}'s plan has fewer backward ops than counted",
                                    pp_->rank());
                     const Op& op = ops[i];
                     if (!split && op.stage < last) complete({1, op.micro, op.stage + 1}, "B");
                   },
                   [&](int) {
                     const Op& op = ops[i];
                     core::Stopwatch clock;
                     Slot& slot = slots.at({op.micro, op.stage});
                     if (split) {
                       PARALLAX_CHECK(slot.split != nullptr, Error,
                                      "pipeline: W of micro-batch {} on stage {} before its B",
                                      op.micro, op.stage);
                       slot.split->weight_pass();
                       slots.erase({op.micro, op.stage});
                     } else {
                       std::vector<at::Tensor> roots = slot.roots(), grads = slot.root_grads();
                       const std::vector<at::Tensor> zeros = others_of(op.stage);
                       if (!zeros.empty()) {
                         if (grads.empty() && !roots.empty())
                           grads.push_back(at::ones_like(roots[0]));
                         for (const auto& z : zeros) {
                           roots.push_back(z);
                           grads.push_back(at::ones_like(z));
                         }
                       }
                       if (!roots.empty()) torch::autograd::backward(roots, grads);
                       if (op.stage > 0) {
                         for (const auto& x : slot.inputs)
                           slot.in_grads.push_back(x.defined() && x.requires_grad() ? x.grad()
                                                                                    : at::Tensor());
                       }
                       slot.outputs.clear();
                       slot.loss = at::Tensor();
                       slot.out_grads.clear();
                       if (op.stage == 0)
                         slots.erase({op.micro, op.stage});  // nothing to send back
                     }
                     ++i;
                     compute_ms_ += clock.elapsed_ms();
                   }},
      /*sync_buffers=*/false);
  advance();  // the sends after the last backward
  for (auto& b : batches) {
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
  batches.clear();
  PARALLAX_CHECK(incoming.empty(), Error,
                 "pipeline: rank {} received {} message(s) no compute op consumed", pp_->rank(),
                 incoming.size());
  if (!unchecked.empty()) {
    std::vector<at::Tensor> headers;
    for (const auto& [h, op] : unchecked) headers.push_back(h);
    const at::Tensor host = at::stack(headers).cpu();
    for (std::size_t k = 0; k < unchecked.size(); ++k) check_header(host[k], *unchecked[k].second);
  }
  PARALLAX_CHECK(slots.empty() || !split, Error,
                 "pipeline: {} (micro-batch, stage) states left after the step", slots.size());
}

std::vector<optim::GradGroup> PipelineEngine::grads() {
  std::vector<optim::GradGroup> g = inner_->grads();
  // Each stage holds other parameters: every group is sharded over the pipeline.
  for (auto& grp : g) grp.sharded_over.push_back(pp_.get());
  return g;
}

std::vector<StatePiece> PipelineEngine::model_state() {
  std::vector<StatePiece> out;
  const std::vector<int> replicas = inner_->model_replicas();
  std::set<std::string> mine;
  for (int s : my_stages_)
    for (int u = bounds_[s]; u < bounds_[s + 1]; ++u)
      mine.insert(units_[u].param_names.begin(), units_[u].param_names.end());
  const auto whole = [&](const std::string& name, const at::Tensor& t) {
    out.push_back({name, t.detach(), t.sizes().vec(),
                   std::vector<int64_t>(static_cast<std::size_t>(t.dim()), 0), replicas});
  };
  for (const auto& item : module_->named_parameters())
    if (mine.count(item.key())) whole(item.key(), item.value());
  // A buffer belongs to the stage that holds its module's parameters, the stage whose rank runs
  // the module and so updates it (an FP8 layer's amax history, a norm's running statistics): that
  // rank saves it, since every other rank's copy is stale. A buffer of no stage's module (no
  // parameters under it, or parameters on several stages) is the same on every rank: pipeline
  // rank 0 saves it.
  std::map<std::string, int> stage_of_module;  // -1: parameters on several stages
  for (int s = 0; s + 1 < static_cast<int>(bounds_.size()); ++s) {
    for (int u = bounds_[s]; u < bounds_[s + 1]; ++u) {
      for (const auto& name : units_[u].param_names) {
        for (std::size_t dot = name.find('.'); dot != std::string::npos;
             dot = name.find('.', dot + 1)) {
          const auto [it, fresh] = stage_of_module.emplace(name.substr(0, dot), s);
          if (!fresh && it->second != s) it->second = -1;
        }
      }
    }
  }
  const auto owner_stage = [&](const std::string& buffer) {
    for (std::size_t dot = buffer.rfind('.'); dot != std::string::npos && dot > 0;
         dot = buffer.rfind('.', dot - 1)) {
      const auto it = stage_of_module.find(buffer.substr(0, dot));
      if (it != stage_of_module.end()) return it->second;
    }
    return -1;
  };
  const std::set<int> my_stages(my_stages_.begin(), my_stages_.end());
  for (const auto& item : module_->named_buffers()) {
    if (!item.value().defined()) continue;
    const int s = owner_stage(item.key());
    if (s >= 0 ? my_stages.count(s) != 0 : pp_->rank() == 0) whole(item.key(), item.value());
  }
  return out;
}

void PipelineEngine::gather_full_params() {
  if (full_) return;
  at::NoGradGuard no_grad;
  const c10::DeviceType dev = pp_->device_type();
  const c10::Device target = comm_device();
  auto params = module_->named_parameters();
  for (const auto& unit : units_) {
    for (const auto& name : unit.param_names) {
      at::Tensor p = params[name];
      const auto it = foreign_.find(name);
      if (it != foreign_.end()) p.set_data(at::empty(it->second, p.options()));
      at::Tensor buf = p.detach();
      if (buf.device().type() != dev) buf = buf.to(target);
      pp_->broadcast_async(buf, owner_.at(name))->wait();
      if (buf.data_ptr() != p.data_ptr()) p.detach().copy_(buf);
    }
  }
  full_ = true;
}

void PipelineEngine::release_full_params() {
  if (!full_) return;
  at::NoGradGuard no_grad;
  auto params = module_->named_parameters();
  for (const auto& [name, shape] : foreign_) {
    at::Tensor p = params[name];
    p.set_data(at::empty({0}, p.options()));
  }
  full_ = false;
}

}  // namespace parallax::parallel::pipeline
