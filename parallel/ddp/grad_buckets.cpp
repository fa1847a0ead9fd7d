#include "parallel/ddp/grad_buckets.h"

#include "core/enum_names.h"
#include "core/error.h"
#include "core/log.h"
#include "core/strings.h"
#include "core/timer.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace parallax::parallel::ddp {

namespace {
constexpr core::EnumName<BucketMode> kBucketModes[] = {
    {BucketMode::kAuto, "auto"},
    {BucketMode::kFlat, "flat"},
    {BucketMode::kGrouped, "grouped"},
};
}  // namespace

const char* to_string(BucketMode mode) {
  return core::enum_name(kBucketModes, mode);
}

BucketMode parse_bucket_mode(const std::string& name) {
  return core::parse_enum(kBucketModes, name, "parallel.ddp.bucket_mode", "mode");
}

namespace {
const char* reduce_dtype_name(const std::optional<at::ScalarType>& t) {
  if (!t) return "grad";
  return *t == at::kBFloat16 ? "bf16" : *t == at::kHalf ? "fp16" : c10::toString(*t);
}
}  // namespace

std::optional<at::ScalarType> parse_reduce_dtype(const std::string& name) {
  if (name == "grad") return std::nullopt;
  if (name == "bf16") return at::kBFloat16;
  if (name == "fp16") return at::kHalf;
  throw_error<ConfigError>("parallel.ddp.reduce_dtype: unknown dtype '{}' (use grad|bf16|fp16)",
                           name);
}

std::vector<std::vector<int64_t>> assign_buckets(const std::vector<int64_t>& sizes_bytes,
                                                 const std::vector<at::ScalarType>& dtypes,
                                                 int64_t first_cap_bytes, int64_t cap_bytes) {
  return assign_buckets(sizes_bytes, dtypes, std::vector<int>(sizes_bytes.size(), 0),
                        first_cap_bytes, cap_bytes);
}

std::vector<std::vector<int64_t>> assign_buckets(const std::vector<int64_t>& sizes_bytes,
                                                 const std::vector<at::ScalarType>& dtypes,
                                                 const std::vector<int>& keys,
                                                 int64_t first_cap_bytes, int64_t cap_bytes) {
  std::vector<std::vector<int64_t>> out;
  // One open bucket per (dtype, key); a bucket closes when it reaches its cap.
  std::map<std::pair<at::ScalarType, int>, std::pair<std::vector<int64_t>, int64_t>> open;
  auto cap_for_next = [&]() { return out.empty() ? first_cap_bytes : cap_bytes; };
  for (int64_t i = static_cast<int64_t>(sizes_bytes.size()) - 1; i >= 0; --i) {
    auto& [members, bytes] = open[{dtypes[i], keys[static_cast<std::size_t>(i)]}];
    members.push_back(i);
    bytes += sizes_bytes[i];
    if (bytes >= cap_for_next()) {
      out.push_back(std::move(members));
      members.clear();
      bytes = 0;
    }
  }
  for (auto& [dt, mb] : open) {
    if (!mb.first.empty()) out.push_back(std::move(mb.first));
  }
  return out;
}

GradBuckets::GradBuckets(std::shared_ptr<torch::nn::Module> module, comm::CommPtr dp_group,
                         DdpOptions options)
    : module_(std::move(module)), group_(std::move(dp_group)), options_(options) {
  PARALLAX_CHECK(module_ != nullptr, Error, "DDP: module is null");
  PARALLAX_CHECK(group_ != nullptr, Error, "DDP: data-parallel communicator is null");
  const bool scatter = options_.reduction == Reduction::kReduceScatter;
  resolve_options(scatter);
  build_buckets(scatter);
  install_hooks();
  int64_t total = 0;
  for (const auto& info : bucket_info_) total += info.bytes();
  core::log::info(
      "{}: {} parameters in {} {} buckets ({} total, caps {}/{} MiB, algorithm {}, reduced in {}), "
      "group '{}' of {} "
      "ranks",
      scatter ? "gradient buckets (reduce-scatter)" : "DDP", params_.size(), buckets_.size(),
      to_string(mode()), core::human_bytes(static_cast<double>(total)), options_.first_bucket_mb,
      options_.bucket_mb, comm::to_string(options_.algo),
      options_.reduce_dtype ? reduce_dtype_name(options_.reduce_dtype) : "the gradients' dtype",
      group_->name(), group_->size());
}

