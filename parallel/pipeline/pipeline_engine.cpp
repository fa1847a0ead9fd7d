#include "parallel/pipeline/pipeline_engine.h"

#include "core/error.h"
#include "core/timer.h"
#include "parallel/pipeline/partition.h"
#include "parallel/pipeline/schedule_check.h"
#include "parallel/pipeline/shape_pass.h"
#include "parallel/pipeline/split_backward.h"

#include <torch/csrc/autograd/autograd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>

namespace parallax::parallel::pipeline {

// One (micro-batch, stage)'s live tensors, from its F to its B (under zb: to its W).
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
                               std::vector<units::Unit> units, const std::vector<double>& costs,
                               comm::CommPtr pp, int micro_batches, const PipelineOptions& options,
                               const std::function<std::unique_ptr<Engine>()>& make_inner)
    : module_(std::move(module)), units_(std::move(units)), pp_(std::move(pp)) {
  micro_batches_ = micro_batches;
  schedule_ = build_schedule(options.schedule, pp_->size(), micro_batches, options.virtual_stages);
  check(schedule_);
  p2p_ = std::make_unique<P2pMessenger>(pp_, schedule_,
                                        options.ordered_p2p || pp_->device_type() != c10::kCPU);
  const int S = schedule_.stages();
  PARALLAX_CHECK(costs.size() == units_.size(), Error, "pipeline: {} unit costs for {} units",
                 costs.size(), units_.size());
  bounds_ =
      partition(costs, S, options.layout, options.activation_bytes, in_flight_per_stage(schedule_));
  for (int s = 0; s < S; ++s) {
    if (schedule_.rank_of(s) == pp_->rank()) my_stages_.push_back(s);
    for (int u = bounds_[s]; u < bounds_[s + 1]; ++u)
      for (const auto& name : units_[u].param_names) owner_[name] = schedule_.rank_of(s);
  }
  release_foreign_params();
  inner_ = make_inner();
  gather_step_replicas();
  p2p_->connect_peers(comm_device());
}

void PipelineEngine::release_foreign_params() {
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
}

