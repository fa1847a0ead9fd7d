// The `model` config section: which model of the zoo, at which size, and its knobs.
#pragma once

#include "core/config.h"

#include <string>

namespace parallax::models {

struct ModelConfig {
  std::string name = "bev";
  std::string size = "tiny";
  std::string backbone = "vit";
  int num_classes = 1000;  // vit_cls only
  double dropout = 0.0;

  template <class V>
  void visit(V& v) {
    v("name", name, "model family: bev (perception) | vit_cls (classification) | mlp (stand-in)",
      core::Check::one_of({"bev", "vit_cls", "mlp"}));
    v("size", size, "size preset", core::Check::one_of({"tiny", "small", "base", "large", "3b", "b16"}));
    v("backbone", backbone, "image backbone", core::Check::one_of({"vit", "conv"}));
    v("num_classes", num_classes, "classes of the classification head (vit_cls)", core::Check::at_least(1));
    v("dropout", dropout, "dropout probability", core::Check::between(0, 1));
  }
};

}  // namespace parallax::models
