#include "checkpoint/pretrained.h"

#include "core/error.h"
#include "core/strings.h"
#include "models/pos_embed.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <regex>
#include <set>

namespace parallax::checkpoint {

namespace {

using Canon = MappedTensors::Canon;
using CanonMap = std::map<std::string, Canon>;

bool starts_with(const std::string& s, const std::string& p) {
  return s.rfind(p, 0) == 0;
}

std::string few(const std::vector<std::string>& names, std::size_t n = 4) {
  std::vector<std::string> head(names.begin(),
                                names.begin() + static_cast<long>(std::min(n, names.size())));
  return core::join(head, ", ") + (names.size() > n ? ", ..." : "");
}

Canon direct(const SourceTensor& t) {
  return {t.shape, [name = t.name](TensorSource& s) { return s.read(name); }};
}

// Step 1: the prefix, or a wrapper every name shares.
std::vector<std::pair<std::string, SourceTensor>> select(const TensorSource& src,
                                                         const std::string& prefix,
                                                         std::vector<std::string>& notes) {
  std::vector<std::pair<std::string, SourceTensor>> out;
  for (const SourceTensor& t : src.tensors()) {
    if (prefix.empty() || starts_with(t.name, prefix))
      out.emplace_back(t.name.substr(prefix.size()), t);
  }
  if (!prefix.empty()) {
    if (out.empty()) {
      std::vector<std::string> names;
      for (const SourceTensor& t : src.tensors()) names.push_back(t.name);
      throw_error<CheckpointError>(
          "'{}': key 'model.pretrained.prefix' '{}' matches none of its {} tensors ({}); nothing "
          "was loaded",
          src.path(), prefix, names.size(), few(names));
    }
    notes.push_back(
        fmt::format("prefix '{}': {} of {} tensors", prefix, out.size(), src.tensors().size()));
    return out;
  }
  for (bool again = true; again && !out.empty();) {
    again = false;
    for (const char* wrapper : {"state_dict.", "model.", "module."}) {
      const bool all = std::all_of(out.begin(), out.end(),
                                   [&](const auto& p) { return starts_with(p.first, wrapper); });
      if (!all) continue;
      for (auto& p : out) p.first = p.first.substr(std::string(wrapper).size());
      notes.push_back(fmt::format("wrapper '{}' stripped", wrapper));
      again = true;
    }
  }
  return out;
}

// Step 2: "regex -> replacement" rules, each of which must match some name.
void apply_rules(std::vector<std::pair<std::string, SourceTensor>>& names,
                 const std::vector<std::string>& rules, const std::string& where,
                 std::vector<std::string>& notes) {
  for (std::size_t i = 0; i < rules.size(); ++i) {
    const std::string key = fmt::format("model.pretrained.rules[{}]", i);
    const auto arrow = rules[i].find("->");
    PARALLAX_CHECK(arrow != std::string::npos, ConfigError,
                   "key '{}': '{}' is not 'regex -> replacement'", key, rules[i]);
    const std::string from = core::trim(rules[i].substr(0, arrow));
    const std::string to = core::trim(rules[i].substr(arrow + 2));
    std::regex re;
    try {
      re = std::regex(from, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      throw_error<ConfigError>("key '{}': '{}' is not a regular expression ({})", key, from,
                               e.what());
    }
    int64_t hits = 0;
    for (auto& p : names) {
      if (!std::regex_search(p.first, re)) continue;
      p.first = std::regex_replace(p.first, re, to);
      ++hits;
    }
    if (hits == 0) {
      std::vector<std::string> sample;
      for (const auto& p : names) sample.push_back(p.first);
      throw_error<ConfigError>(
          "key '{}': '{}' matches none of the {} tensor names of '{}' ({}); nothing was loaded",
          key, from, names.size(), where, few(sample));
    }
    notes.push_back(fmt::format("rule '{}' renamed {} tensors", rules[i], hits));
  }
}

// Hugging Face transformers' ViT / DINOv2 names -> timm's (q, k, v concatenated into qkv).
CanonMap from_hf(const std::vector<std::pair<std::string, SourceTensor>>& names,
                 std::vector<std::string>& ignored, std::vector<std::string>& unplaced) {
  CanonMap out;
  std::map<std::string, std::map<std::string, SourceTensor>> qkv;  // "blocks.i.attn.qkv.weight"
  static const std::vector<std::pair<std::string, std::string>> kLayer = {
      {"attention.attention.query.", "attn.q."},
      {"attention.attention.key.", "attn.k."},
      {"attention.attention.value.", "attn.v."},
      {"attention.output.dense.", "attn.proj."},
      // transformers 5 names the attention's projections q_proj, k_proj, v_proj and o_proj.
      {"attention.q_proj.", "attn.q."},
      {"attention.k_proj.", "attn.k."},
      {"attention.v_proj.", "attn.v."},
      {"attention.o_proj.", "attn.proj."},
      {"layer_scale1.lambda1", "ls1.gamma"},
      {"layer_scale2.lambda1", "ls2.gamma"},
      {"layernorm_before.", "norm1."},
      {"layernorm_after.", "norm2."},
      {"norm1.", "norm1."},
      {"norm2.", "norm2."},
      {"intermediate.dense.", "mlp.fc1."},
      {"output.dense.", "mlp.fc2."},
      {"mlp.fc1.", "mlp.fc1."},
      {"mlp.fc2.", "mlp.fc2."}};
  static const std::vector<std::pair<std::string, std::string>> kTop = {
      {"embeddings.cls_token", "cls_token"},
      {"embeddings.register_tokens", "reg_token"},
      {"embeddings.position_embeddings", "pos_embed"},
      {"embeddings.patch_embeddings.projection.", "patch_embed.proj."},
      {"layernorm.", "norm."}};
  // transformers 4 nests the blocks as encoder.layer.<i>; transformers 5's ViTModel as layers.<i>.
  static const std::regex kBlock(R"(^(?:encoder\.layer|layers)\.(\d+)\.(.*)$)");
  for (const auto& [raw, t] : names) {
    std::string name = raw;
    for (const char* model : {"vit.", "dinov2."}) {
      if (starts_with(name, model)) name = name.substr(std::string(model).size());
    }
    if (starts_with(name, "classifier.") || starts_with(name, "pooler.") ||
        name == "embeddings.mask_token") {
      ignored.push_back(raw);
      continue;
    }
    std::smatch m;
    std::string mapped;
    if (std::regex_match(name, m, kBlock)) {
      const std::string rest = m[2];
      for (const auto& [from, to] : kLayer) {
        if (starts_with(rest, from)) {
          mapped = "blocks." + std::string(m[1]) + "." + to + rest.substr(from.size());
          break;
        }
      }
    } else {
      for (const auto& [from, to] : kTop) {
        if (starts_with(name, from)) {
          mapped = to + name.substr(from.size());
          break;
        }
      }
    }
    if (mapped.empty()) {
      unplaced.push_back(raw);
      continue;
    }
    static const std::regex kPart(R"(^(blocks\.\d+\.attn\.)([qkv])\.(weight|bias)$)");
    if (std::regex_match(mapped, m, kPart)) {
      qkv[std::string(m[1]) + "qkv." + std::string(m[3])][m[2]] = t;
      continue;
    }
    out[mapped] = direct(t);
  }
  for (const auto& [name, parts] : qkv) {
    if (parts.size() != 3) {
      for (const auto& [k, t] : parts) unplaced.push_back(t.name);
      continue;
    }
    std::vector<int64_t> shape = parts.at("q").shape;
    if (shape.empty() || parts.at("k").shape != shape || parts.at("v").shape != shape) {
      for (const auto& [k, t] : parts) unplaced.push_back(t.name);
      continue;
    }
    shape[0] *= 3;
    out[name] = {shape, [q = parts.at("q").name, k = parts.at("k").name,
                         v = parts.at("v").name](TensorSource& s) {
                   return at::cat({s.read(q), s.read(k), s.read(v)}, 0);
                 }};
  }
  return out;
}

// timm / DINOv2's release / torchvision: the names are canonical already; what a backbone never
// uses is ignored.
CanonMap from_timm(const std::vector<std::pair<std::string, SourceTensor>>& names,
                   const std::string& backbone, std::vector<std::string>& ignored) {
  CanonMap out;
  for (const auto& [name, t] : names) {
    const bool head =
        backbone == "resnet"
            ? starts_with(name, "fc.")
            : (starts_with(name, "head.") || starts_with(name, "fc_norm.") || name == "mask_token");
    if (head) {
      ignored.push_back(t.name);
      continue;
    }
    out[name == "register_tokens" ? "reg_token" : name] = direct(t);
  }
  return out;
}

int64_t isqrt_exact(int64_t n) {
  if (n <= 0) return -1;
  const auto r = static_cast<int64_t>(std::llround(std::sqrt(static_cast<double>(n))));
  return r * r == n ? r : -1;
}

}  // namespace

MappedTensors::MappedTensors(const std::string& path, const PretrainedOptions& options)
    : source_(open_tensor_source(path)), options_(options), where_(path) {
  const std::string& conv = options.source;
  PARALLAX_CHECK(
      conv == "parallax" || conv == "timm" || conv == "torchvision" || conv == "hf", ConfigError,
      "key 'model.pretrained.source': expected parallax|timm|torchvision|hf, got '{}'", conv);
  auto names = select(*source_, options.prefix, notes_);
  apply_rules(names, options.rules, where_, notes_);
  if (conv == "parallax") {
    for (const auto& [name, t] : names) add(name, t.shape, direct(t).read);
    return;
  }
  PARALLAX_CHECK(!options.root.empty(), ConfigError,
                 "key 'model.pretrained.target': a {} file holds an image backbone, not this "
                 "whole model: set model.pretrained.target=backbone",
                 conv);
  if (options.backbone == "resnet") {
    PARALLAX_CHECK(conv != "hf", ConfigError,
                   "key 'model.pretrained.source': hf maps ViTs (ViTModel, Dinov2Model); a ResNet "
                   "backbone takes torchvision's (or timm's) names");
    map_plain(from_timm(names, options.backbone, ignored_));
    return;
  }
  PARALLAX_CHECK(conv != "torchvision", ConfigError,
                 "key 'model.pretrained.source': torchvision maps ResNets; a ViT backbone takes "
                 "timm's or hf's names");
  map_vit(conv == "hf" ? from_hf(names, ignored_, unplaced_)
                       : from_timm(names, options.backbone, ignored_));
}

void MappedTensors::add(const std::string& name, std::vector<int64_t> shape, Recipe recipe) {
  shapes_[name] = std::move(shape);
  recipes_[name] = std::move(recipe);
}

void MappedTensors::map_plain(const std::map<std::string, Canon>& canonical) {
  for (const auto& [name, c] : canonical) add(options_.root + name, c.shape, c.read);
}

void MappedTensors::map_vit(const std::map<std::string, Canon>& canonical) {
  PARALLAX_CHECK(options_.vit.has_value(), Error, "pretrained ViT mapping without its geometry");
  const VitGeometry& g = *options_.vit;
  const std::string& root = options_.root;
  static const std::regex kBlock(R"(^blocks\.(\d+)\.(.*)$)");
  for (const auto& [name, c] : canonical) {
    std::smatch m;
    if (std::regex_match(name, m, kBlock)) {
      add(root + "block" + std::string(m[1]) + "." + std::string(m[2]), c.shape, c.read);
    } else if (name == "patch_embed.proj.weight" || name == "patch_embed.proj.bias") {
      if (name == "patch_embed.proj.weight" && c.shape.size() == 4 &&
          (c.shape[2] != g.patch || c.shape[3] != g.patch)) {
        throw_error<CheckpointError>(
            "'{}': the patch embedding is {}x{} (patch {}), the model's patch is {}: a ViT's patch "
            "size does not change by loading; choose a model.backbone with patch {}; nothing was "
            "loaded",
            where_, c.shape[2], c.shape[3], c.shape[2], g.patch, c.shape[2]);
      }
      add(root + "patch_embed." + name.substr(std::string("patch_embed.proj.").size()), c.shape,
          c.read);
    } else if (starts_with(name, "norm.")) {
      add(root + name, c.shape, c.read);
    } else if (name != "cls_token" && name != "reg_token" && name != "pos_embed") {
      unplaced_.push_back(name);
    }
  }
  // The prefix tokens and the position embedding (timm's _pos_embed layouts).
  const auto cls = canonical.find("cls_token");
  const auto reg = canonical.find("reg_token");
  const auto pos = canonical.find("pos_embed");
  const bool file_cls = cls != canonical.end();
  const int64_t file_reg =
      reg != canonical.end() && reg->second.shape.size() == 3 ? reg->second.shape[1] : 0;
  if (pos == canonical.end()) {
    if (file_cls) add(root + "cls_token", cls->second.shape, cls->second.read);
    if (file_reg > 0) add(root + "reg_token", reg->second.shape, reg->second.read);
    return;
  }
  const std::vector<int64_t>& ps = pos->second.shape;
  PARALLAX_CHECK(ps.size() == 3 && ps[0] == 1, CheckpointError,
                 "'{}': pos_embed has shape [{}], expected [1, tokens, dim]; nothing was loaded",
                 where_, fmt::format("{}", fmt::join(ps, ", ")));
  // Which leading rows are prefix positions: the count that leaves a square grid.
  int64_t file_prefix = -1, side = -1;
  for (const int64_t p :
       {(file_cls ? int64_t{1} : 0) + file_reg, file_cls ? int64_t{1} : 0, int64_t{0}}) {
    if ((side = isqrt_exact(ps[1] - p)) > 0) {
      file_prefix = p;
      break;
    }
  }
  PARALLAX_CHECK(file_prefix >= 0, CheckpointError,
                 "'{}': pos_embed holds {} positions, which is no square grid after its {} prefix "
                 "token(s); nothing was loaded",
                 where_, ps[1], (file_cls ? 1 : 0) + file_reg);
  const int64_t model_prefix = g.no_embed_class ? 0 : (g.class_token ? 1 : 0) + g.reg_tokens;
  const int64_t d = ps[2];
  // Fold the file's class / register positions into the tokens when the model's embedding does
  // not cover them (timm's conversion of DINOv2 with registers).
  const bool fold = file_prefix > 0 && model_prefix == 0;
  const int64_t cls_row = file_cls && file_prefix > 0 ? 0 : -1;
  const int64_t reg_row =
      file_reg > 0 && file_prefix == (file_cls ? 1 : 0) + file_reg ? (file_cls ? 1 : 0) : -1;
  const Recipe pos_read = pos->second.read;
  if (file_cls) {
    Recipe r = cls->second.read;
    if (fold && cls_row >= 0) {
      r = [r, pos_read, cls_row](TensorSource& s) {
        return r(s) + pos_read(s).narrow(1, cls_row, 1);
      };
      adapted_.push_back(root + "cls_token: its position (pos_embed row 0) folded in");
    }
    add(root + "cls_token", cls->second.shape, r);
  }
  if (file_reg > 0) {
    Recipe r = reg->second.read;
    if (fold && reg_row >= 0) {
      r = [r, pos_read, reg_row, file_reg](TensorSource& s) {
        return r(s) + pos_read(s).narrow(1, reg_row, file_reg);
      };
      adapted_.push_back(root + "reg_token: its positions folded in");
    }
    add(root + "reg_token", reg->second.shape, r);
  }
  // The model's prefix rows: the file's where it has them, else zeros.
  const int64_t gh = g.grid_h, gw = g.grid_w;
  add(root + "pos_embed", {1, model_prefix + gh * gw, d}, [=](TensorSource& s) {
    const at::Tensor p = pos_read(s);
    const at::Tensor grid =
        models::resample_pos_embed(p.narrow(1, file_prefix, side * side), 0, side, side, gh, gw);
    if (model_prefix == 0) return grid;
    std::vector<at::Tensor> rows;
    const auto zeros = [&](int64_t n) { return at::zeros({1, n, d}, p.options()); };
    if (g.class_token) rows.push_back(cls_row >= 0 ? p.narrow(1, cls_row, 1) : zeros(1));
    if (g.reg_tokens > 0) {
      rows.push_back(reg_row >= 0 && file_reg == g.reg_tokens ? p.narrow(1, reg_row, file_reg)
                                                              : zeros(g.reg_tokens));
    }
    rows.push_back(grid);
    return at::cat(rows, 1);
  });
  if (side != gh || side != gw)
    adapted_.push_back(fmt::format("{}pos_embed: {}x{} -> {}x{} (bicubic, antialiased)", root, side,
                                   side, gh, gw));
  if (model_prefix > 0 && file_prefix != model_prefix)
    adapted_.push_back(
        fmt::format("{}pos_embed: {} prefix position(s) in the file, {} in the "
                    "model (missing ones are zeros)",
                    root, file_prefix, model_prefix));
}

at::Tensor MappedTensors::read(const std::string& name) const {
  const auto it = recipes_.find(name);
  PARALLAX_CHECK(it != recipes_.end(), CheckpointError, "'{}': no tensor maps to '{}'", where_,
                 name);
  at::Tensor v = it->second(*source_);
  if (at::isFloatingType(v.scalar_type()) && !at::isfinite(v).all().item<bool>()) {
    const int64_t bad = (~at::isfinite(v)).sum().item<int64_t>();
    throw_error<CheckpointError>(
        "'{}': tensor '{}' (for '{}') holds {} NaN/inf value(s); nothing was loaded", where_, name,
        name, bad);
  }
  return v;
}

std::vector<std::pair<std::string, at::Tensor>> to_convention(
    const std::vector<std::pair<std::string, at::Tensor>>& tensors, const std::string& convention,
    const std::string& root, const std::string& backbone) {
  const bool vit = backbone == "vit";
  PARALLAX_CHECK((convention == "timm" && (vit || backbone == "resnet")) ||
                     (convention == "torchvision" && backbone == "resnet"),
                 ConfigError,
                 "export: --convention {} does not name a {} backbone (timm: ViTs and ResNets; "
                 "torchvision: ResNets; the conv backbone is Parallax's own)",
                 convention, backbone);
  static const std::regex kBlock(R"(^block(\d+)\.(.*)$)");
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& [name, t] : tensors) {
    if (!starts_with(name, root)) continue;
    std::string n = name.substr(root.size());
    if (n.find(".fp8.") != std::string::npos || n.find("quantizer") != std::string::npos ||
        n.find("lora_") != std::string::npos)
      continue;
    std::smatch m;
    if (vit && std::regex_match(n, m, kBlock)) {
      n = "blocks." + std::string(m[1]) + "." + std::string(m[2]);
    } else if (vit && starts_with(n, "patch_embed.")) {
      n = "patch_embed.proj." + n.substr(std::string("patch_embed.").size());
    }
    out.emplace_back(n, t);
  }
  PARALLAX_CHECK(!out.empty(), ConfigError, "export: the model has no tensor under '{}'", root);
  return out;
}

}  // namespace parallax::checkpoint