void GradBuckets::resolve_options(bool scatter) {
  PARALLAX_CHECK(!scatter || (options_.mode != BucketMode::kGrouped && !options_.reduce_dtype &&
                              options_.algo == comm::AllReduceAlgo::kNative),
                 ConfigError,
                 "gradient buckets: reduce-scatter needs flat buckets, the native algorithm and no "
                 "reduce_dtype");
  if (scatter) options_.mode = BucketMode::kFlat;
  PARALLAX_CHECK(!options_.transient || scatter, ConfigError,
                 "gradient buckets: transient buffers need the reduce-scatter reduction");
  if (options_.mode == BucketMode::kAuto) {
    // The CPU backends run a grouped all-reduce through a flat copy and back: flat costs less
    // there.
    const bool grouped_native = group_->device_type() != c10::DeviceType::CPU;
    const bool native = options_.algo == comm::AllReduceAlgo::kNative;
    options_.mode = grouped_native && native && !options_.reduce_dtype ? BucketMode::kGrouped
                                                                       : BucketMode::kFlat;
  }
  PARALLAX_CHECK(
      mode() == BucketMode::kFlat || options_.algo == comm::AllReduceAlgo::kNative, ConfigError,
      "DDP: parallel.ddp.bucket_mode=grouped needs parallel.allreduce=native (the ring reduces one "
      "flat buffer); use bucket_mode=flat");
  PARALLAX_CHECK(mode() == BucketMode::kFlat || !options_.reduce_dtype, ConfigError,
                 "DDP: parallel.ddp.reduce_dtype={} needs parallel.ddp.bucket_mode=flat (the "
                 "reduced copy is one "
                 "flat buffer per bucket; grouped buckets exist to avoid that copy)",
                 reduce_dtype_name(options_.reduce_dtype));
  PARALLAX_CHECK(!options_.reduce_dtype || *options_.reduce_dtype == at::kBFloat16 ||
                     *options_.reduce_dtype == at::kHalf,
                 ConfigError, "DDP: parallel.ddp.reduce_dtype must be bf16 or fp16, got {}",
                 reduce_dtype_name(options_.reduce_dtype));
}

void GradBuckets::build_buckets(bool scatter) {
  at::NoGradGuard no_grad;
  for (const auto& item : module_->named_parameters()) {
    if (!item.value().requires_grad()) continue;  // frozen (e.g. LoRA base): not reduced
    names_.push_back(item.key());
    params_.push_back(item.value());
  }
  std::vector<int64_t> sizes;
  std::vector<at::ScalarType> dtypes;
  std::vector<int> keys;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    sizes.push_back(params_[i].numel() * static_cast<int64_t>(params_[i].element_size()));
    dtypes.push_back(params_[i].scalar_type());
    keys.push_back(options_.bucket_key ? options_.bucket_key(names_[i]) : 0);
  }
  const auto to_bytes = [](double mb) { return static_cast<int64_t>(mb * 1024.0 * 1024.0); };
  const auto assignment = assign_buckets(sizes, dtypes, keys, to_bytes(options_.first_bucket_mb),
                                         to_bytes(options_.bucket_mb));
  const int64_t parts = scatter ? group_->size() : 1;

  param_bucket_.assign(params_.size(), -1);
  param_slot_.assign(params_.size(), -1);
  ready_.assign(params_.size(), 0);
  for (const auto& members : assignment) {
    Bucket b;
    BucketInfo info;
    int64_t numel = 0;
    for (int64_t i : members) {
      info.param_names.push_back(names_[i]);
      info.offsets.push_back(numel);
      numel += params_[i].numel();
    }
    info.numel = numel;
    info.padded_numel = (numel + parts - 1) / parts * parts;
    info.dtype = params_[members.front()].scalar_type();
    b.params = members;
    const bool flat = mode() == BucketMode::kFlat;
    if (flat) {
      // The padding (reduce-scatter) stays zero: no parameter's view covers it.
      const auto opts = params_[members.front()].options().requires_grad(false);
      if (!options_.transient) b.buffer = at::zeros({info.padded_numel}, opts);
      b.incoming.resize(members.size());
      // One rank: the reduce-scatter is the identity, so the shard is the bucket itself (no
      // collective, no copy; ZeRO at world 1 costs what DDP does).
      if (scatter) {
        b.shard = parts == 1 && !options_.transient ? b.buffer
                                                    : at::zeros({info.padded_numel / parts}, opts);
      }
    }
    for (std::size_t k = 0; k < members.size(); ++k) {
      const int64_t i = members[k];
      param_bucket_[i] = static_cast<int64_t>(buckets_.size());
      param_slot_[i] = static_cast<int64_t>(k);
      if (!flat || options_.transient) continue;
      at::Tensor view =
          b.buffer.narrow(0, info.offsets[k], params_[i].numel()).view(params_[i].sizes());
      // Keep an existing gradient's value; the gradient becomes the bucket view from now on.
      if (params_[i].grad().defined()) view.copy_(params_[i].grad());
      params_[i].mutable_grad() = view;
      b.views.push_back(view);
    }
    buckets_.push_back(std::move(b));
    bucket_info_.push_back(std::move(info));
  }
}

