#include "units/parallel_model.h"

#include "core/enum_names.h"

namespace parallax::units {

namespace {
constexpr core::EnumName<Recompute> kRecompute[] = {
    {Recompute::kNone, "none"},
    {Recompute::kSelective, "selective"},
    {Recompute::kFull, "full"},
};
}  // namespace

const char* to_string(Recompute mode) {
  return core::enum_name(kRecompute, mode);
}

Recompute parse_recompute(const std::string& name) {
  return core::parse_enum(kRecompute, name, "train.activation_checkpointing", "mode");
}

}  // namespace parallax::units
