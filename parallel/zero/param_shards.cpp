#include "parallel/zero/param_shards.h"

#include "core/error.h"
#include "core/log.h"

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <fmt/format.h>

namespace parallax::parallel::zero {

namespace {

// Gives `t`'s storage `nbytes` of fresh memory from its own allocator (0: releases it). The
// storage object stays the same, so every view of it (the parameters, the tensors autograd saved)
// sees the new memory. On GPUs the caching allocator hands out memory in the current stream's
// order; a collective that writes it records its own stream (the communicator does).
void set_storage_bytes(const at::Tensor& t, int64_t nbytes) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  if (nbytes == 0) {
    s->set_data_ptr_noswap(c10::DataPtr(nullptr, t.device()));
    s->set_nbytes(0);
    return;
  }
  s->set_data_ptr_noswap(s->allocator()->allocate(static_cast<std::size_t>(nbytes)));
  s->set_nbytes(static_cast<std::size_t>(nbytes));
}

bool on_device(const comm::Communicator& c) {
  return c.device_type() != c10::DeviceType::CPU;
}

std::string ordinal(int k) {
  return k == 1 ? "1st" : k == 2 ? "2nd" : k == 3 ? "3rd" : fmt::format("{}th", k);
}

}  // namespace

ParamShards::ParamShards(comm::CommPtr dp, std::vector<units::Unit> units, bool prefetch,
                         bool always_gather)
    : dp_(std::move(dp)),
      units_(std::move(units)),
      prefetch_(prefetch),
      n_(dp_->size()),
      active_(n_ > 1 || always_gather) {
  const std::size_t u = units_.size();
  unit_flats_.resize(u);
  trainable_.assign(u, 0);
  launched_.assign(u, 0);
  passed_.assign(u, 0);
  gathers_.assign(u, 0);
  // The gathers' own communicator (own NCCL stream on GPUs, own ordering on every backend).
  if (n_ > 1) {
    gather_ = dp_->split(0, dp_->rank(), dp_->name() + ".zero3_gather");
  } else {
    gather_ = dp_;
  }
}

ParamShards::~ParamShards() {
  // Nothing may be freed under a gather in flight; never throw.
  for (auto& f : flats_) {
    if (!f.work) continue;
    try {
      f.work->wait();
    } catch (const std::exception& e) {
      core::log::warn("ZeRO-3: a parameter gather in flight at destruction failed: {}", e.what());
    }
  }
}

void ParamShards::add(int unit, int bucket, std::vector<std::string> names,
                      std::vector<at::Tensor> params, std::vector<int64_t> offsets,
                      at::Tensor full) {
  PARALLAX_CHECK(unit >= 0 && static_cast<std::size_t>(unit) < units_.size(), Error,
                 "ZeRO-3: unit {} out of range", unit);
  PARALLAX_CHECK(full.numel() % n_ == 0, Error,
                 "ZeRO-3: flat parameter of {} elements not padded to {}", full.numel(), n_);
  Flat f;
  f.unit = unit;
  f.bucket = bucket;
  f.names = std::move(names);
  f.params = std::move(params);
  f.offsets = std::move(offsets);
  f.full = std::move(full);
  f.full_bytes = static_cast<int64_t>(f.full.numel() * f.full.element_size());
  const int64_t s = f.full.numel() / n_;
  at::NoGradGuard no_grad;
  // N = 1: the shard is the full buffer itself (nothing is ever freed).
  f.shard = active_ ? f.full.narrow(0, dp_->rank() * s, s).clone() : f.full;
  f.placeholder = at::empty({0}, f.full.options());
  for (std::size_t k = 0; k < f.params.size(); ++k) {
    f.views.push_back(
        f.full.narrow(0, f.offsets[k], f.params[k].numel()).view(f.params[k].sizes()));
  }
  const std::size_t index = flats_.size();
  unit_flats_[static_cast<std::size_t>(unit)].push_back(index);
  if (bucket >= 0) {
    ++trainable_[static_cast<std::size_t>(unit)];
    if (flat_of_bucket_.size() <= static_cast<std::size_t>(bucket))
      flat_of_bucket_.resize(static_cast<std::size_t>(bucket) + 1, -1);
    flat_of_bucket_[static_cast<std::size_t>(bucket)] = static_cast<long>(index);
  }
  flats_.push_back(std::move(f));
  // Freed at once: setup holds at most one flat parameter beside the shards (with deferred
  // initialisation, the only whole unit a rank ever holds before its first forward).
  free_flat(flats_.back());
}

