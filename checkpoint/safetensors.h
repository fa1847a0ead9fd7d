// Internal: the safetensors format (https://github.com/huggingface/safetensors, "Format"): one
// memory-mapped file, or a sharded set behind its *.safetensors.index.json. Public entry points are
// in tensor_source.h; tests use these directly.
#pragma once

#include "checkpoint/tensor_source.h"

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace parallax::checkpoint::safetensors {

// safetensors' own bound on the JSON header.
inline constexpr int64_t kMaxHeaderBytes = 100'000'000;

// "F32" <-> at::kFloat, ...; nullopt for a dtype this reader does not take.
std::optional<at::ScalarType> dtype_from_name(const std::string& name);
std::optional<std::string> dtype_name(at::ScalarType dtype);

// One .safetensors file, validated whole (file comment of tensor_source.h) and memory-mapped.
std::unique_ptr<TensorSource> open_file(const std::string& path);
// A sharded set: every shard named by the index's weight_map, paths relative to the index's
// directory (absolute paths and paths leaving it are refused); each listed tensor must be in its
// shard and no tensor in two shards.
std::unique_ptr<TensorSource> open_index(const std::string& index_path);

// For tests: the mapped address range [begin, end) of the file behind `source` (open_file's), or
// {nullptr, nullptr} for another kind of source.
std::pair<const void*, const void*> mapped_range(const TensorSource& source);

}  // namespace parallax::checkpoint::safetensors
