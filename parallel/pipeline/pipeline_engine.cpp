#include "parallel/pipeline/pipeline_engine.h"

#include "core/error.h"
#include "core/timer.h"

#include <torch/csrc/autograd/autograd.h>

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <set>
#include <tuple>

namespace parallax::parallel::pipeline {

namespace {

constexpr int64_t kMagic = 0x50504C58;  // "PPLX"
constexpr int64_t kHeader = 64;
constexpr int kMaxTensors = 7;  // 4 + 8 * 7 < kHeader
constexpr int kMaxDims = 6;

int64_t dtype_code(at::ScalarType t) { return static_cast<int64_t>(t); }

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
  std::vector<at::Tensor> inputs;     // received (leaves) or the begin() values
  std::vector<at::Tensor> outputs;    // what the stage returned (not on the last stage)
  at::Tensor loss;                    // the last stage
  std::vector<at::Tensor> out_grads;  // received gradient of each output
  std::vector<at::Tensor> in_grads;   // gradient of each input, to send
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
                               comm::CommPtr pp, int micro_batches,
                               const PipelineOptions& options,
                               const std::function<std::unique_ptr<Engine>()>& make_inner)
    : module_(std::move(module)), units_(std::move(units)), pp_(std::move(pp)) {
  schedule_ = build_schedule(options.schedule, pp_->size(), micro_batches, options.virtual_stages);
  check(schedule_);
  ordered_ = options.ordered_p2p || pp_->device_type() != c10::kCPU;
  if (ordered_) check_ordered(schedule_);
  const int S = schedule_.stages();
  PARALLAX_CHECK(2 * S * micro_batches * (kMaxTensors + 1) < comm::kMaxUserTag, ConfigError,
                 "keys 'parallel.pp' and 'train.grad_accum': {} stages x {} micro-batches is "
                 "more messages than one step's tags can name",
                 S, micro_batches);
  PARALLAX_CHECK(costs.size() == units_.size(), Error,
                 "pipeline: {} unit costs for {} units", costs.size(), units_.size());
  bounds_ = partition(costs, S, options.layout, options.activation_bytes,
                      in_flight_per_stage(schedule_));
  for (int s = 0; s < S; ++s) {
    if (schedule_.rank_of(s) == pp_->rank()) my_stages_.push_back(s);
    for (int u = bounds_[s]; u < bounds_[s + 1]; ++u)
      for (const auto& name : units_[u].param_names) owner_[name] = schedule_.rank_of(s);
  }
  // Parameters of other ranks' stages: frozen and released (their shapes kept for gathering).
  at::NoGradGuard no_grad;
  for (auto& item : module_->named_parameters()) {
    const auto it = owner_.find(item.key());
    PARALLAX_CHECK(it != owner_.end(), Error, "pipeline: parameter '{}' is in no unit",
                   item.key());
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
  for (int64_t k = 0; k < all.numel(); ++k) step_replicas_.push_back(static_cast<int>(all[k].item<int64_t>()));
  std::sort(step_replicas_.begin(), step_replicas_.end());
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
  return fmt::format("pipeline '{}' over group '{}' of {} ranks, {} stages, {} micro-batches; "
                     "this rank: stage{} {}; data parallel: {}",
                     schedule_.kind, pp_->name(), pp_->size(), schedule_.stages(),
                     schedule_.micro_batches, my_stages_.size() > 1 ? "s" : "", stages,
                     inner_->describe());
}

void PipelineEngine::forward_backward(int, const std::function<at::Tensor(int)>&, bool) {
  throw_error<Error>(
      "pipeline engine: forward_backward() of the whole model is not available under "
      "parallel.pp > 1; the trainer runs forward_backward_stages()");
}

c10::Device PipelineEngine::comm_device() const {
  const c10::DeviceType type = pp_->device_type();
  if (type == c10::kCPU) return c10::Device(c10::kCPU);
  for (const auto& p : module_->parameters())
    if (p.device().type() == type) return p.device();
  return c10::Device(type);
}

int PipelineEngine::tag(const Op& op, int k) const {
  if (ordered_) return 1;  // one tag: the transport's order is the message order
  const bool act = op.kind == OpKind::kSendAct || op.kind == OpKind::kRecvAct;
  const int S = schedule_.stages(), m = schedule_.micro_batches;
  return 1 + (((act ? 0 : 1) * S + op.stage) * m + op.micro) * (kMaxTensors + 1) + k;
}

void PipelineEngine::forward_backward_stages(int micro_steps, const StageFns& fns,
                                             bool sync_buffers) {
  PARALLAX_CHECK(micro_steps == schedule_.micro_batches, Error,
                 "pipeline: the schedule was planned for {} micro-batches, the step has {}",
                 schedule_.micro_batches, micro_steps);
  if (sync_buffers) inner_->broadcast_buffers();
  const int last = schedule_.stages() - 1;
  const std::vector<Op>& ops = schedule_.ops[pp_->rank()];
  std::map<std::pair<int, int>, Slot> slots;  // (micro, stage)
  const c10::DeviceType comm_dev = pp_->device_type();
  const c10::Device comm_target = comm_device();
  const auto to_comm = [&](const at::Tensor& t) {
    at::Tensor c = t.detach();
    if (c.device().type() != comm_dev) c = c.to(comm_target);
    return c.contiguous();
  };
  c10::Device model_device(c10::kCPU);
  for (const auto& p : module_->parameters()) {
    if (p.numel() > 0) {
      model_device = p.device();
      break;
    }
  }
  compute_ms_ = 0;
  // Posted sends (with the buffers they read), waited for at the end of the step; posted receives
  // by message (act 0 / grad 1, micro-batch, producing stage): the header's work and buffer, and
  // the op's index in the plan.
  struct PendingSend {
    comm::WorkPtr work;
    at::Tensor buffer;
    const Op* op;
  };
  std::vector<PendingSend> pending;
  struct PostedRecv {
    comm::WorkPtr work;
    at::Tensor header;
    std::size_t index;
  };
  std::map<std::tuple<int, int, int>, PostedRecv> posted;
  // Completes the receive of message `key`: its header, then the tensors the header describes,
  // into the slot of the stage that consumes them.
  const auto complete = [&](const std::tuple<int, int, int>& key) {
    const auto it = posted.find(key);
    PARALLAX_CHECK(it != posted.end(), Error,
                   "pipeline: rank {} needs the {} of micro-batch {} from stage {} but its plan "
                   "posted no receive for it",
                   pp_->rank(), std::get<0>(key) == 0 ? "activations" : "gradients",
                   std::get<1>(key), std::get<2>(key));
    const Op& c = ops[it->second.index];
    if (!it->second.work) {  // ordered: the header is received only now, in the sender's order
      it->second.header = to_comm(at::zeros({kHeader}, at::kLong));
      it->second.work = pp_->recv_async(it->second.header, c.peer, tag(c, 0));
    }
    const bool act = c.kind == OpKind::kRecvAct;
    const int consumer = act ? c.stage + 1 : c.stage - 1;
    // A failed or timed-out receive names the stage, micro-batch and pass that waited for it.
    const auto where = [&](Error& e) {
      e.add_context(fmt::format("pipeline stage {} (pipeline rank {}) receiving the {} of micro-batch {} for "
                                "its {} pass from stage {} (pipeline rank {})",
                                consumer, pp_->rank(), act ? "activations" : "gradients", c.micro,
                                act ? "F" : "B", c.stage, c.peer));
    };
    try {
      it->second.work->wait();
    } catch (Error& e) {
      where(e);
      throw;
    }
    const at::Tensor header = it->second.header;
    posted.erase(it);
    const at::Tensor hdr = header.cpu();
    auto h = hdr.accessor<int64_t, 1>();
    PARALLAX_CHECK(h[0] == kMagic && h[1] == c.stage && h[2] == c.micro && h[3] >= 0 &&
                       h[3] <= kMaxTensors,
                   Error,
                   "pipeline: stage {} (rank {}) expected the {} of micro-batch {} from stage {} "
                   "(pipeline rank {}) and received {} (a plan mismatch between the ranks)",
                   consumer, pp_->rank(), act ? "activations" : "gradients", c.micro, c.stage,
                   c.peer,
                   h[0] != kMagic ? std::string("a message that is no pipeline header")
                                  : fmt::format("stage {}'s message for micro-batch {}", h[1], h[2]));
    std::vector<at::Tensor> got;
    std::vector<comm::WorkPtr> works;
    for (int64_t k = 0; k < h[3]; ++k) {
      std::vector<int64_t> shape;
      for (int64_t d = 0; d < h[5 + 8 * k]; ++d) shape.push_back(h[6 + 8 * k + d]);
      at::Tensor t =
          at::empty(shape, header.options().dtype(static_cast<at::ScalarType>(h[4 + 8 * k])));
      got.push_back(t);
      works.push_back(pp_->recv_async(t, c.peer, tag(c, static_cast<int>(k) + 1)));
    }
    try {
      for (auto& w : works) w->wait();
    } catch (Error& e) {
      where(e);
      throw;
    }
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
    PARALLAX_CHECK(got.size() == slot.outputs.size(), Error,
                   "pipeline: stage {} returned {} gradients for the {} outputs of stage {} "
                   "(micro-batch {})",
                   c.stage, got.size(), slot.outputs.size(), c.stage - 1, c.micro);
    for (std::size_t k = 0; k < got.size(); ++k) {
      const at::Tensor& o = slot.outputs[k];
      PARALLAX_CHECK(!o.requires_grad() || (got[k].sizes() == o.sizes()), Error,
                     "pipeline: the gradient of output {} of stage {} (micro-batch {}) from stage "
                     "{} has shape {}, the output {}",
                     k, c.stage - 1, c.micro, c.stage, fmt::format("{}", got[k].sizes()),
                     fmt::format("{}", o.sizes()));
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
    if (!op.is_comm()) {
      if (param_op(op)) return true;
      if (op.kind == OpKind::kForward && op.stage > 0) complete({0, op.micro, op.stage - 1});
      core::Stopwatch clock;
      Slot& slot = slots[{op.micro, op.stage}];
      if (op.kind == OpKind::kForward) {
        std::vector<at::Tensor> in = op.stage == 0 ? fns.begin(op.micro) : slot.inputs;
        std::vector<at::Tensor> out = fns.run(op.micro, bounds_[op.stage], bounds_[op.stage + 1], in);
        if (op.stage == 0) slot.inputs = std::move(in);
        if (op.stage == last) {
          slot.loss = fns.finish(op.micro, out);
        } else {
          PARALLAX_CHECK(!out.empty() && static_cast<int>(out.size()) <= kMaxTensors, Error,
                         "pipeline: stage {} returned {} tensors (1 to {} cross a stage boundary)",
                         op.stage, out.size(), kMaxTensors);
          slot.outputs = std::move(out);
        }
      } else {
        // zb's B: the input gradient only; the graph stays for W.
        if (op.stage < last) complete({1, op.micro, op.stage + 1});
        const std::vector<at::Tensor> roots = slot.roots();
        std::vector<at::Tensor> leaves;
        for (const auto& x : slot.inputs)
          if (x.defined() && x.requires_grad()) leaves.push_back(x);
        std::vector<at::Tensor> g;
        if (!leaves.empty() && !roots.empty())
          g = torch::autograd::grad(roots, leaves, slot.root_grads(), /*retain_graph=*/true,
                                    /*create_graph=*/false, /*allow_unused=*/true);
        std::size_t k = 0;
        for (const auto& x : slot.inputs)
          slot.in_grads.push_back(x.defined() && x.requires_grad() ? g.at(k++) : at::Tensor());
      }
      compute_ms_ += clock.elapsed_ms();
      ++i;
      continue;
    }
    // A communication op: a send posts its header and tensors at once (waited for at the end of
    // the step); a receive posts its header and completes right before the op that consumes it.
    if (!op.is_send()) {
      const std::tuple<int, int, int> key{op.kind == OpKind::kRecvAct ? 0 : 1, op.micro, op.stage};
      if (ordered_) {
        posted[key] = {nullptr, at::Tensor(), i};  // posted by complete(), in the sender's order
      } else {
        at::Tensor hdr = to_comm(at::zeros({kHeader}, at::kLong));
        posted[key] = {pp_->recv_async(hdr, op.peer, tag(op, 0)), hdr, i};
      }
      ++i;
      continue;
    }
    {
      const Op& c = op;
      Slot& slot = slots.at({c.micro, c.stage});
      std::vector<at::Tensor> payload;
      if (c.kind == OpKind::kSendAct) {
        for (const auto& t : slot.outputs) payload.push_back(to_comm(t));
      } else {
        for (std::size_t k = 0; k < slot.inputs.size(); ++k) {
          const at::Tensor& g = slot.in_grads.at(k);
          const at::Tensor& x = slot.inputs[k];
          payload.push_back(g.defined() ? to_comm(g)
                            : at::isFloatingType(x.scalar_type())
                                ? to_comm(at::zeros_like(x))
                                : to_comm(at::zeros({0}, x.options().dtype(at::kFloat))));
        }
        slot.in_grads.clear();
        if (!schedule_.split_backward()) slots.erase({c.micro, c.stage});
      }
      at::Tensor hdr = at::zeros({kHeader}, at::kLong);
      auto h = hdr.accessor<int64_t, 1>();
      h[0] = kMagic;
      h[1] = c.stage;
      h[2] = c.micro;
      h[3] = static_cast<int64_t>(payload.size());
      for (std::size_t k = 0; k < payload.size(); ++k) {
        const at::Tensor& t = payload[k];
        PARALLAX_CHECK(t.dim() <= kMaxDims, Error,
                       "pipeline: stage {} sends a {}-d tensor (at most {} dimensions)", c.stage,
                       t.dim(), kMaxDims);
        h[4 + 8 * k] = dtype_code(t.scalar_type());
        h[5 + 8 * k] = t.dim();
        for (int64_t d = 0; d < t.dim(); ++d) h[6 + 8 * k + d] = t.size(d);
      }
      hdr = to_comm(hdr);
      pending.push_back({pp_->send_async(hdr, c.peer, tag(c, 0)), hdr, &c});
      for (std::size_t k = 0; k < payload.size(); ++k)
        pending.push_back(
            {pp_->send_async(payload[k], c.peer, tag(c, static_cast<int>(k) + 1)), payload[k], &c});
    }
    ++i;
    continue;
  }
  return false;
  };
  // Each parameter-gradient op as one micro-step of the inner engine (DDP, ZeRO-1/2): its
  // gradients G_p are computed with autograd::grad, and the micro-step's loss is
  // sum_p <p, G_p> over the op's stage parameters plus an empty slice of every other stage
  // parameter, whose backward accumulates exactly G_p (and zeros) through the inner engine's
  // hooks: no-sync accumulation in all but the last micro-step for DDP and ZeRO-1, a
  // reduce-scatter per micro-step for ZeRO-2, as without a pipeline.
  int param_ops = 0;
  for (const Op& op : ops)
    if (param_op(op)) ++param_ops;
  std::vector<at::Tensor> all_mine;
  for (const auto& [st, ps] : trainable_of) all_mine.insert(all_mine.end(), ps.begin(), ps.end());
  inner_->forward_backward(
      param_ops,
      [&](int) -> at::Tensor {
        PARALLAX_CHECK(advance(), Error,
                       "pipeline: rank {}'s plan has fewer backward ops than counted", pp_->rank());
        const Op& op = ops[i];
        if (!split && op.stage < last) complete({1, op.micro, op.stage + 1});
        core::Stopwatch clock;
        Slot& slot = slots.at({op.micro, op.stage});
        const std::vector<at::Tensor> roots = slot.roots();
        const std::vector<at::Tensor>& params = trainable_of[op.stage];
        std::vector<at::Tensor> targets(params);
        std::vector<at::Tensor> leaves;
        if (!split)
          for (const auto& x : slot.inputs)
            if (x.defined() && x.requires_grad()) leaves.push_back(x);
        targets.insert(targets.end(), leaves.begin(), leaves.end());
        std::vector<at::Tensor> g;
        if (!roots.empty() && !targets.empty())
          g = torch::autograd::grad(roots, targets, slot.root_grads(), /*retain_graph=*/false,
                                    /*create_graph=*/false, /*allow_unused=*/true);
        if (!split) {
          std::size_t k = params.size();
          for (const auto& x : slot.inputs)
            slot.in_grads.push_back(x.defined() && x.requires_grad() && !g.empty() ? g.at(k++)
                                                                                   : at::Tensor());
          slot.outputs.clear();
          slot.loss = at::Tensor();
          if (op.stage == 0) slots.erase({op.micro, op.stage});  // nothing to send back
        } else {
          slots.erase({op.micro, op.stage});
        }
        std::set<const void*> done;
        at::Tensor total;
        const auto add = [&](const at::Tensor& t) { total = total.defined() ? total + t : t; };
        for (std::size_t k = 0; k < params.size(); ++k) {
          done.insert(params[k].unsafeGetTensorImpl());
          if (!g.empty() && g[k].defined()) {
            add((params[k] * g[k].detach()).sum());
          } else {
            add(params[k].reshape({-1}).narrow(0, 0, 0).sum());
          }
        }
        for (const auto& p : all_mine)
          if (!done.count(p.unsafeGetTensorImpl())) add(p.reshape({-1}).narrow(0, 0, 0).sum());
        ++i;
        compute_ms_ += clock.elapsed_ms();
        return total;
      },
      /*sync_buffers=*/false);
  advance();  // the sends after the last backward
  for (auto& w : pending) {
    try {
      w.work->wait();
    } catch (Error& e) {
      const bool act = w.op->kind == OpKind::kSendAct;
      e.add_context(fmt::format("pipeline stage {} (pipeline rank {}) sending the {} of micro-batch {} to stage {} "
                                "(pipeline rank {})",
                                w.op->stage, pp_->rank(), act ? "activations" : "gradients", w.op->micro,
                                act ? w.op->stage + 1 : w.op->stage - 1, w.op->peer));
      throw;
    }
  }
  pending.clear();
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
  if (pp_->rank() == 0)
    for (const auto& item : module_->named_buffers())
      if (item.value().defined()) whole(item.key(), item.value());
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
      if (buf.device().type() != dev)
        buf = buf.to(target);
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
