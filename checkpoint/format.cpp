// The checkpoint format's rules and names (format.h): shard geometry, the tiling check, dtype
// names, step / rank / piece names, and finding the checkpoint a path or `latest` means.
// metadata.json's text is metadata_json.cpp.
#include "checkpoint/format.h"

#include "checkpoint/files.h"
#include "core/boxes.h"
#include "core/error.h"
#include "core/strings.h"

#include <c10/util/accumulate.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <set>
#include <utility>

namespace fs = std::filesystem;

namespace parallax::checkpoint {

int64_t ShardInfo::numel() const {
  return flat ? flat->numel() : c10::multiply_integers(lengths);
}

std::vector<int64_t> ShardInfo::stored_dims() const {
  return flat ? std::vector<int64_t>{flat->numel()} : lengths;
}

std::string ShardInfo::describe() const {
  if (flat) return fmt::format("flat [{}, {})", flat->begin, flat->end);
  return fmt::format("box {} + {}", core::json_ints(offsets), core::json_ints(lengths));
}

int Metadata::version_needed() const {
  int v = kBoxFormatVersion;
  for (const auto& [name, t] : tensors) {
    for (const ShardInfo& s : t.shards) {
      if (s.piece > 0) return kPieceFormatVersion;
      if (s.is_flat()) v = kFlatFormatVersion;
    }
  }
  return v;
}

std::string piece_dataset(const std::string& name, int piece) {
  return piece == 0 ? name : fmt::format("{}@{}", name, piece);
}
int64_t TensorInfo::numel() const {
  return c10::multiply_integers(shape);
}
int64_t TensorInfo::nbytes() const {
  return numel() * static_cast<int64_t>(c10::elementSize(dtype));
}

std::string tiling_problem(const TensorInfo& t) {
  int64_t covered = 0;
  std::vector<size_t> pieces;  // the shards that hold elements
  for (size_t i = 0; i < t.shards.size(); ++i) {
    covered += t.shards[i].numel();
    if (t.shards[i].numel() > 0) pieces.push_back(i);
  }
  auto name = [&](size_t i) {
    return fmt::format("{} {}", t.shards[i].file, t.shards[i].describe());
  };
  auto overlap = [&](size_t a, size_t b) {
    return fmt::format("overlap: {} and {}", name(std::min(a, b)), name(std::max(a, b)));
  };
  const bool all_flat =
      std::all_of(pieces.begin(), pieces.end(), [&](size_t i) { return t.shards[i].is_flat(); });
  if (t.shape.empty()) {
    if (pieces.size() > 1) return overlap(pieces[0], pieces[1]);
  } else if (all_flat && !pieces.empty()) {
    // 1-D intervals: sorted by start, each must start at or after the furthest end so far.
    std::sort(pieces.begin(), pieces.end(), [&](size_t a, size_t b) {
      return t.shards[a].flat->begin < t.shards[b].flat->begin;
    });
    for (size_t k = 1, reach = pieces[0]; k < pieces.size(); ++k) {
      if (t.shards[pieces[k]].flat->begin < t.shards[reach].flat->end)
        return overlap(reach, pieces[k]);
      if (t.shards[pieces[k]].flat->end > t.shards[reach].flat->end) reach = pieces[k];
    }
  } else {
    // Boxes (flat ranges as theirs), sorted by offsets: a box can only meet the boxes after it
    // that start (in dimension 0) before it ends there.
    struct Part {
      core::Box box;
      size_t shard;
    };
    std::vector<Part> parts;
    for (const size_t i : pieces) {
      const ShardInfo& s = t.shards[i];
      if (!s.flat) {
        parts.push_back(Part{core::Box{s.offsets, s.lengths}, i});
        continue;
      }
      for (core::Box& b : core::flat_range_boxes(t.shape, s.flat->begin, s.flat->end))
        parts.push_back(Part{std::move(b), i});
    }
    std::sort(parts.begin(), parts.end(),
              [](const Part& a, const Part& b) { return a.box.offsets < b.box.offsets; });
    for (size_t a = 0; a < parts.size(); ++a) {
      const core::Box& A = parts[a].box;
      for (size_t b = a + 1; b < parts.size(); ++b) {
        const core::Box& B = parts[b].box;
        if (B.offsets[0] >= A.offsets[0] + A.lengths[0]) break;
        bool meet = true;
        for (size_t d = 1; d < t.shape.size() && meet; ++d) {
          meet = A.offsets[d] < B.offsets[d] + B.lengths[d] &&
                 B.offsets[d] < A.offsets[d] + A.lengths[d];
        }
        // Two boxes of one flat range never meet; a flat range is one piece.
        if (meet && parts[a].shard != parts[b].shard)
          return overlap(parts[a].shard, parts[b].shard);
      }
    }
  }
  if (covered == t.numel()) return "";
  std::vector<std::string> all;
  constexpr size_t kShown = 16;
  for (size_t i = 0; i < t.shards.size() && i < kShown; ++i) all.push_back(name(i));
  if (t.shards.size() > kShown) all.push_back(fmt::format("... {} more", t.shards.size() - kShown));
  return fmt::format("cover {} of {} elements ({})", covered, t.numel(), core::join(all, "; "));
}

std::string dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return "float32";
    case at::kDouble:
      return "float64";
    case at::kHalf:
      return "float16";
    case at::kBFloat16:
      return "bfloat16";
    case at::kChar:
      return "int8";
    case at::kByte:
      return "uint8";
    case at::kShort:
      return "int16";
    case at::kInt:
      return "int32";
    case at::kLong:
      return "int64";
    case at::kBool:
      return "bool";
    case at::kFloat8_e4m3fn:
      return "float8_e4m3fn";
    case at::kFloat8_e5m2:
      return "float8_e5m2";
    default:
      return c10::toString(dtype);
  }
}

