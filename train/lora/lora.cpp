#include "train/lora/lora.h"

#include "checkpoint/finite.h"
#include "checkpoint/save_state.h"
#include "checkpoint/weights.h"
#include "core/error.h"
#include "core/glob.h"
#include "core/log.h"
#include "core/strings.h"
#include "models/layers.h"
#include "train/run_config.h"
#include "train/trainer_hooks.h"
#include "units/param_init.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <zlib.h>

namespace parallax::train::lora {

namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// What a LoRA run keeps between its hooks: the base's fingerprint, taken before the adapters.
struct State {
  const RunConfig* cfg = nullptr;
  std::string base, fingerprint;
  bool size_logged = false;
};

}  // namespace

bool is_adapter(const std::string& name) {
  return ends_with(name, ".lora_a") || ends_with(name, ".lora_b") || name == "lora_a" ||
         name == "lora_b";
}

std::string fingerprint(
    const torch::nn::Module& m,
    const std::function<at::Tensor(const std::string& name, const at::Tensor& t)>& value) {
  uLong crc = ::crc32(0L, Z_NULL, 0);
  auto add = [&](const std::string& name, const at::Tensor& held) {
    const at::Tensor t = value ? value(name, held) : held;
    const std::string head =
        fmt::format("{}|{}|{}|", name, c10::toString(t.scalar_type()), fmt::join(t.sizes(), ","));
    crc = ::crc32(crc, reinterpret_cast<const Bytef*>(head.data()), static_cast<uInt>(head.size()));
    const at::Tensor c = t.detach().to(at::kCPU).contiguous();
    const auto* p = static_cast<const Bytef*>(c.data_ptr());
    std::size_t left = c.nbytes();
    while (left > 0) {  // zlib takes uInt lengths
      const std::size_t n = std::min<std::size_t>(left, 1u << 30);
      crc = ::crc32(crc, p, static_cast<uInt>(n));
      p += n;
      left -= n;
    }
  };
  for (const auto& it : m.named_parameters())
    if (!is_adapter(it.key())) add(it.key(), it.value());
  for (const auto& it : m.named_buffers()) add(it.key(), it.value());
  return fmt::format("{:08x}", static_cast<uint32_t>(crc));
}

Applied apply(models::Model& model, const LoraConfig& cfg) {
  PARALLAX_CHECK(cfg.rank > 0, ConfigError, "key 'lora.rank': {} (LoRA needs a positive rank)",
                 cfg.rank);
  PARALLAX_CHECK(!cfg.targets.empty(), ConfigError,
                 "key 'lora.targets': empty (name the linear layers to adapt, e.g. '*.qkv')");
  Applied a;
  std::vector<std::string> linears;
  std::vector<std::pair<std::string, models::DenseLinearImpl*>> matched;
  std::vector<int> hits(cfg.targets.size(), 0);
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    const std::string& path = item.key();
    auto* dense = dynamic_cast<models::DenseLinearImpl*>(item.value().get());
    if (dense) linears.push_back(path);
    bool match = false;
    for (std::size_t g = 0; g < cfg.targets.size(); ++g) {
      if (!core::glob_match(cfg.targets[g], path)) continue;
      ++hits[g];
      match = true;
    }
    if (!match) continue;
    PARALLAX_CHECK(dense != nullptr, ConfigError,
                   "key 'lora.targets': module '{}' matches but is not a linear layer (LoRA adapts "
                   "the models' linear layers only)",
                   path);
    matched.emplace_back(path, dense);
  }
  for (std::size_t g = 0; g < cfg.targets.size(); ++g) {
    if (hits[g] > 0) continue;
    std::vector<std::string> some(linears.begin(),
                                  linears.begin() + std::min<std::ptrdiff_t>(6, linears.size()));
    throw_error<ConfigError>(
        "key 'lora.targets': '{}' matches no linear layer of model '{}'{}", cfg.targets[g],
        model.name(),
        linears.empty() ? " (it has none)"
                        : fmt::format(" (its linear layers are e.g. {}{})", core::join(some, ", "),
                                      linears.size() > some.size() ? ", ..." : ""));
  }
  // The update B A (A [r, in], B [out, r]) has rank at most min(in, out): a larger r only adds
  // parameters (and r = 10^9 allocates without bound), so it is refused before any adapter
  // exists, naming the smallest targeted layer.
  const std::pair<std::string, models::DenseLinearImpl*>* smallest = nullptr;
  int64_t smallest_dim = 0;
  for (const auto& m : matched) {
    const at::Tensor& w = m.second->weight;  // [out, in]
    const int64_t dim = std::min(w.size(0), w.size(1));
    if (smallest == nullptr || dim < smallest_dim) {
      smallest = &m;
      smallest_dim = dim;
    }
  }
  if (smallest != nullptr) {
    const at::Tensor& w = smallest->second->weight;
    PARALLAX_CHECK(cfg.rank <= smallest_dim, ConfigError,
                   "key 'lora.rank': {} is more than {}, min(in, out) of the smallest layer that "
                   "lora.targets adapts, '{}' ({} -> {} features); an adapter's rank is at most "
                   "that",
                   cfg.rank, smallest_dim, smallest->first, w.size(1), w.size(0));
  }
  for (const auto& m : matched) {
    m.second->add_lora(cfg.rank, cfg.alpha, cfg.dropout);
    ++a.layers;
    a.adapter_params += m.second->lora_a.numel() + m.second->lora_b.numel();
  }
  std::vector<int> trainable_hits(cfg.trainable.size(), 0);
  for (auto& it : model.named_parameters()) {
    bool train = is_adapter(it.key());
    for (std::size_t g = 0; g < cfg.trainable.size(); ++g) {
      if (!core::glob_match(cfg.trainable[g], it.key())) continue;
      ++trainable_hits[g];
      train = true;
    }
    it.value().set_requires_grad(train);
    a.total += it.value().numel();
    if (train) a.trainable += it.value().numel();
  }
  for (std::size_t g = 0; g < cfg.trainable.size(); ++g) {
    PARALLAX_CHECK(trainable_hits[g] > 0, ConfigError,
                   "key 'lora.trainable': '{}' matches no parameter", cfg.trainable[g]);
  }
  return a;
}

