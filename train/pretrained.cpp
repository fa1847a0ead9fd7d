#include "train/pretrained.h"

#include "checkpoint/tensor_source.h"
#include "core/error.h"
#include "models/vit.h"

namespace parallax::train {

checkpoint::WeightsOptions pretrained_load_options(const RunConfig& cfg, const models::Model& model,
                                                   const std::string& path) {
  const models::PretrainedConfig& p = cfg.model.pretrained;
  const bool foreign = checkpoint::is_tensor_source(path);
  checkpoint::WeightsOptions w;
  w.strict = foreign ? p.strict : cfg.train.strict_load;
  checkpoint::PretrainedOptions o;
  o.source = p.source;
  o.prefix = p.prefix;
  o.rules = p.rules;
  PARALLAX_CHECK(foreign || p.source == "parallax", ConfigError,
                 "key 'model.pretrained.source': '{}' is a Parallax checkpoint or weights.h5, "
                 "which hold Parallax's names: source={} applies to safetensors and torch.save "
                 "files",
                 path, p.source);
  PARALLAX_CHECK(foreign || (p.prefix.empty() && p.rules.empty()), ConfigError,
                 "key 'model.pretrained.{}': prefixes and rules rename a foreign file's tensors "
                 "(safetensors, torch.save); '{}' is a Parallax checkpoint or weights.h5",
                 p.prefix.empty() ? "rules" : "prefix", path);
  if (p.target == "backbone") {
    const auto site = model.backbone_site();
    PARALLAX_CHECK(site.has_value(), ConfigError,
                   "key 'model.pretrained.target': model '{}' has no image backbone; use "
                   "target=model",
                   cfg.model.name);
    o.root = site->path;
    o.backbone = site->kind;
    if (site->vit != nullptr) {
      const models::VisionTransformerImpl& v = *site->vit;
      o.vit = checkpoint::VitGeometry{v.grid_h(),          v.grid_w(),
                                      v.spec().patch,      v.has_class_token(),
                                      v.spec().reg_tokens, v.spec().no_embed_class};
    }
    PARALLAX_CHECK(site->kind != "conv" || p.source == "parallax", ConfigError,
                   "key 'model.pretrained.source': the conv backbone is Parallax's own; no {} "
                   "weights fit it (model.backbone=resnet50|resnet101 or a named ViT do)",
                   p.source);
  }
  w.pretrained = o;
  return w;
}

}  // namespace parallax::train