at::ScalarType dtype_from_name(const std::string& name, const std::string& where) {
  static const std::vector<std::pair<std::string, at::ScalarType>> kTable = {
      {"float32", at::kFloat},
      {"float64", at::kDouble},
      {"float16", at::kHalf},
      {"bfloat16", at::kBFloat16},
      {"int8", at::kChar},
      {"uint8", at::kByte},
      {"int16", at::kShort},
      {"int32", at::kInt},
      {"int64", at::kLong},
      {"bool", at::kBool},
      {"float8_e4m3fn", at::kFloat8_e4m3fn},
      {"float8_e5m2", at::kFloat8_e5m2}};
  std::vector<std::string> names;
  for (const auto& [n, t] : kTable) {
    if (n == name) return t;
    names.push_back(n);
  }
  throw_error<CheckpointError>("{}: unknown dtype '{}'{}", where, name,
                               core::did_you_mean(name, names));
}

int64_t Metadata::extra_int(const std::string& key) const {
  auto it = extra.find(key);
  if (it == extra.end())
    throw_error<CheckpointError>("checkpoint of step {}: extra key '{}' is missing", step, key);
  if (const auto* i = std::get_if<int64_t>(&it->second)) return *i;
  throw_error<CheckpointError>("checkpoint of step {}: extra key '{}' is not an integer", step,
                               key);
}

double Metadata::extra_double(const std::string& key) const {
  auto it = extra.find(key);
  if (it == extra.end())
    throw_error<CheckpointError>("checkpoint of step {}: extra key '{}' is missing", step, key);
  if (const auto* d = std::get_if<double>(&it->second)) return *d;
  if (const auto* i = std::get_if<int64_t>(&it->second)) return static_cast<double>(*i);
  throw_error<CheckpointError>("checkpoint of step {}: extra key '{}' is not a number", step, key);
}

std::string Metadata::extra_string(const std::string& key) const {
  auto it = extra.find(key);
  if (it == extra.end())
    throw_error<CheckpointError>("checkpoint of step {}: extra key '{}' is missing", step, key);
  if (const auto* s = std::get_if<std::string>(&it->second)) return *s;
  throw_error<CheckpointError>("checkpoint of step {}: extra key '{}' is not a string", step, key);
}

const TensorInfo* Metadata::find(const std::string& name) const {
  auto it = tensors.find(name);
  return it == tensors.end() ? nullptr : &it->second;
}

std::string step_dir_name(int64_t step) {
  return fmt::format("step_{:08d}", step);
}

