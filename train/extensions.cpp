// The registry of trainer extensions (train/extension.h): the one file that names them. An
// extension added to Parallax is added here, in the place its config section takes in the
// resolved config.
#include "train/distill/distill.h"
#include "train/extension.h"
#include "train/lora/lora.h"
#include "train/qat/qat.h"

namespace parallax::train {

const std::vector<const Extension*>& extensions() {
  static const std::vector<const Extension*> all = {&qat::extension(), &lora::extension(),
                                                    &distill::extension()};
  return all;
}

}  // namespace parallax::train