void GradBuckets::install_hooks() {
  // Post-accumulate hooks on the AccumulateGrad nodes (what PyTorch's reducer hooks).
  for (std::size_t i = 0; i < params_.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
    acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, i](const torch::autograd::variable_list& outputs,
                  const torch::autograd::variable_list&) {
          on_accumulated(i);
          return outputs;
        }));
    accumulators_.push_back(std::make_shared<decltype(acc)>(acc));
  }
}

void GradBuckets::on_accumulated(std::size_t i) {
  std::lock_guard<std::mutex> lock(mu_);
  const bool sync = in_backward_ && require_sync_;
  if (mode() == BucketMode::kGrouped) {
    // The gradient stays autograd's tensor; the bucket reduces it in place at launch.
    if (sync) mark_ready(static_cast<int64_t>(i));
    return;
  }
  Bucket& b = buckets_[param_bucket_[i]];
  if (options_.transient) {
    // Into the bucket's buffer (allocated by its first gradient), and the parameter's own
    // gradient is dropped: no rank keeps a full gradient past its bucket's reduce-scatter.
    PARALLAX_CHECK(sync, Error,
                   "gradient buckets: a backward without gradient sync on transient buckets "
                   "(ZeRO-2 reduces every micro-step)");
    at::Tensor& grad = params_[i].mutable_grad();
    if (grad.defined()) {
      at::NoGradGuard ng;
      if (!b.buffer.defined()) {
        b.buffer = at::zeros({bucket_info_[param_bucket_[i]].padded_numel}, grad.options());
      }
      b.buffer.narrow(0, bucket_info_[param_bucket_[i]].offsets[param_slot_[i]], grad.numel())
          .view_as(grad)
          .copy_(grad);
      grad = at::Tensor();
    }
    mark_ready(static_cast<int64_t>(i));
    return;
  }
  at::Tensor& view = b.views[param_slot_[i]];
  at::Tensor& grad = params_[i].mutable_grad();
  // AccumulateGrad stole or replaced the gradient (it was None). In a synced backward the
  // bucket copies it in at launch, with its other new gradients in one multi-tensor copy;
  // otherwise it is copied now. Either way the gradient becomes the view again, so later
  // accumulation happens in place.
  if (grad.defined() && !grad.is_alias_of(view)) {
    if (sync) {
      b.incoming[param_slot_[i]] = grad;
    } else {
      at::NoGradGuard ng;
      view.copy_(grad);
      grad = view;
    }
  } else if (!grad.defined()) {
    grad = view;
  }
  if (sync) mark_ready(static_cast<int64_t>(i));
}

GradBuckets::~GradBuckets() {
  // Wait for reductions still in flight so no buffer is freed under a collective; never throw.
  for (auto& b : buckets_) {
    if (b.work) {
      try {
        b.work->wait();
      } catch (const std::exception& e) {
        core::log::warn("DDP: reduction still in flight at destruction failed: {}", e.what());
      }
    }
  }
}

