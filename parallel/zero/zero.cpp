#include "parallel/zero/zero.h"

#include "core/error.h"
#include "core/log.h"
#include "core/strings.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>

namespace parallax::parallel::zero {

ZeroEngine::ZeroEngine(std::shared_ptr<torch::nn::Module> module,
                       std::vector<optim::ParamGroup> groups, const OptimizerFactory& make,
                       comm::CommPtr dp, ddp::DdpOptions options, int stage,
                       std::vector<units::Unit> units, bool prefetch, bool always_gather,
                       TensorParallelInfo tp, std::shared_ptr<const units::DeferredInit> deferred)
    : DataParallelEngine(std::move(module), std::move(dp), std::move(tp), options.timing),
      stage_(stage),
      broadcast_buffers_(options.broadcast_buffers) {
  PARALLAX_CHECK(stage_ >= 1 && stage_ <= 3, ConfigError, "ZeRO: stage {} is not 1, 2 or 3",
                 stage_);
  PARALLAX_CHECK(!deferred || stage_ == 3, Error,
                 "ZeRO: deferred initialisation needs stage 3 (stage {} keeps the whole model)",
                 stage_);
  // Stage 3: the unit of every parameter; buckets never mix units either.
  const auto unit_of = std::make_shared<const std::map<std::string, int>>(units_of_params(units));
  if (stage_ == 3) shards_ = std::make_unique<ParamShards>(dp_, units, prefetch, always_gather);
  // ZeRO-2/3 keep no full gradient between reduce-scatters (over one rank the shard is the whole
  // gradient anyway: plain flat buckets, which the reducer reduces in place, for free).
  reduce_each_micro_ = stage_ >= 2 && dp_->size() > 1;
  options = bucket_options(std::move(options), groups, unit_of, static_cast<int>(units.size()));
  // Identical replicas (parameters and buffers from dp rank 0; with deferred initialisation every
  // rank replays the same recipes instead), then DDP's gradient buckets in reduce-scatter mode.
  if (!deferred) ddp::broadcast_module(*module_, *dp_);
  // A parameter's initial value, read once into its flat buffer.
  const InitialValue initial = [&deferred](const std::string& name, const at::Tensor& p) {
    return deferred ? deferred->value(name).reshape({-1}) : p.detach().reshape({-1});
  };
  buckets_ = std::make_unique<ddp::GradBuckets>(module_, dp_, options);
  set_timed_buckets(buckets_.get());

  std::map<std::string, int64_t> index;
  for (const auto& item : module_->named_parameters()) {
    if (!item.value().requires_grad()) continue;
    index[item.key()] = static_cast<int64_t>(params_.size());
    params_.push_back(item.value());
  }
  at::NoGradGuard no_grad;
  std::map<std::string, std::size_t> piece_of;
  for (std::size_t bi = 0; bi < buckets_->buckets().size(); ++bi)
    add_bucket(bi, index, *unit_of, initial, deferred != nullptr, piece_of);
  if (shards_) {
    shard_frozen(*unit_of, initial, deferred != nullptr);
    shards_->finish_setup();  // everything freed: only the shards stay
    flat_params_.clear();
  }
  optimizer_ = make(piece_groups(groups, piece_of));
  core::log::info("{}", describe());
}

std::map<std::string, int> ZeroEngine::units_of_params(
    const std::vector<units::Unit>& units) const {
  std::map<std::string, int> unit_of;
  if (stage_ != 3) return unit_of;
  PARALLAX_CHECK(!units.empty(), Error, "ZeRO-3: the model exposes no units");
  for (std::size_t u = 0; u < units.size(); ++u) {
    for (const auto& n : units[u].param_names) {
      PARALLAX_CHECK(unit_of.emplace(n, static_cast<int>(u)).second, Error,
                     "ZeRO-3: parameter '{}' is in two units ('{}' and '{}')", n,
                     units[static_cast<std::size_t>(unit_of.at(n))].name, units[u].name);
    }
  }
  for (const auto& item : module_->named_parameters()) {
    PARALLAX_CHECK(unit_of.count(item.key()) != 0, Error,
                   "ZeRO-3: parameter '{}' is in no unit of the model (Model::units() must "
                   "cover every parameter)",
                   item.key());
  }
  return unit_of;
}

ddp::DdpOptions ZeroEngine::bucket_options(
    ddp::DdpOptions options, const std::vector<optim::ParamGroup>& groups,
    std::shared_ptr<const std::map<std::string, int>> unit_of, int n_units) {
  // Buckets never mix optimizer groups (their weight decay or lr multiplier differs).
  auto group_of = std::make_shared<std::map<std::string, int>>();
  for (std::size_t g = 0; g < groups.size(); ++g)
    for (const auto& n : groups[g].names) (*group_of)[n] = static_cast<int>(g);
  options.reduction = ddp::Reduction::kReduceScatter;
  options.transient = reduce_each_micro_;
  const int n_groups = static_cast<int>(groups.size()) + 1;
  // Tensor parallel: a bucket holds only tp-sharded or only tp-replicated parameters, so each of
  // this rank's pieces is one or the other (grads()).
  options.bucket_key = [this, group_of, unit_of, n_groups, n_units](const std::string& name) {
    const auto it = group_of->find(name);
    const auto u = unit_of->find(name);
    return bucket_key(it == group_of->end() ? -1 : it->second, u == unit_of->end() ? -1 : u->second,
                      n_groups, n_units, tp_.is_sharded(name));
  };
  if (stage_ == 3) {
    // One bucket per (unit, dtype, group): no cap splits a unit's flat parameter.
    options.bucket_mb = options.first_bucket_mb = 1e9;
    options.on_launch = [this](std::size_t bucket) { shards_->bucket_launched(bucket); };
  }
  return options;
}

void ZeroEngine::add_bucket(std::size_t bi, const std::map<std::string, int64_t>& index,
                            const std::map<std::string, int>& unit_of, const InitialValue& initial,
                            bool deferred, std::map<std::string, std::size_t>& piece_of) {
  const int64_t n = dp_->size(), r = dp_->rank();
  const ddp::BucketInfo& info = buckets_->buckets()[bi];
  const at::Tensor& first =
      params_.at(static_cast<std::size_t>(index.at(info.param_names.front())));
  at::Tensor flat = at::zeros({info.padded_numel}, first.options().requires_grad(false));
  const int64_t shard = info.padded_numel / n, lo = r * shard, hi = lo + shard;
  std::vector<at::Tensor> members;
  const std::size_t first_piece = pieces_.size();
  // The reduce-scatter's shard is the gradient: stage 1 reduces once per step; stage 2 reduces
  // every micro-step and, with several, sums the shards into an accumulator (allocated then).
  at::Tensor acc = buckets_->bucket_shard(bi);
  for (std::size_t k = 0; k < info.param_names.size(); ++k) {
    const int64_t pi = index.at(info.param_names[k]);
    at::Tensor& p = params_[static_cast<std::size_t>(pi)];
    const int64_t off = info.offsets[k], numel = p.numel();
    at::Tensor view = flat.narrow(0, off, numel);
    view.copy_(initial(info.param_names[k], p));
    // The parameter becomes a view into the bucket's flat buffer (same autograd identity, so
    // the gradient hooks stay attached): the all-gather after each step updates it in place.
    p.set_data(view.view(p.sizes()));
    members.push_back(p);
    const int64_t b = std::max(off, lo), e = std::min(off + numel, hi);
    if (numel == 0 || b >= e) continue;
    Piece piece;
    piece.name = info.param_names[k];
    piece.shape = p.sizes().vec();
    piece.begin = b - off;
    piece.end = e - off;
    piece.param_index = pi;
    piece.param = flat.narrow(0, b, e - b);
    piece.grad = acc.narrow(0, b - lo, e - b);
    piece.bucket = bi;
    piece.shard_offset = b - lo;
    for (int64_t q = off / shard; q <= (off + numel - 1) / shard; ++q)
      piece.holders.push_back(dp_->world_ranks().at(static_cast<std::size_t>(q)));
    piece_of[piece.name] = pieces_.size();
    pieces_.push_back(std::move(piece));
  }
  if (shards_) {
    // Stage 3: the bucket is one unit's flat parameter; the pieces live in its shard.
    const std::size_t f = shards_->flats().size();
    shards_->add(unit_of.at(info.param_names.front()), static_cast<int>(bi), info.param_names,
                 members, info.offsets, flat);
    if (deferred) units::release_free_memory();  // the unit's values, dropped
    const at::Tensor& mine = shards_->shard(f);
    for (std::size_t k = first_piece; k < pieces_.size(); ++k) {
      Piece& piece = pieces_[k];
      piece.param = mine.narrow(0, piece.shard_offset, piece.end - piece.begin);
    }
  }
  flat_params_.push_back(flat);
  grad_acc_.push_back(acc);
  shard_acc_.emplace_back();
}

void ZeroEngine::shard_frozen(const std::map<std::string, int>& unit_of,
                              const InitialValue& initial, bool deferred) {
  // Frozen parameters are sharded too (a LoRA base is most of the model): per unit and dtype,
  // gathered with the unit, never reduced.
  const int64_t n = dp_->size();
  std::map<std::pair<int, at::ScalarType>, std::vector<std::pair<std::string, at::Tensor>>> frozen;
  for (const auto& item : module_->named_parameters()) {
    if (item.value().requires_grad()) continue;
    frozen[{unit_of.at(item.key()), item.value().scalar_type()}].emplace_back(item.key(),
                                                                              item.value());
  }
  for (auto& [key, list] : frozen) {
    int64_t numel = 0;
    std::vector<std::string> names;
    std::vector<at::Tensor> params;
    std::vector<int64_t> offsets;
    for (auto& [name, p] : list) {
      names.push_back(name);
      params.push_back(p);
      offsets.push_back(numel);
      numel += p.numel();
    }
    at::Tensor flat =
        at::zeros({(numel + n - 1) / n * n}, list.front().second.options().requires_grad(false));
    for (std::size_t k = 0; k < params.size(); ++k) {
      at::Tensor view = flat.narrow(0, offsets[k], params[k].numel());
      view.copy_(initial(names[k], params[k]));
      params[k].set_data(view.view(params[k].sizes()));
    }
    shards_->add(key.first, -1, names, params, offsets, flat);
    if (deferred) units::release_free_memory();
  }
}

std::vector<optim::ParamGroup> ZeroEngine::piece_groups(
    const std::vector<optim::ParamGroup>& groups,
    const std::map<std::string, std::size_t>& piece_of) const {
  // Group by group: same names, same weight decay and lr multiplier. A rank's shard of a flat
  // buffer holds pieces of several parameters, each in its own parameter's group.
  std::vector<optim::ParamGroup> sharded;
  for (const auto& g : groups) {
    optim::ParamGroup s;
    s.name = g.name;
    s.weight_decay = g.weight_decay;
    s.lr_mult = g.lr_mult;
    for (const auto& name : g.names) {
      const auto it = piece_of.find(name);
      if (it == piece_of.end()) continue;  // no element of it in this rank's shard
      s.names.push_back(name);
      s.params.push_back(pieces_[it->second].param);
    }
    sharded.push_back(std::move(s));
  }
  return sharded;
}

ZeroEngine::~ZeroEngine() = default;

std::string ZeroEngine::describe() const {
  int64_t total = 0, mine = 0;
  for (const auto& info : buckets_->buckets()) total += info.numel;
  for (const auto& p : pieces_) mine += p.end - p.begin;
  return fmt::format(
      "ZeRO-{} over group '{}' of {} ranks: {} buckets; this rank updates {} of {} parameter "
      "elements ({} pieces){}",
      stage_, dp_->name(), dp_->size(), buckets_->buckets().size(), mine, total, pieces_.size(),
      shards_ ? fmt::format("; {} flat parameters over the model's units, sharded",
                            shards_->flats().size())
              : "");
}

void ZeroEngine::broadcast_buffers() {
  if (broadcast_buffers_) ddp::broadcast_buffers(*module_, *dp_);
}

void ZeroEngine::forward_backward_split(int micro_steps, const MicroStepFns& fns,
                                        bool sync_buffers) {
  bool first = true;
  if (shards_) shards_->begin_step();
  for (int i = 0; i < micro_steps; ++i) {
    // Stage 1 reduces once (the last micro-step; the others accumulate locally), stages 2 and 3
    // every micro-step (the shards accumulate).
    const bool sync = reduce_each_micro_ || i == micro_steps - 1;
    buckets_->set_require_sync(sync);
    if (sync_buffers) broadcast_buffers();
    fns.forward(i);
    buckets_->before_backward();
    fns.backward(i);
    buckets_->finalize_backward();
    if (shards_) shards_->end_backward();
    if (!sync) continue;
    if (reduce_each_micro_ && micro_steps > 1) {
      // The shard of each micro-step (its buckets were transient) is summed into the accumulator.
      at::NoGradGuard no_grad;
      for (std::size_t bi = 0; bi < grad_acc_.size(); ++bi) {
        at::Tensor& acc = shard_acc_.at(bi);
        if (!acc.defined()) acc = at::zeros_like(buckets_->bucket_shard(bi));
        if (first) {
          acc.copy_(buckets_->bucket_shard(bi));
        } else {
          acc.add_(buckets_->bucket_shard(bi));
        }
      }
    }
    first = false;
  }
  // Where the pieces' gradients live: the reduce-scatter shards, or the accumulators.
  const bool acc = reduce_each_micro_ && micro_steps > 1;
  if (acc != accumulating_pieces_) {
    for (auto& p : pieces_) {
      const at::Tensor& src = acc ? shard_acc_.at(p.bucket) : buckets_->bucket_shard(p.bucket);
      p.grad = src.narrow(0, p.shard_offset, p.end - p.begin);
    }
    accumulating_pieces_ = acc;
  }
  // A piece has a gradient unless no rank used its parameter (find_unused).
  for (auto& p : pieces_) {
    p.param.mutable_grad() =
        buckets_->used_anywhere(static_cast<std::size_t>(p.param_index)) ? p.grad : at::Tensor();
  }
}

std::vector<optim::GradGroup> ZeroEngine::grads() {
  // Every element of the gradient lives in exactly one dp rank's shard.
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (const auto& p : pieces_) {
    if (p.param.grad().defined()) named.emplace_back(p.name, p.param.grad());
  }
  return grad_groups(named, /*dp_sharded=*/true);
}

void ZeroEngine::update(double lr) {
  optimizer_->step(lr);
  if (shards_) return;  // stage 3: the shards were updated in place; the next forward gathers them
  // Every rank's updated shard into every rank's flat parameter buffers (in place).
  const int64_t r = dp_->rank();
  std::vector<comm::WorkPtr> works;
  for (auto& flat : flat_params_) {
    const int64_t shard = flat.numel() / dp_->size();
    at::Tensor mine = flat.narrow(0, r * shard, shard);
    works.push_back(dp_->all_gather_async(mine, flat));
  }
  const bool on_device = dp_->device_type() != c10::DeviceType::CPU;
  for (auto& w : works) {
    if (on_device) {
      w->wait_stream();
    } else {
      w->wait();
    }
  }
}

void ZeroEngine::zero_grad() {
  for (auto& p : params_) p.mutable_grad() = at::Tensor();
  for (auto& p : pieces_) p.param.mutable_grad() = at::Tensor();
}

std::vector<StatePiece> ZeroEngine::optimizer_state() {
  const auto& held = hold_optimizer_state();
  std::map<std::string, const Piece*> by_name;
  for (const auto& p : pieces_) by_name[p.name] = &p;
  const int me = dp_->world_ranks().at(static_cast<std::size_t>(dp_->rank()));
  std::vector<StatePiece> out;
  for (const auto& [key, t] : held) {
    if (key == "step") {  // the optimizer's step count: the same on every rank
      out.push_back(StatePiece{key, t, t.sizes().vec(),
                               std::vector<int64_t>(static_cast<std::size_t>(t.dim()), 0),
                               dp_->world_ranks()});
      continue;
    }
    const auto dot = key.rfind('.');
    const auto it = by_name.find(key.substr(0, dot));
    PARALLAX_CHECK(dot != std::string::npos && it != by_name.end(), Error,
                   "ZeRO: optimizer state '{}' belongs to no parameter piece of this rank", key);
    const Piece& p = *it->second;
    if (t.dim() == 0) {
      // A per-parameter scalar (Adam's step): identical on every rank holding a piece of it.
      out.push_back(StatePiece{key, t, {}, {}, p.holders});
      continue;
    }
    PARALLAX_CHECK(t.numel() == p.end - p.begin, Error,
                   "ZeRO: optimizer state '{}' has {} elements, its piece {}", key, t.numel(),
                   p.end - p.begin);
    // One flat piece, a view of the live state (view, not reshape: a load must write into it).
    out.push_back(StatePiece{key, t.detach().view({-1}), p.shape, {}, {me}, p.begin});
  }
  return out;
}

std::vector<StatePiece> ZeroEngine::model_state() {
  std::vector<StatePiece> out;
  if (!shards_ || !shards_->sharded()) return out;
  const int me = dp_->world_ranks().at(static_cast<std::size_t>(dp_->rank()));
  const auto& flats = shards_->flats();
  for (std::size_t fi = 0; fi < flats.size(); ++fi) {
    const auto& f = flats[fi];
    const int64_t lo = shards_->shard_begin(fi), hi = lo + f.shard.numel();
    for (std::size_t k = 0; k < f.params.size(); ++k) {
      const int64_t off = f.offsets[k], numel = f.views[k].numel();
      const int64_t b = std::max(off, lo), e = std::min(off + numel, hi);
      if (numel == 0 || b >= e) continue;
      out.push_back(StatePiece{f.names[k],
                               f.shard.narrow(0, b - lo, e - b),
                               f.views[k].sizes().vec(),
                               {},
                               {me},
                               b - off});
    }
  }
  for (const auto& item : module_->named_buffers()) {
    const at::Tensor& t = item.value();
    if (!t.defined()) continue;
    out.push_back(StatePiece{item.key(), t.detach(), t.sizes().vec(),
                             std::vector<int64_t>(static_cast<std::size_t>(t.dim()), 0),
                             dp_->world_ranks()});
  }
  return out;
}

void ZeroEngine::gather_full_params() {
  if (shards_) shards_->gather_all();
}

void ZeroEngine::commit_full_params() {
  if (shards_) shards_->commit_all();
}

void ZeroEngine::release_full_params() {
  if (!shards_) return;
  try {
    shards_->release_all();
  } catch (const std::exception& e) {
    core::log::warn("ZeRO-3: releasing the gathered parameters failed: {}", e.what());
  }
}

EngineMemory ZeroEngine::memory() {
  std::vector<at::Tensor> params, grads;
  if (shards_) {
    for (const auto& f : shards_->flats()) {
      params.push_back(f.shard);
      params.push_back(f.full);  // 0 bytes while freed
    }
  } else {
    for (const auto& p : module_->parameters()) params.push_back(p);
  }
  for (std::size_t bi = 0; bi < grad_acc_.size(); ++bi) {
    grads.push_back(buckets_->bucket_buffer(bi));  // undefined between steps in stage 2 (transient)
    grads.push_back(buckets_->bucket_shard(bi));
    grads.push_back(shard_acc_[bi]);  // stage 2 with accumulation only
  }
  return measure(params, grads);
}

}  // namespace parallax::parallel::zero