int64_t ParamShards::shard_begin(std::size_t f) const {
  return active_ ? dp_->rank() * (flats_.at(f).full.numel() / n_) : 0;
}

void ParamShards::finish_setup() {
  if (!active_) return;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& f : flats_) free_flat(f);
}

void ParamShards::free_flat(Flat& f) {
  if (!active_ || summoned_) return;
  if (f.work) {  // a prefetch that was never used: let it land first
    if (on_device(*gather_)) {
      f.work->wait_stream();
    } else {
      f.work->wait();
    }
    f.work.reset();
    f.gathered = true;
  }
  if (!f.gathered) return;
  for (auto& p : f.params) p.set_data(f.placeholder);
  set_storage_bytes(f.full, 0);
  f.gathered = false;
}

void ParamShards::issue(int unit) {
  const auto& list = unit_flats_.at(static_cast<std::size_t>(unit));
  bool any = false;
  // A flat parameter done in this backward is not gathered again.
  for (std::size_t i : list)
    any = any || (!flats_[i].gathered && !flats_[i].work && !flats_[i].done);
  if (!any) return;
  // Agreement first: which unit this rank gathers, and how many times it has this step.
  const int k = ++gathers_[static_cast<std::size_t>(unit)];
  const at::Tensor& like = flats_[list.front()].shard;
  at::Tensor tag = at::empty({2}, like.options().dtype(at::kInt));
  tag.fill_(unit);
  tag.narrow(0, 1, 1).fill_(k);
  at::Tensor tags = at::empty({2 * n_}, tag.options());
  if (on_device(*gather_)) {
    // Checked at the end of the backward (reading it now would stall the host on the stream).
    // The compute stream joins the tag's collective only then: joining it here made every unit's
    // compute wait for all ranks to reach this gather, a cross-rank barrier per unit (~28 per ViT
    // step) on the critical path.
    tag_works_.push_back(gather_->all_gather_async(tag, tags));
    tags_.push_back(tags);
  } else {
    gather_->all_gather(tag, tags);
    check_tags(tags);
  }
  for (std::size_t i : list) {
    Flat& f = flats_[i];
    if (f.gathered || f.work || f.done) continue;
    set_storage_bytes(f.full, f.full_bytes);
    for (std::size_t p = 0; p < f.params.size(); ++p) f.params[p].set_data(f.views[p]);
    f.work = gather_->all_gather_async(f.shard, f.full);
  }
}

void ParamShards::wait(int unit) {
  for (std::size_t i : unit_flats_.at(static_cast<std::size_t>(unit))) {
    Flat& f = flats_[i];
    if (!f.work) continue;
    if (on_device(*gather_)) {
      f.work->wait_stream();
    } else {
      f.work->wait();
    }
    f.work.reset();
    f.gathered = true;
  }
}

void ParamShards::check_deferred_tags() {
  if (tags_.empty()) return;
  std::vector<at::Tensor> tags;
  tags.swap(tags_);
  std::vector<comm::WorkPtr> works;
  works.swap(tag_works_);
  // The tags' collectives ran on the gather stream, long before this point in the backward.
  for (auto& w : works) w->wait_stream();
  check_tags(at::cat(tags));
}

void ParamShards::check_tags(const at::Tensor& tags) {
  const at::Tensor t = tags.cpu().contiguous().view({-1, n_, 2});
  const int* v = t.data_ptr<int>();
  for (int64_t g = 0; g < t.size(0); ++g) {
    const int* row = v + g * 2 * n_;
    bool same = true;
    for (int r = 1; r < n_; ++r) same = same && row[2 * r] == row[0] && row[2 * r + 1] == row[1];
    if (same) continue;
    std::vector<std::string> who;
    for (int r = 0; r < n_; ++r) {
      const int u = row[2 * r];
      const std::string name = u >= 0 && static_cast<std::size_t>(u) < units_.size()
                                   ? units_[static_cast<std::size_t>(u)].name
                                   : fmt::format("#{}", u);
      who.push_back(fmt::format("rank {} gathers unit '{}' for the {} time",
                                dp_->world_ranks().at(static_cast<std::size_t>(r)), name,
                                ordinal(row[2 * r + 1])));
    }
    throw_error<Error>(
        "ZeRO-3 (group '{}'): the ranks disagree on which unit runs next: "
        "{}. A unit ran a different number of times, or in a different order, on different ranks "
        "(a data-dependent branch in the forward?); under parallel.zero.stage=3 every rank must "
        "run the same units in the same order",
        dp_->name(), fmt::join(who, "; "));
  }
}

