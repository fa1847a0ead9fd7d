#include "parallel/zero/zero.h"

#include "core/error.h"
#include "core/log.h"
#include "core/strings.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <map>

namespace parallax::parallel::zero {

ZeroEngine::ZeroEngine(std::shared_ptr<torch::nn::Module> module,
                       std::vector<optim::ParamGroup> groups, const OptimizerFactory& make,
                       comm::CommPtr dp, ddp::DdpOptions options, int stage)
    : module_(std::move(module)), dp_(std::move(dp)), stage_(stage) {
  PARALLAX_CHECK(stage_ == 1 || stage_ == 2, ConfigError, "ZeRO: stage {} is not 1 or 2", stage_);
  // Buckets never mix optimizer groups (their weight decay differs).
  auto group_of = std::make_shared<std::map<std::string, int>>();
  for (std::size_t g = 0; g < groups.size(); ++g)
    for (const auto& n : groups[g].names) (*group_of)[n] = static_cast<int>(g);
  options.reduction = ddp::Reduction::kReduceScatter;
  options.transient = stage_ == 2;  // ZeRO-2 keeps no full gradient between reduce-scatters
  options.bucket_key = [group_of](const std::string& name) {
    const auto it = group_of->find(name);
    return it == group_of->end() ? -1 : it->second;
  };
  ddp_ = std::make_unique<ddp::DistributedDataParallel>(module_, dp_,
                                                        options);  // broadcasts from rank 0

  std::map<std::string, int64_t> index;
  for (const auto& item : module_->named_parameters()) {
    if (!item.value().requires_grad()) continue;
    index[item.key()] = static_cast<int64_t>(params_.size());
    params_.push_back(item.value());
  }
  const int64_t n = dp_->size(), r = dp_->rank();
  const int me = dp_->world_ranks().at(static_cast<std::size_t>(r));
  at::NoGradGuard no_grad;
  std::map<std::string, std::size_t> piece_of;
  for (std::size_t bi = 0; bi < ddp_->buckets().size(); ++bi) {
    const ddp::BucketInfo& info = ddp_->buckets()[bi];
    const at::Tensor& first =
        params_.at(static_cast<std::size_t>(index.at(info.param_names.front())));
    at::Tensor flat = at::zeros({info.padded_numel}, first.options().requires_grad(false));
    const int64_t shard = info.padded_numel / n, lo = r * shard, hi = lo + shard;
    // The reduce-scatter's shard is the gradient: stage 1 reduces once per step; stage 2 reduces
    // every micro-step and, with several, sums the shards into an accumulator (allocated then).
    at::Tensor acc = ddp_->bucket_shard(bi);
    for (std::size_t k = 0; k < info.param_names.size(); ++k) {
      const int64_t pi = index.at(info.param_names[k]);
      at::Tensor& p = params_[static_cast<std::size_t>(pi)];
      const int64_t off = info.offsets[k], numel = p.numel();
      at::Tensor view = flat.narrow(0, off, numel);
      view.copy_(p.detach().reshape({-1}));
      // The parameter becomes a view into the bucket's flat buffer (same autograd identity, so
      // the gradient hooks stay attached): the all-gather after each step updates it in place.
      p.set_data(view.view(p.sizes()));
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
    flat_params_.push_back(flat);
    grad_acc_.push_back(acc);
    shard_acc_.emplace_back();
  }
  (void)me;
  // The optimizer over this rank's pieces, group by group (same names, same weight decay).
  std::vector<optim::ParamGroup> sharded;
  for (const auto& g : groups) {
    optim::ParamGroup s;
    s.name = g.name;
    s.weight_decay = g.weight_decay;
    for (const auto& name : g.names) {
      const auto it = piece_of.find(name);
      if (it == piece_of.end()) continue;  // no element of it in this rank's shard
      s.names.push_back(name);
      s.params.push_back(pieces_[it->second].param);
    }
    sharded.push_back(std::move(s));
  }
  optimizer_ = make(std::move(sharded));
  core::log::info("{}", describe());
}

ZeroEngine::~ZeroEngine() = default;

std::string ZeroEngine::describe() const {
  int64_t total = 0, mine = 0;
  for (const auto& info : ddp_->buckets()) total += info.numel;
  for (const auto& p : pieces_) mine += p.end - p.begin;
  return fmt::format(
      "ZeRO-{} over group '{}' of {} ranks: {} buckets; this rank updates {} of {} parameter "
      "elements ({} pieces)",
      stage_, dp_->name(), dp_->size(), ddp_->buckets().size(), mine, total, pieces_.size());
}

void ZeroEngine::forward_backward(int micro_steps, const std::function<at::Tensor(int)>& micro,
                                  bool sync_buffers) {
  bool first = true;
  for (int i = 0; i < micro_steps; ++i) {
    // Stage 1 reduces once (the last micro-step; the others accumulate locally), stage 2 every
    // micro-step (the shards accumulate).
    const bool sync = stage_ == 2 || i == micro_steps - 1;
    ddp_->set_require_sync(sync);
    if (sync_buffers) ddp_->before_forward();
    at::Tensor loss = micro(i);
    ddp_->before_backward();
    loss.backward();
    ddp_->finalize_backward();
    if (!sync) continue;
    if (stage_ == 2 && micro_steps > 1) {
      // The shard of each micro-step (its buckets were transient) is summed into the accumulator.
      at::NoGradGuard no_grad;
      for (std::size_t bi = 0; bi < grad_acc_.size(); ++bi) {
        at::Tensor& acc = shard_acc_.at(bi);
        if (!acc.defined()) acc = at::zeros_like(ddp_->bucket_shard(bi));
        if (first) {
          acc.copy_(ddp_->bucket_shard(bi));
        } else {
          acc.add_(ddp_->bucket_shard(bi));
        }
      }
    }
    first = false;
  }
  // Where the pieces' gradients live: the reduce-scatter shards, or the accumulators.
  const bool acc = stage_ == 2 && micro_steps > 1;
  if (acc != accumulating_pieces_) {
    for (auto& p : pieces_) {
      const at::Tensor& src = acc ? shard_acc_.at(p.bucket) : ddp_->bucket_shard(p.bucket);
      p.grad = src.narrow(0, p.shard_offset, p.end - p.begin);
    }
    accumulating_pieces_ = acc;
  }
  // A piece has a gradient unless no rank used its parameter (find_unused).
  for (auto& p : pieces_) {
    p.param.mutable_grad() = ddp_->used_anywhere(static_cast<std::size_t>(p.param_index)) ? p.grad : at::Tensor();
  }
}

std::vector<optim::GradGroup> ZeroEngine::grads() {
  optim::GradGroup g;
  for (const auto& p : pieces_) {
    if (p.param.grad().defined()) g.grads.push_back(p.param.grad());
  }
  // Every element of the gradient lives in exactly one rank's shard.
  g.sharded_over.push_back(dp_.get());
  return {std::move(g)};
}

void ZeroEngine::step(double lr) {
  optimizer_->step(lr);
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
  held_ = optimizer_->state();
  std::map<std::string, const Piece*> by_name;
  for (const auto& p : pieces_) by_name[p.name] = &p;
  const int me = dp_->world_ranks().at(static_cast<std::size_t>(dp_->rank()));
  std::vector<StatePiece> out;
  for (auto& [key, t] : held_) {
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
    PARALLAX_CHECK(t.numel() == p.end - p.begin, Error, "ZeRO: optimizer state '{}' has {} elements, its piece {}",
                   key, t.numel(), p.end - p.begin);
    // One flat piece, a view of the live state (view, not reshape: a load must write into it).
    out.push_back(StatePiece{key, t.detach().view({-1}), p.shape, {}, {me}, p.begin});
  }
  return out;
}

void ZeroEngine::optimizer_state_loaded() {
  std::map<std::string, at::Tensor> live(held_.begin(), held_.end());
  optimizer_->load_state(live);
  held_.clear();
}

EngineMemory ZeroEngine::memory() {
  EngineMemory m;
  std::vector<at::Tensor> params, grads, state;
  for (const auto& p : module_->parameters()) params.push_back(p);
  for (std::size_t bi = 0; bi < grad_acc_.size(); ++bi) {
    grads.push_back(ddp_->bucket_buffer(bi));  // undefined between steps in stage 2 (transient)
    grads.push_back(ddp_->bucket_shard(bi));
    grads.push_back(shard_acc_[bi]);  // stage 2 with accumulation only
  }
  for (const auto& [key, t] : optimizer_->state())
    if (key != "step" && t.dim() > 0) state.push_back(t);
  m.params = storage_bytes(params);
  m.grads = storage_bytes(grads);
  m.optimizer = storage_bytes(state);
  return m;
}

}  // namespace parallax::parallel::zero