void GradBuckets::before_backward() {
  std::lock_guard<std::mutex> lock(mu_);
  in_backward_ = true;
  if (!require_sync_) return;
  std::fill(ready_.begin(), ready_.end(), 0);
  for (auto& b : buckets_) {
    b.pending = static_cast<int64_t>(b.params.size());
    b.work.reset();
    // Left over only if a previous backward failed before launching the bucket.
    for (auto& g : b.incoming) g = at::Tensor();
  }
  next_bucket_ = 0;
  if (!options_.timing) return;
  ensure_timers();
  collect_timers(/*block=*/false);
  backward_timer_->start();
}

void GradBuckets::ensure_timers() {
  if (backward_timer_) return;
  const c10::Device dev = params_.empty() ? c10::Device(c10::kCPU) : params_.front().device();
  backward_timer_ = std::make_unique<core::DeviceTimer>(dev);
  exposed_timer_ = std::make_unique<core::DeviceTimer>(dev);
}

void GradBuckets::collect_timers(bool block) {
  if (!timers_pending_ || !(block || exposed_timer_->ready())) return;
  backward_ms_ = backward_timer_->elapsed_ms();
  exposed_ms_ = exposed_timer_->elapsed_ms();
  timers_pending_ = false;
}

void GradBuckets::mark_ready(int64_t i) {
  if (ready_[i]) {
    throw_error<Error>(
        "DDP: parameter '{}' received its gradient twice in one backward (it is used by two "
        "autograd "
        "passes, e.g. shared between an activation-checkpointed block and the rest of the model); "
        "this is not supported",
        names_[i]);
  }
  ready_[i] = 1;
  Bucket& b = buckets_[param_bucket_[i]];
  if (--b.pending == 0) launch_ready_buckets();
}

void GradBuckets::launch_ready_buckets() {
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) {
    Bucket& b = buckets_[next_bucket_];
    std::vector<at::Tensor> tensors;
    if (mode() == BucketMode::kGrouped) {
      tensors.reserve(b.params.size());
      for (int64_t i : b.params) tensors.push_back(params_[i].grad());
    } else {
      std::vector<at::Tensor> dst, src;
      for (std::size_t k = 0; k < b.incoming.size(); ++k) {
        if (!b.incoming[k].defined()) continue;
        dst.push_back(b.views[k]);
        src.push_back(std::move(b.incoming[k]));
        b.incoming[k] = at::Tensor();
        params_[b.params[k]].mutable_grad() = b.views[k];
      }
      if (!dst.empty()) {
        at::NoGradGuard ng;
        at::_foreach_copy_(dst, src);
      }
      if (options_.transient && !b.buffer.defined()) {  // no gradient arrived (all unused)
        b.buffer = at::zeros({bucket_info_[next_bucket_].padded_numel}, b.shard.options());
      }
      tensors.push_back(b.buffer);
    }
    b.work = issue(b, tensors);
    // Transient: the collective keeps its input alive until it completes; nothing else does.
    if (options_.transient) b.buffer = at::Tensor();
    if (options_.on_launch) options_.on_launch(next_bucket_);
    ++next_bucket_;
  }
}

comm::WorkPtr GradBuckets::issue(Bucket& b, std::vector<at::Tensor>& tensors) {
  if (mode() == BucketMode::kGrouped)
    return group_->all_reduce_coalesced_async(tensors, comm::ReduceOp::kAvg);
  at::Tensor& flat = tensors.front();
  if (options_.reduction == Reduction::kReduceScatter) {
    if (b.shard.is_same(flat)) return nullptr;  // one rank: already reduced (see the constructor)
    return group_->reduce_scatter_async(flat, b.shard, comm::ReduceOp::kAvg);
  }
  if (compressed(flat.scalar_type())) {
    return group_->all_reduce_compressed_async(flat, comm::ReduceOp::kAvg, *options_.reduce_dtype,
                                               options_.algo);
  }
  return group_->all_reduce_async(flat, comm::ReduceOp::kAvg, options_.algo);
}

