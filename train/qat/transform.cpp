// The QAT model transform (qat.h): which layers are quantizable, the qat.skip globs, adding the
// fake quantizers (apply()), listing them again (layers()) and switching their state
// (set_state()). Everything else in the folder works on the Layer list this file makes.
#include "train/qat/qat.h"

#include "core/error.h"
#include "core/glob.h"
#include "core/strings.h"
#include "models/layers.h"
#include "models/resnet.h"
#include "models/vit.h"

#include <fmt/format.h>

#include <algorithm>

namespace parallax::train::qat {

namespace {

using models::QuantState;

// The quantizable layer at `module`, if it is one: its quantizers (empty before apply()). An
// attention (its four inputs: layers() lists them) only when `attention`.
bool quantizable(torch::nn::Module* module, Layer* out, bool attention) {
  if (auto* a = dynamic_cast<models::AttentionImpl*>(module)) {
    out->kind = Layer::Kind::kAttention;
    out->input = a->quantized() ? a->q_quantizer.ptr() : nullptr;
    out->weight = nullptr;
    return attention || a->quantized();
  }
  if (auto* d = dynamic_cast<models::DenseLinearImpl*>(module)) {
    out->input = d->input_quantizer.is_empty() ? nullptr : d->input_quantizer.ptr();
    out->weight = d->weight_quantizer.is_empty() ? nullptr : d->weight_quantizer.ptr();
    return true;
  }
  if (auto* c = dynamic_cast<models::QuantConv2dImpl*>(module)) {
    out->input = c->input_quantizer.is_empty() ? nullptr : c->input_quantizer.ptr();
    out->weight = c->weight_quantizer.is_empty() ? nullptr : c->weight_quantizer.ptr();
    return true;
  }
  if (auto* r = dynamic_cast<models::ResidualConvBlock*>(module)) {
    out->kind = Layer::Kind::kAdd;
    out->input = r->add_quantizer.is_empty() ? nullptr : r->add_quantizer.ptr();
    out->weight = nullptr;
    return true;
  }
  if (auto* b = dynamic_cast<models::Bottleneck*>(module)) {
    out->kind = Layer::Kind::kAdd;
    out->input = b->add_quantizer.is_empty() ? nullptr : b->add_quantizer.ptr();
    out->weight = nullptr;
    return true;
  }
  return false;
}

constexpr const char* kAttentionInputs[] = {"q", "k", "v", "p"};

// Whether `glob` names the layer at `path` or a module containing it (a dotted prefix of it).
bool skip_matches(const std::string& glob, const std::string& path) {
  if (core::glob_match(glob, path)) return true;
  for (std::size_t dot = path.find('.'); dot != std::string::npos; dot = path.find('.', dot + 1)) {
    if (core::glob_match(glob, path.substr(0, dot))) return true;
  }
  return false;
}

}  // namespace

std::string Layer::module_path() const {
  return kind == Kind::kAttention ? path.substr(0, path.rfind('.')) : path;
}

std::string Layer::unit_param() const {
  switch (kind) {
    case Kind::kAdd:
      return path + ".conv1.conv.weight";
    case Kind::kAttention:
      return module_path() + ".qkv.weight";
    case Kind::kLinear:
      break;
  }
  return path + ".weight";
}

std::vector<Layer> layers(torch::nn::Module& model) {
  std::vector<Layer> out;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    Layer l;
    if (!quantizable(item.value().get(), &l, false) || !l.input) continue;
    l.path = item.key();
    if (l.kind == Layer::Kind::kAttention) {
      // q, k, v, p: the order the forward quantizes them in.
      auto* a = dynamic_cast<models::AttentionImpl*>(item.value().get());
      const models::TensorQuantizer* qs[] = {&a->q_quantizer, &a->k_quantizer, &a->v_quantizer,
                                             &a->p_quantizer};
      for (int i = 0; i < 4; ++i) {
        Layer in = l;
        in.path = l.path + "." + kAttentionInputs[i];
        in.input = qs[i]->ptr();
        out.push_back(std::move(in));
      }
      continue;
    }
    out.push_back(std::move(l));
  }
  return out;
}

std::vector<Layer> apply(models::Model& model, const QatConfig& cfg, int64_t* skipped) {
  std::vector<std::string> all;
  std::vector<int> hits(cfg.skip.size(), 0);
  int64_t n_skipped = 0;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    Layer l;
    if (!quantizable(item.value().get(), &l, cfg.attention)) continue;
    const std::string& path = item.key();
    all.push_back(path);
    bool skip = false;
    for (std::size_t g = 0; g < cfg.skip.size(); ++g) {
      if (!skip_matches(cfg.skip[g], path)) continue;
      ++hits[g];
      skip = true;
    }
    if (skip) {
      ++n_skipped;
      continue;
    }
    if (auto* d = dynamic_cast<models::DenseLinearImpl*>(item.value().get())) {
      d->add_quantizers(cfg.learn_scales);
    } else if (auto* c = dynamic_cast<models::QuantConv2dImpl*>(item.value().get())) {
      c->add_quantizers(cfg.learn_scales);
    } else if (auto* a = dynamic_cast<models::AttentionImpl*>(item.value().get())) {
      a->add_quantizers(cfg.learn_scales);
    } else if (auto* b = dynamic_cast<models::Bottleneck*>(item.value().get())) {
      b->add_quantizers(cfg.learn_scales);
    } else {
      dynamic_cast<models::ResidualConvBlock*>(item.value().get())
          ->add_quantizers(cfg.learn_scales);
    }
  }
  for (std::size_t g = 0; g < cfg.skip.size(); ++g) {
    if (hits[g] > 0) continue;
    std::vector<std::string> some(all.begin(),
                                  all.begin() + std::min<std::ptrdiff_t>(6, all.size()));
    throw_error<ConfigError>(
        "key 'qat.skip': '{}' matches no quantizable layer of model '{}'{}", cfg.skip[g],
        model.name(),
        all.empty() ? " (it has none)"
                    : fmt::format(" (its linear and conv layers are e.g. {}{})",
                                  core::join(some, ", "), all.size() > some.size() ? ", ..." : ""));
  }
  std::vector<Layer> out = layers(model);
  PARALLAX_CHECK(!out.empty(), ConfigError,
                 "key 'qat.enabled': model '{}' has no layer left to quantize ({} linear/conv "
                 "layers, {} skipped by qat.skip; QAT quantizes the models' DenseLinear and conv "
                 "layers)",
                 model.name(), all.size(), n_skipped);
  if (skipped) *skipped = n_skipped;
  return out;
}

void set_state(const std::vector<Layer>& ls, QuantState state) {
  for (const auto& l : ls) {
    l.input->set_state(state);
    if (l.weight) l.weight->set_state(state);
  }
}

}  // namespace parallax::train::qat