std::string base_path(const RunConfig& cfg) {
  const std::string path =
      lora::config(cfg).base.empty() ? cfg.train.load_from : lora::config(cfg).base;
  PARALLAX_CHECK(!path.empty(), ConfigError,
                 "key 'lora.base': a LoRA run adapts a trained base; set lora.base (or "
                 "train.load_from) to its checkpoint, run directory or weights.h5");
  return path;
}

TrainerHooks hooks(const RunConfig& cfg) {
  auto state = std::make_shared<State>();
  state->cfg = &cfg;
  TrainerHooks h;
  h.transform_defers = true;
  // The base is checked for non-finite values as the LoRA base (below), not as train.load_from.
  h.checks_loaded_weights = true;
  h.transform_model = [state](models::Model& m) {
    const RunConfig& c = *state->cfg;
    state->base = base_path(c);
    // A model built without storage (parallel.meta_init under ZeRO-3): its tensors are recipes,
    // and the adapters apply() adds are recorded as recipes too.
    units::DeferredInit* deferred = units::deferred_init();
    // train.load_from is loaded by the trainer (resume included, as the checkpoints hold only
    // the adapters); lora.base, when set, goes on top of it.
    if (!lora::config(c).base.empty()) {
      if (deferred) {
        checkpoint::DeferredWeights dw = checkpoint::defer_weights(m, state->base);
        core::log::info("lora.base={}: {} (each rank reads what it owns)", state->base,
                        dw.report.summary());
        for (auto& [name, read] : dw.readers) deferred->replace(name, read);
      } else {
        const auto report = checkpoint::load_weights(m, state->base);
        core::log::info("lora.base={}: {}", state->base, report.summary());
      }
    }
    // A NaN in the base would only show as a NaN loss at step 1: named here, at load time.
    const char* key = lora::config(c).base.empty() ? "train.load_from" : "lora.base";
    const std::string source = fmt::format("LoRA base '{}' ({})", state->base, key);
    const std::string advice =
        fmt::format("a LoRA run adapts a finite base; point {} at an earlier checkpoint", key);
    if (deferred) {
      // The base read one tensor at a time (as the full build holds it: the placeholder's dtype),
      // checked and hashed, and dropped: the engine reads its shard again.
      state->fingerprint = fingerprint(m, [&](const std::string& name, const at::Tensor& t) {
        at::Tensor v = deferred->value(name).to(t.scalar_type());
        checkpoint::require_finite({{name, v}}, source, advice);
        return v;
      });
    } else {
      checkpoint::require_finite(m, source, advice);
      state->fingerprint = fingerprint(m);
    }
    const Applied a = apply(m, lora::config(c));
    core::log::info(
        "LoRA: rank {} (alpha {}, dropout {}) on {} linear layers: {:.3f} M adapter parameters; "
        "{:.3f} M of {:.3f} M parameters trainable ({:.2f}%); base fingerprint {}",
        lora::config(c).rank, lora::config(c).alpha, lora::config(c).dropout, a.layers,
        a.adapter_params / 1e6, a.trainable / 1e6, a.total / 1e6,
        100.0 * a.trainable / std::max<int64_t>(1, a.total), state->fingerprint);
  };
  // Checkpoints hold what trains: the adapters (and `lora.trainable`), not the frozen base.
  h.saves_model_tensor = [state](const std::string& name) {
    if (is_adapter(name)) return true;
    for (const auto& g : lora::config(*state->cfg).trainable)
      if (core::glob_match(g, name)) return true;
    return false;
  };
  h.save_extra = [state](checkpoint::SaveState& s) {
    s.set_extra("lora.base", state->base);
    s.set_extra("lora.base_fingerprint", state->fingerprint);
    s.set_extra("lora.rank", lora::config(*state->cfg).rank);
    s.set_extra("lora.alpha", lora::config(*state->cfg).alpha);
  };
  h.load_extra = [state](checkpoint::CheckpointReader& r) {
    const auto& m = r.metadata();
    PARALLAX_CHECK(m.has_extra("lora.base_fingerprint"), CheckpointError,
                   "checkpoint '{}' holds no LoRA adapters (saved without lora.rank); start a "
                   "LoRA run from its weights with lora.base={} instead of resuming it",
                   r.dir(), r.dir());
    const std::string saved = m.extra_string("lora.base_fingerprint");
    PARALLAX_CHECK(saved == state->fingerprint, CheckpointError,
                   "checkpoint '{}': its LoRA adapters were trained on base '{}' (fingerprint {}), "
                   "but this run's base '{}' has fingerprint {}; set lora.base to the base they "
                   "were trained on",
                   r.dir(), m.extra_string("lora.base"), saved, state->base, state->fingerprint);
  };
  return h;
}