bool GradBuckets::compressed(at::ScalarType grad_dtype) const {
  return options_.reduce_dtype && c10::isFloatingType(grad_dtype) &&
         c10::elementSize(*options_.reduce_dtype) < c10::elementSize(grad_dtype);
}

void GradBuckets::finalize_backward() {
  std::lock_guard<std::mutex> lock(mu_);
  const bool was_in_backward = in_backward_;
  in_backward_ = false;
  if (!require_sync_) return;
  PARALLAX_CHECK(was_in_backward, Error, "DDP: finalize_backward() without before_backward()");
  std::vector<std::string> missing;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (!ready_[i]) missing.push_back(names_[i]);
  }
  // With find_unused, a parameter no rank used keeps no gradient (as in PyTorch, so optimizers skip
  // it); one used on some ranks only gets the average with zeros from the others. Knowing which is
  // which takes one small all-reduce of a usage bitmap, issued every step after the buckets.
  at::Tensor used_anywhere;
  if (options_.find_unused) {
    at::Tensor used = at::zeros({static_cast<int64_t>(params_.size())}, at::kFloat);
    for (std::size_t i = 0; i < params_.size(); ++i)
      used[static_cast<int64_t>(i)] = ready_[i] ? 1.0f : 0.0f;
    used_anywhere = used;
  }
  if (!missing.empty()) {
    if (!options_.find_unused) {
      const std::size_t shown = std::min<std::size_t>(missing.size(), 5);
      std::vector<std::string> head(missing.begin(), missing.begin() + static_cast<long>(shown));
      throw_error<Error>(
          "DDP (rank {} of group '{}'): {} parameter(s) got no gradient in this step: {}{}; if "
          "parts "
          "of the model are legitimately unused, set parallel.ddp.find_unused=true",
          group_->rank(), group_->name(), missing.size(), core::join(head, ", "),
          missing.size() > shown ? fmt::format(" and {} more", missing.size() - shown) : "");
    }
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (ready_[i]) continue;
      // An unused parameter contributes zero; its gradient may still hold a stale value.
      at::Tensor& grad = params_[i].mutable_grad();
      if (options_.transient) {
        // Its slot of the (zero-initialised) bucket buffer stays zero.
      } else if (mode() == BucketMode::kFlat) {
        buckets_[param_bucket_[i]].views[param_slot_[i]].zero_();
        grad = buckets_[param_bucket_[i]].views[param_slot_[i]];
      } else if (grad.defined()) {
        grad.zero_();
      } else {
        grad = at::zeros_like(params_[i]);
      }
      mark_ready(static_cast<int64_t>(i));
    }
  }
  if (options_.timing) {
    ensure_timers();
    backward_timer_->stop();
    exposed_timer_->start();
  }
  const bool on_device = group_->device_type() != c10::DeviceType::CPU;
  for (auto& b : buckets_) {
    if (!b.work) continue;
    if (on_device) {
      b.work->wait_stream();
    } else {
      b.work->wait();
    }
    b.work.reset();
  }
  if (used_anywhere.defined()) {
    at::Tensor bitmap = group_->device_type() == c10::kCPU
                            ? used_anywhere
                            : used_anywhere.to(params_.front().device());
    group_->all_reduce(bitmap, comm::ReduceOp::kMax);
    bitmap = bitmap.cpu();
    const float* u = bitmap.data_ptr<float>();
    used_anywhere_.assign(params_.size(), 1);
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (u[i] == 0.0f) {
        params_[i].mutable_grad() = at::Tensor();
        used_anywhere_[i] = 0;
      }
    }
  }
  if (!options_.timing) return;
  exposed_timer_->stop();
  timers_pending_ = true;
  // CPU timers are host clocks: read them now. GPU ones are read at a later step once complete.
  if (!exposed_timer_->on_device()) collect_timers(/*block=*/true);
}

std::vector<at::Tensor> GradBuckets::gradients() const {
  std::vector<at::Tensor> out;
  for (const auto& p : params_) out.push_back(p.grad());
  return out;
}

}  // namespace parallax::parallel::ddp
