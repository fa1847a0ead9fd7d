// Pretrained weights from other frameworks' files (model.pretrained): the tensors of a foreign file
// (checkpoint/tensor_source.h: safetensors, torch.save) renamed into this model's names and adapted
// to its shapes, for load_weights / defer_weights (checkpoint/weights.h), which then match, check
// and read them as they do a Parallax checkpoint's.
//
// The steps, for each tensor of the file:
//   1. `prefix`: only the tensors under it are taken ("backbone." of a detector's checkpoint), the
//      prefix stripped; without a prefix, a wrapper every name shares ("state_dict.", "model.",
//      "module.") is stripped;
//   2. `rules`: "regex -> replacement" rewrites (ECMAScript std::regex, $1 for groups), in order;
//   3. the convention (`source`) names it in the model:
//      - parallax: Parallax's own names (a `parallax export --format safetensors` file);
//      - timm: timm's ViT names (vision_transformer.py: patch_embed.proj, cls_token, reg_token,
//        pos_embed, blocks.<i>.{norm1,attn.qkv,attn.proj,ls1.gamma,norm2,mlp.fc1,mlp.fc2,
//        ls2.gamma}, norm), which DINOv2's own release shares (register_tokens; mask_token is
//        dropped); for a ResNet, torchvision's names (timm's ResNets use them too);
//      - torchvision: torchvision's ResNet names (conv1, bn1, layer<s>.<b>.*, downsample.<k>);
//      - hf: Hugging Face transformers' ViTModel and Dinov2Model / Dinov2WithRegistersModel names
//        (embeddings.*, encoder.layer.<i>.* or transformers 5's layers.<i>.*: query, key and value
//        (transformers 5: q_proj, k_proj,
//        v_proj) concatenated into qkv);
//      tensors a convention knows but the backbone does not use (a classifier head, fc, pooler,
//      mask_token) are "ignored", not "unexpected";
//   4. shapes: a ViT's position embedding is resampled to the model's patch grid
//   (models/pos_embed.h,
//      bicubic as timm) and its class/register positions folded into those tokens or added as
//      zeros as the model's layout needs (timm's no_embed_class); a patch embedding of another
//      patch size is refused (CheckpointError naming both sizes).
// Values are read when a model tensor is read (a safetensors file stays memory-mapped), checked for
// NaN/inf and converted to the model tensor's dtype; an integer or bool tensor for a floating one
// (or the reverse) is refused.
#pragma once

#include "checkpoint/tensor_source.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace parallax::checkpoint {

// The geometry of the model's ViT backbone, for its position embedding.
struct VitGeometry {
  int64_t grid_h = 0, grid_w = 0, patch = 16;
  bool class_token = false;
  int64_t reg_tokens = 0;
  bool no_embed_class = false;
};

struct PretrainedOptions {
  std::string source = "parallax";  // parallax | timm | torchvision | hf
  std::string prefix;               // see the file comment, step 1
  std::vector<std::string> rules;   // step 2
  // Where the weights go in the model: "" (the whole model) or the backbone's module path with a
  // trailing dot ("encoder.vit."); model tensors outside it are neither loaded nor "missing".
  std::string root;
  // The backbone's kind at `root`: "vit" or "resnet" (conventions map differently).
  std::string backbone = "vit";
  std::optional<VitGeometry> vit;  // set for a ViT root
};

// The foreign file's tensors as model tensors: names under `root` (full module paths), shapes after
// adaptation, and a reader of each.
class MappedTensors {
 public:
  // Opens `path` (open_tensor_source) and maps it. Throws CheckpointError / IoError / ConfigError
  // (a bad rule) naming the file, the key or the tensor.
  MappedTensors(const std::string& path, const PretrainedOptions& options);

  const std::map<std::string, std::vector<int64_t>>& shapes() const { return shapes_; }
  // The file's names the mapping dropped on purpose (a head, mask_token), and those it could not
  // place (after the prefix and rules; "unexpected" unless a model tensor takes them).
  const std::vector<std::string>& ignored() const { return ignored_; }
  const std::vector<std::string>& unplaced() const { return unplaced_; }
  // One line per tensor whose value is not the file's as stored ("encoder.vit.pos_embed: 37x37 ->
  // 19x51 (bicubic)").
  const std::vector<std::string>& adapted() const { return adapted_; }
  // What was done to the names ("prefix 'backbone.' (123 tensors)", "wrapper 'state_dict.'").
  const std::vector<std::string>& notes() const { return notes_; }
  const std::string& where() const { return where_; }
  std::string format() const { return source_->format(); }

  // Model tensor `name` (a key of shapes()) as a new CPU tensor of its listed shape, in the file's
  // dtype (a floating dtype for floating tensors). Throws CheckpointError naming the file and the
  // tensor for NaN/inf.
  at::Tensor read(const std::string& name) const;

  // A file's tensor under its canonical name (timm's for a ViT, torchvision's for a ResNet) and
  // how to read it (pretrained.cpp).
  using Recipe = std::function<at::Tensor(TensorSource&)>;
  struct Canon {
    std::vector<int64_t> shape;
    Recipe read;
  };

 private:
  void add(const std::string& name, std::vector<int64_t> shape, Recipe recipe);
  void map_vit(const std::map<std::string, Canon>& canonical);
  void map_plain(const std::map<std::string, Canon>& canonical);

  std::shared_ptr<TensorSource> source_;
  PretrainedOptions options_;
  std::string where_;
  std::map<std::string, std::vector<int64_t>> shapes_;
  std::map<std::string, Recipe> recipes_;
  std::vector<std::string> ignored_, unplaced_, adapted_, notes_;
};

// The other direction (parallax export --format safetensors --convention C): the model tensors
// under `root` ("encoder.vit.", "encoder.resnet.") renamed to convention `convention` (timm: timm's
// ViT names, which its create_model(..., num_classes=0, img_size=...) loads strictly; torchvision:
// the ResNet trunk's names, which torchvision's resnet loads strictly once its fc is replaced by
// Identity), every tensor outside the root and every training-only one (aux, FP8 state) left out.
// ConfigError for a convention that does not name this backbone (torchvision for a ViT, timm or
// torchvision for the conv backbone). Tensors are not copied.
std::vector<std::pair<std::string, at::Tensor>> to_convention(
    const std::vector<std::pair<std::string, at::Tensor>>& tensors, const std::string& convention,
    const std::string& root, const std::string& backbone);

}  // namespace parallax::checkpoint
