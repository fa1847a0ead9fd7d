// Test helper for tests/train/test_pretrained.py: builds the bev model with a backbone, loads
// pretrained weights the way `parallax train` does (train/pretrained.h: model.pretrained), runs the
// backbone alone on images from a safetensors file and writes its output there.
//
//   backbone_tool --backbone NAME --height H --width W --weights FILE --images IN --out OUT
//                 [--source parallax|timm|torchvision|hf] [--target backbone|model]
//                 [--prefix P] [--rule 'a -> b' ...] [--strict]
// IN holds "images" float32 [B, 3, H, W] (normalised). OUT gets "tokens" (a ViT: the final
// LayerNorm's output [B, T, D], prefix tokens first) or "features" (a ResNet: the trunk's stride-32
// map [B, 2048, H/32, W/32]). Prints the load report table. Exit 1 with "parallax: error: ..." on
// any error. --images none: the load alone (bench/checkpoint/import_bench.sh times it).
#include "checkpoint/tensor_source.h"
#include "checkpoint/weights.h"
#include "core/error.h"
#include "models/backbone.h"
#include "models/model.h"
#include "models/perception_model.h"
#include "models/vit.h"
#include "train/pretrained.h"

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <cstdio>
#include <map>
#include <string>
#include <vector>

using namespace parallax;

int main(int argc, char** argv) {
  try {
    std::map<std::string, std::string> a;
    std::vector<std::string> rules;
    bool strict = false;
    for (int i = 1; i < argc; ++i) {
      const std::string k = argv[i];
      if (k == "--strict") {
        strict = true;
      } else if (k == "--rule" && i + 1 < argc) {
        rules.push_back(argv[++i]);
      } else if (k.rfind("--", 0) == 0 && i + 1 < argc) {
        a[k.substr(2)] = argv[++i];
      } else {
        throw_error<UsageError>("backbone_tool: unexpected argument '{}'", k);
      }
    }
    for (const char* need : {"backbone", "height", "width", "weights", "images", "out"}) {
      PARALLAX_CHECK(a.count(need), UsageError, "backbone_tool: --{} is required", need);
    }
    torch::NoGradGuard no_grad;
    train::RunConfig cfg;
    cfg.model.name = "bev";
    cfg.model.backbone = a["backbone"];
    cfg.model.fused_kernels = false;
    cfg.model.pretrained.source = a.count("source") ? a["source"] : "parallax";
    cfg.model.pretrained.target = a.count("target") ? a["target"] : "backbone";
    cfg.model.pretrained.prefix = a.count("prefix") ? a["prefix"] : "";
    cfg.model.pretrained.rules = rules;
    cfg.model.pretrained.strict = strict;
    core::SceneSpec scene;
    scene.num_cameras = 1;
    scene.image_height = std::stoll(a["height"]);
    scene.image_width = std::stoll(a["width"]);
    auto model = models::build_model(cfg.model, scene);
    model->eval();
    const auto w = train::pretrained_load_options(cfg, *model, a["weights"]);
    const auto report = checkpoint::load_weights(*model, a["weights"], w);
    std::printf("format %s\n%s\n", report.format.c_str(), report.table(1000).c_str());
    if (a["images"] == "none") return 0;  // the load alone (bench/checkpoint/import_bench.sh)
    const auto in = checkpoint::open_tensor_source(a["images"]);
    const at::Tensor images = in->read("images").to(at::kFloat).clone();
    auto* bev = dynamic_cast<models::PerceptionModel*>(model.get());
    PARALLAX_CHECK(bev != nullptr, Error, "backbone_tool: not a bev model");
    models::ImageEncoder& enc = bev->encoder();
    std::vector<std::pair<std::string, at::Tensor>> out;
    if (const models::VisionTransformerImpl* vit = enc->vit()) {
      // The ViT alone: embedding, blocks, final LayerNorm (not the neck).
      out.emplace_back(
          "tokens", const_cast<models::VisionTransformerImpl*>(vit)->forward(images).contiguous());
    } else if (models::ResNetImpl* resnet = enc->resnet()) {
      // The trunk alone: stem and the four stages, C5 at stride 32 (not the FPN).
      at::Tensor x = resnet->stem(images);
      for (int64_t s = 1; s <= 4; ++s) x = resnet->layer(s, x);
      out.emplace_back("features", x.contiguous());
    } else {
      throw_error<UsageError>("backbone_tool: backbone '{}' has no reference output here",
                              a["backbone"]);
    }
    checkpoint::write_safetensors(a["out"], out);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "parallax: error: %s\n", e.what());
    return 1;
  }
}