std::optional<int64_t> parse_step_dir_name(const std::string& name) {
  static constexpr std::string_view kPrefix = "step_";
  if (name.size() < kPrefix.size() + 8 || name.compare(0, kPrefix.size(), kPrefix) != 0)
    return std::nullopt;
  int64_t v = 0;
  for (size_t i = kPrefix.size(); i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    if (v > (INT64_MAX - 9) / 10) return std::nullopt;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}

std::string rank_file_name(int rank) {
  return fmt::format("rank_{:05d}.h5", rank);
}

std::string rank_local_name(int rank, const std::string& name) {
  return fmt::format("rank/{}/{}", rank, name);
}

void validate_tensor_name(const std::string& name) {
  if (name.empty()) throw_error<CheckpointError>("a checkpoint entry has an empty name");
  for (const char c : name) {
    if (static_cast<unsigned char>(c) < 0x20) {
      throw_error<CheckpointError>("checkpoint entry name '{}' holds a control character", name);
    }
  }
  for (const std::string& part : core::split(name, '/')) {
    if (part.empty() || part == "." || part == "..") {
      throw_error<CheckpointError>(
          "checkpoint entry name '{}' is not a valid path (empty, '.' or '..' component)", name);
    }
  }
}

std::optional<std::string> latest_checkpoint(const std::string& checkpoints_dir) {
  const fs::path latest = fs::path(checkpoints_dir) / kLatestFile;
  std::error_code ec;
  if (fs::is_directory(latest, ec)) {
    // A symbolic link to a step directory (made by hand; the checkpointer writes a file).
    if (files::file_size((latest / kMetadataFile).string()) < 0) {
      throw_error<CheckpointError>("'{}' links to a directory without {}", latest.string(),
                                   kMetadataFile);
    }
    return latest.string();
  }
  if (files::file_size(latest.string()) < 0) return std::nullopt;
  const std::string target = core::trim(files::read_text(latest.string()));
  if (!parse_step_dir_name(target)) {
    throw_error<CheckpointError>("'{}' holds '{}', not a checkpoint directory name (step_XXXXXXXX)",
                                 latest.string(), target);
  }
  const fs::path dir = fs::path(checkpoints_dir) / target;
  if (files::file_size((dir / kMetadataFile).string()) < 0) {
    throw_error<CheckpointError>("'{}' points to '{}', which does not exist or has no {}",
                                 latest.string(), dir.string(), kMetadataFile);
  }
  return dir.string();
}

std::string resolve_checkpoint(const std::string& path) {
  const fs::path p(path);
  std::error_code ec;
  if (!fs::exists(p, ec)) throw_error<CheckpointError>("checkpoint path '{}' does not exist", path);
  if (!fs::is_directory(p, ec)) {
    // The `latest` pointer itself (users type runs/x/checkpoints/latest): what it names.
    fs::path named = p.filename();
    if (named.empty()) named = p.parent_path().filename();
    if (named == kLatestFile) {
      const fs::path parent = p.has_parent_path() ? p.parent_path() : fs::path(".");
      if (auto l = latest_checkpoint(parent.string())) return *l;
    }
    throw_error<CheckpointError>(
        "'{}' is not a checkpoint directory (expected a step_XXXXXXXX directory, a "
        "checkpoints directory, a run directory or a '{}' file)",
        path, kLatestFile);
  }
  if (files::file_size((p / kMetadataFile).string()) >= 0) return p.string();
  if (auto l = latest_checkpoint(p.string())) return *l;
  if (auto l = latest_checkpoint((p / "checkpoints").string())) return *l;
  if (parse_step_dir_name(p.filename().string())) {
    throw_error<CheckpointError>("'{}' has no {} (an incomplete checkpoint?)", path, kMetadataFile);
  }
  throw_error<CheckpointError>(
      "'{}' holds no checkpoint: no {}, no '{}' file and no checkpoints/{}", path, kMetadataFile,
      kLatestFile, kLatestFile);
}

bool is_checkpoint_path(const std::string& path) {
  try {
    resolve_checkpoint(path);
    return true;
  } catch (const Error&) {
    return false;
  }
}

}  // namespace parallax::checkpoint
