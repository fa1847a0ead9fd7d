#include "core/parallel_model.h"

#include "core/enum_names.h"

namespace parallax::core {

namespace {
constexpr EnumName<Checkpointing> kCheckpointing[] = {
    {Checkpointing::kNone, "none"},
    {Checkpointing::kSelective, "selective"},
    {Checkpointing::kFull, "full"},
};
}  // namespace

const char* to_string(Checkpointing mode) {
  return enum_name(kCheckpointing, mode);
}

Checkpointing parse_checkpointing(const std::string& name) {
  return parse_enum(kCheckpointing, name, "train.activation_checkpointing", "mode");
}

}  // namespace parallax::core