std::shared_ptr<models::Model> merged_model(const RunConfig& cfg, const core::SceneSpec& scene,
                                            checkpoint::CheckpointReader& reader) {
  auto model = models::build_model(cfg.model, scene);
  const std::string base = base_path(cfg);
  checkpoint::load_weights(*model, base);
  checkpoint::require_finite(*model, fmt::format("LoRA base '{}'", base),
                             "the adapters cannot be merged into non-finite weights");
  const std::string fp = fingerprint(*model);
  const auto& meta = reader.metadata();
  PARALLAX_CHECK(meta.has_extra("lora.base_fingerprint"), CheckpointError,
                 "checkpoint '{}' of a LoRA run holds no adapter metadata", reader.dir());
  const std::string saved = meta.extra_string("lora.base_fingerprint");
  PARALLAX_CHECK(saved == fp, CheckpointError,
                 "checkpoint '{}': its LoRA adapters were trained on base '{}' (fingerprint {}), "
                 "but the base '{}' of the run's config has fingerprint {}",
                 reader.dir(), meta.extra_string("lora.base"), saved, base, fp);
  apply(*model, lora::config(cfg));
  // The adapters (and the `trainable` tensors) from the checkpoint, whole.
  std::vector<checkpoint::LoadTarget> targets;
  for (auto& it : model->named_parameters()) {
    if (!it.value().requires_grad()) continue;
    targets.push_back({checkpoint::kModelPrefix + it.key(), it.value().detach(), {}});
  }
  reader.load(targets);
  for (const auto& item : model->named_modules("", false)) {
    if (auto* dense = dynamic_cast<models::DenseLinearImpl*>(item.value().get())) {
      if (dense->has_lora()) dense->merge_lora();
    }
  }
  for (auto& p : model->parameters()) p.set_requires_grad(false);
  model->eval();
  return model;
}

}  // namespace parallax::train::lora