void PipelineEngine::gather_step_replicas() {
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

LossTerms PipelineEngine::step(const StepFns& fns, bool sync_buffers) {
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
  forward_backward_stages(stages, sync_buffers);
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

// One step's run of this rank's plan: the op index, the live (micro-batch, stage) slots, and the
// parameters each of this rank's stages trains. Ops run in plan order; each op that produces
// parameter gradients (B, or W under zb) is one micro-step of the inner engine (the file comment
// of pipeline_engine.h), and advance() runs everything between two of them.
class PipelineEngine::StepRun {
 public:
  StepRun(PipelineEngine& engine, const StageFns& fns)
      : e_(engine),
        fns_(fns),
        ops_(engine.schedule_.ops[engine.pp_->rank()]),
        last_(engine.schedule_.stages() - 1),
        split_(engine.schedule_.split_backward()) {
    std::map<std::string, at::Tensor> by_name;
    for (const auto& item : e_.module_->named_parameters()) by_name[item.key()] = item.value();
    for (int s : e_.my_stages_)
      for (int u = e_.bounds_[s]; u < e_.bounds_[s + 1]; ++u)
        for (const auto& n : e_.units_[u].param_names)
          if (by_name.at(n).requires_grad()) trainable_of_[s].push_back(by_name.at(n));
  }

  void run() {
    int param_ops = 0;
    for (const Op& op : ops_)
      if (param_op(op)) ++param_ops;
    e_.inner_->forward_backward_split(
        param_ops, MicroStepFns{[&](int) { param_forward(); }, [&](int) { param_backward(); }},
        /*sync_buffers=*/false);
    advance();  // the sends after the last backward
    e_.p2p_->end_step();
    PARALLAX_CHECK(slots_.empty() || !split_, Error,
                   "pipeline: {} (micro-batch, stage) states left after the step", slots_.size());
  }

 private:
  // The ops that produce parameter gradients: B, or W under zb.
  bool param_op(const Op& op) const {
    return split_ ? op.kind == OpKind::kWeight : op.kind == OpKind::kBackward;
  }

  // What send op `c` moves: stage c.stage's outputs, or the gradients of its inputs (zeros where
  // an input got none; empty float placeholders for inputs that are not floating).
  std::vector<at::Tensor> payload(const Op& c) {
    Slot& slot = slots_.at({c.micro, c.stage});
    if (c.kind == OpKind::kSendAct) return slot.outputs;
    std::vector<at::Tensor> payload;
    for (std::size_t j = 0; j < slot.inputs.size(); ++j) {
      const at::Tensor& g = j < slot.in_grads.size() ? slot.in_grads[j] : at::Tensor();
      const at::Tensor& x = slot.inputs[j];
      payload.push_back(g.defined() ? g
                        : at::isFloatingType(x.scalar_type())
                            ? at::zeros_like(x)
                            : at::zeros({0}, x.options().dtype(at::kFloat)));
    }
    slot.in_grads.clear();
    if (!split_) slots_.erase({c.micro, c.stage});
    return payload;
  }

  // Completes the receive of what stage `from` produced for micro-batch `micro`, for the compute
  // op `pass` of the neighbouring stage, into that stage's slot.
  void receive(bool act, int micro, int from, const char* pass) {
    std::vector<at::Tensor> got = e_.p2p_->receive(act, micro, from, pass);
    if (act) {
      Slot& slot = slots_[{micro, from + 1}];
      for (auto& t : got)
        if (at::isFloatingType(t.scalar_type())) t.set_requires_grad(true);
      slot.inputs = std::move(got);
      return;
    }
    Slot& slot = slots_.at({micro, from - 1});
    for (std::size_t k = 0; k < got.size() && k < slot.outputs.size(); ++k) {
      const at::Tensor& o = slot.outputs[k];
      if (o.requires_grad() && got[k].scalar_type() != o.scalar_type())
        got[k] = got[k].to(o.scalar_type());
    }
    slot.out_grads = std::move(got);
  }

  // An F, or zb's B (the inputs' gradients, keeping what W needs; the graph below stays for W).
  void compute(const Op& op) {
    core::Stopwatch clock;
    Slot& slot = slots_[{op.micro, op.stage}];
    if (op.kind == OpKind::kForward) {
      std::vector<at::Tensor> in = op.stage == 0 ? fns_.begin(op.micro) : slot.inputs;
      std::vector<at::Tensor> out =
          fns_.run(op.micro, e_.bounds_[op.stage], e_.bounds_[op.stage + 1], in);
      if (op.stage == 0) slot.inputs = std::move(in);
      if (op.stage == last_) {
        slot.loss = fns_.finish(op.micro, out);
      } else {
        slot.outputs = std::move(out);
      }
    } else {
      slot.split = std::make_unique<SplitBackward>(
          slot.roots(), slot.root_grads(), op.stage == 0 ? std::vector<at::Tensor>{} : slot.inputs,
          trainable_of_[op.stage]);
      if (op.stage > 0) slot.in_grads = slot.split->input_grads();
      slot.outputs.clear();
      slot.loss = at::Tensor();
      slot.out_grads.clear();
    }
    e_.compute_ms_ += clock.elapsed_ms();
  }

  // Runs the plan from op i_ up to the next parameter-gradient op (left at i_; true) or its end.
  bool advance() {
    while (i_ < ops_.size()) {
      const Op& op = ops_[i_];
      if (op.is_comm()) {
        const std::size_t end = e_.p2p_->batch_end(i_);
        e_.p2p_->post(i_, end, [&](const Op& c) { return payload(c); });
        i_ = end;
        continue;
      }
      if (param_op(op)) return true;
      if (op.kind == OpKind::kForward && op.stage > 0) receive(true, op.micro, op.stage - 1, "F");
      if (op.kind == OpKind::kBackward && op.stage < last_)
        receive(false, op.micro, op.stage + 1, "B");
      compute(op);
      ++i_;
    }
    return false;
  }

  // A rank with several stages (interleaved): the inner engine expects every parameter of the
  // rank in a synced micro-step, so an op's backward also reaches the other stages' parameters
  // with zero gradients (through an empty slice of each).
  std::vector<at::Tensor> zero_roots_besides(int stage) {
    std::vector<at::Tensor> zero_roots;
    for (const auto& [st, ps] : trainable_of_) {
      if (st == stage) continue;
      for (const auto& p : ps) zero_roots.push_back(p.reshape({-1}).narrow(0, 0, 0).sum());
    }
    return zero_roots;
  }

  // The inner engine's micro-step, first part: the plan up to the parameter-gradient op, and its
  // received output gradient.
  void param_forward() {
    PARALLAX_CHECK(advance(), Error, "pipeline: rank {}'s plan has fewer backward ops than counted",
                   e_.pp_->rank());
    const Op& op = ops_[i_];
    if (!split_ && op.stage < last_) receive(false, op.micro, op.stage + 1, "B");
  }

  // The micro-step's one autograd pass: B (the whole backward) or zb's W.
  void param_backward() {
    const Op& op = ops_[i_];
    core::Stopwatch clock;
    Slot& slot = slots_.at({op.micro, op.stage});
    if (split_) {
      PARALLAX_CHECK(slot.split != nullptr, Error,
                     "pipeline: W of micro-batch {} on stage {} before its B", op.micro, op.stage);
      slot.split->weight_pass();
      slots_.erase({op.micro, op.stage});
    } else {
      std::vector<at::Tensor> roots = slot.roots(), grads = slot.root_grads();
      const std::vector<at::Tensor> zeros = zero_roots_besides(op.stage);
      if (!zeros.empty()) {
        if (grads.empty() && !roots.empty()) grads.push_back(at::ones_like(roots[0]));
        for (const auto& z : zeros) {
          roots.push_back(z);
          grads.push_back(at::ones_like(z));
        }
      }
      if (!roots.empty()) torch::autograd::backward(roots, grads);
      if (op.stage > 0) {
        for (const auto& x : slot.inputs)
          slot.in_grads.push_back(x.defined() && x.requires_grad() ? x.grad() : at::Tensor());
      }
      slot.outputs.clear();
      slot.loss = at::Tensor();
      slot.out_grads.clear();
      if (op.stage == 0) slots_.erase({op.micro, op.stage});  // nothing to send back
    }
    ++i_;
    e_.compute_ms_ += clock.elapsed_ms();
  }

  PipelineEngine& e_;
  const StageFns& fns_;
  const std::vector<Op>& ops_;
  const int last_;
  const bool split_;
  std::map<std::pair<int, int>, Slot> slots_;  // (micro, stage)
  std::map<int, std::vector<at::Tensor>> trainable_of_;
  std::size_t i_ = 0;
};

void PipelineEngine::forward_backward_stages(const StageFns& fns, bool sync_buffers) {
  if (sync_buffers) inner_->broadcast_buffers();
  const c10::Device comm = comm_device(), model = model_device();
  p2p_->begin_step(comm, model);
  if (!p2p_->shapes_known()) {
    p2p_->set_activation_shapes(
        infer_activation_shapes(schedule_, *pp_, *module_, comm, model,
                                [&](int s, const std::vector<at::Tensor>& received) {
                                  std::vector<at::Tensor> in = s == 0 ? fns.begin(0) : received;
                                  return fns.run(0, bounds_[s], bounds_[s + 1], in);
                                }));
  }
  compute_ms_ = 0;
  StepRun(*this, fns).run();
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