void ParamShards::before_unit(int index) {
  if (!active_) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (summoned_) return;
  gather(index);
  if (prefetch_ && static_cast<std::size_t>(index) + 1 < units_.size()) issue(index + 1);
}

void ParamShards::after_unit(int index, const std::vector<at::Tensor>& outputs) {
  if (!active_) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (summoned_) return;
  bool hooked = false;
  if (at::GradMode::is_enabled()) {
    for (const auto& o : outputs) {
      if (!o.defined() || !o.requires_grad()) continue;
      o.register_hook([this, index](const at::Tensor&) { pre_backward(index); });
      hooked = true;
    }
  }
  // The last unit's backward comes first: it stays gathered (loss() reads no parameter).
  if (hooked && static_cast<std::size_t>(index) + 1 == units_.size()) return;
  for (std::size_t i : unit_flats_.at(static_cast<std::size_t>(index))) free_flat(flats_[i]);
}

void ParamShards::pre_backward(int unit) {
  std::lock_guard<std::mutex> lock(mu_);
  if (summoned_) return;
  // Every unit after this one has produced its input gradient.
  for (std::size_t j = static_cast<std::size_t>(unit) + 1; j < units_.size(); ++j) {
    if (passed_[j]) continue;
    passed_[j] = 1;
    free_frozen_if_done(static_cast<int>(j));
  }
  // A flat already done in this backward (a second output's hook firing late) is not gathered
  // again.
  bool needed = false;
  for (std::size_t i : unit_flats_.at(static_cast<std::size_t>(unit)))
    needed = needed || (!flats_[i].done && !flats_[i].gathered);
  if (needed) gather(unit);
  if (prefetch_ && unit > 0) issue(unit - 1);
}

void ParamShards::bucket_launched(std::size_t bucket) {
  if (!active_) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (bucket >= flat_of_bucket_.size() || flat_of_bucket_[bucket] < 0) return;
  Flat& f = flats_[static_cast<std::size_t>(flat_of_bucket_[bucket])];
  f.done = true;
  free_flat(f);
  ++launched_[static_cast<std::size_t>(f.unit)];
  free_frozen_if_done(f.unit);
}

void ParamShards::free_frozen_if_done(int unit) {
  const auto u = static_cast<std::size_t>(unit);
  if (!passed_[u] || launched_[u] < trainable_[u]) return;
  for (std::size_t i : unit_flats_[u]) {
    if (flats_[i].bucket >= 0) continue;
    flats_[i].done = true;
    free_flat(flats_[i]);
  }
}

void ParamShards::begin_step() {
  std::lock_guard<std::mutex> lock(mu_);
  std::fill(gathers_.begin(), gathers_.end(), 0);
}

void ParamShards::end_backward() {
  if (!active_) return;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& f : flats_) {
    free_flat(f);
    f.done = false;
  }
  std::fill(launched_.begin(), launched_.end(), 0);
  std::fill(passed_.begin(), passed_.end(), 0);
  check_deferred_tags();
}

void ParamShards::gather_all() {
  if (!active_) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (summoned_) return;
  for (std::size_t u = 0; u < units_.size(); ++u) issue(static_cast<int>(u));
  for (std::size_t u = 0; u < units_.size(); ++u) wait(static_cast<int>(u));
  summoned_ = true;
  // A summon is a host synchronisation point anyway: its tags (GPUs) are checked now.
  check_deferred_tags();
}

void ParamShards::release_all() {
  if (!active_) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (!summoned_) return;
  summoned_ = false;
  for (auto& f : flats_) free_flat(f);
}

void ParamShards::commit_all() {
  if (!active_) return;
  std::lock_guard<std::mutex> lock(mu_);
  PARALLAX_CHECK(summoned_, Error,
                 "ZeRO-3: commit_all() outside gather_all() .. release_all(): nothing is gathered");
  for (std::size_t i = 0; i < flats_.size(); ++i) {
    Flat& f = flats_[i];
    const at::Tensor part = f.full.narrow(0, shard_begin(i), f.shard.numel());
    if (!part.is_same(f.shard)) f.shard.copy_(part);
  }
}

int64_t ParamShards::held_bytes() const {
  int64_t bytes = 0;
  for (const auto& f : flats_) {
    if (active_) bytes += static_cast<int64_t>(f.shard.numel() * f.shard.element_size());
    bytes += static_cast<int64_t>(f.full.storage().nbytes());
  }
  return bytes;
}

}  // namespace parallax::parallel::zero
