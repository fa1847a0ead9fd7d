#include "checkpoint/format.h"

#include "checkpoint/files.h"
#include "checkpoint/tensor_io.h"
#include "core/boxes.h"
#include "core/error.h"
#include "core/strings.h"

#include <c10/util/accumulate.h>
#include <fmt/ranges.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <set>
#include <utility>

namespace fs = std::filesystem;

namespace parallax::checkpoint {
namespace {

// ---- JSON writing
// --------------------------------------------------------------------------------

// metadata.json opens with this, then 8 hex digits and `",` ending the line (format.h).
constexpr std::string_view kChecksumLead = "{\n  \"checksum\": \"crc32:";
constexpr std::string_view kChecksumTail = "\",";

using core::json_ints;

std::string json_extra(const ExtraValue& v) {
  if (const auto* i = std::get_if<int64_t>(&v)) return std::to_string(*i);
  if (const auto* d = std::get_if<double>(&v)) return core::json_number(*d);
  return core::json_quote(std::get<std::string>(v));
}

// ---- JSON reading (through yaml-cpp: JSON is YAML's flow style) ---------------------------------

class Reader {
 public:
  explicit Reader(std::string where) : where_(std::move(where)) {}

  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    throw_error<CheckpointError>("'{}': key '{}': {}", where_, key, what);
  }
  YAML::Node child(const YAML::Node& n, const std::string& parent, const char* key) const {
    const YAML::Node c = n[key];
    if (!c.IsDefined() || c.IsNull()) fail(path(parent, key), "missing");
    return c;
  }
  int64_t to_int(const YAML::Node& n, const std::string& key) const {
    try {
      if (n.IsScalar() && n.Tag() != "!") return n.as<int64_t>();
    } catch (const YAML::Exception&) {
    }
    fail(key,
         fmt::format("expected an integer, got '{}'", n.IsScalar() ? n.Scalar() : "a collection"));
  }
  std::string to_string(const YAML::Node& n, const std::string& key) const {
    if (!n.IsScalar()) fail(key, "expected a string");
    return n.Scalar();
  }
  std::vector<int64_t> to_ints(const YAML::Node& n, const std::string& key) const {
    if (!n.IsSequence()) fail(key, "expected a list of integers");
    std::vector<int64_t> out;
    for (size_t i = 0; i < n.size(); ++i)
      out.push_back(to_int(n[i], fmt::format("{}[{}]", key, i)));
    return out;
  }
  static std::string path(const std::string& parent, const std::string& key) {
    return parent.empty() ? key : parent + "." + key;
  }

 private:
  std::string where_;
};

// The checksum line (format.h) must open the file and match every byte after it.
void verify_checksum(const std::string& text, const std::string& where) {
  const size_t eol = text.find('\n', kChecksumLead.size());
  const size_t hex = kChecksumLead.size();
  if (text.compare(0, hex, kChecksumLead) != 0 || eol == std::string::npos ||
      eol != hex + 8 + kChecksumTail.size() ||
      text.compare(hex + 8, kChecksumTail.size(), kChecksumTail) != 0) {
    throw_error<CheckpointError>(
        "'{}': the checksum line is missing or malformed (the file must open with "
        "`{{` and `\"checksum\": \"crc32:XXXXXXXX\",`); metadata.json was edited or is corrupt",
        where);
  }
  uint32_t recorded = 0;
  for (size_t i = hex; i < hex + 8; ++i) {
    const char c = text[i];
    const int v = c >= '0' && c <= '9' ? c - '0' : (c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1);
    if (v < 0) {
      throw_error<CheckpointError>("'{}': the checksum '{}' is not 8 lower-case hex digits", where,
                                   text.substr(hex, 8));
    }
    recorded = recorded << 4 | static_cast<uint32_t>(v);
  }
  const uint32_t actual = tensor_io::crc32_update(
      0, text.data() + eol + 1, static_cast<int64_t>(text.size() - eol - 1), false);
  if (actual != recorded) {
    throw_error<CheckpointError>(
        "'{}': checksum mismatch: the file records crc32 {:08x} but its content has {:08x}; "
        "metadata.json was edited or is corrupt (its step, layout and tensor records cannot be "
        "trusted)",
        where, recorded, actual);
  }
}

}  // namespace

int64_t ShardInfo::numel() const {
  return flat ? flat->numel() : c10::multiply_integers(lengths);
}

std::vector<int64_t> ShardInfo::stored_dims() const {
  return flat ? std::vector<int64_t>{flat->numel()} : lengths;
}

std::string ShardInfo::describe() const {
  if (flat) return fmt::format("flat [{}, {})", flat->begin, flat->end);
  return fmt::format("box {} + {}", json_ints(offsets), json_ints(lengths));
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

std::string Metadata::to_json() const {
  // Everything after the checksum line, which covers it.
  std::string o;
  o += fmt::format("  \"format\": {},\n", core::json_quote(kFormatName));
  o += fmt::format("  \"format_version\": {},\n", format_version);
  o += fmt::format("  \"step\": {},\n", step);
  o += fmt::format("  \"created\": {},\n", core::json_quote(created));
  o += fmt::format("  \"config_hash\": {},\n", core::json_quote(config_hash));
  o += fmt::format("  \"layout\": {{\"world\": {}, \"dp\": {}, \"tp\": {}, \"pp\": {}}},\n", world,
                   layout.dp, layout.tp, layout.pp);
  o += "  \"files\": [";
  for (size_t i = 0; i < files.size(); ++i) {
    o += fmt::format("{}\n    {{\"name\": {}, \"rank\": {}, \"bytes\": {}}}", i ? "," : "",
                     core::json_quote(files[i].name), files[i].rank, files[i].bytes);
  }
  o += files.empty() ? "],\n" : "\n  ],\n";
  if (config) {
    o += fmt::format("  \"config\": {{\"file\": {}, \"bytes\": {}, \"crc32\": {}}},\n",
                     core::json_quote(config->name), config->bytes, config->crc32);
  }
  o += "  \"extra\": {";
  size_t i = 0;
  for (const auto& [k, v] : extra)
    o += fmt::format("{}\n    {}: {}", i++ ? "," : "", core::json_quote(k), json_extra(v));
  o += extra.empty() ? "},\n" : "\n  },\n";
  o += "  \"tensors\": {";
  i = 0;
  for (const auto& [name, t] : tensors) {
    o += fmt::format("{}\n    {}: {{\"dtype\": {}, \"shape\": {}, \"shards\": [", i++ ? "," : "",
                     core::json_quote(name), core::json_quote(dtype_name(t.dtype)),
                     json_ints(t.shape));
    for (size_t s = 0; s < t.shards.size(); ++s) {
      const ShardInfo& sh = t.shards[s];
      const std::string where =
          sh.flat ? fmt::format("\"flat\": [{}, {}]", sh.flat->begin, sh.flat->end)
                  : fmt::format("\"offsets\": {}, \"lengths\": {}", json_ints(sh.offsets),
                                json_ints(sh.lengths));
      o += fmt::format("{}\n      {{\"file\": {}, {}, \"crc32\": {}{}}}", s ? "," : "",
                       core::json_quote(sh.file), where, sh.crc32,
                       sh.piece > 0 ? fmt::format(", \"piece\": {}", sh.piece) : "");
    }
    o += t.shards.empty() ? "]}" : "\n    ]}";
  }
  o += tensors.empty() ? "}\n" : "\n  }\n";
  o += "}\n";
  const uint32_t crc = tensor_io::crc32_update(0, o.data(), static_cast<int64_t>(o.size()), false);
  return fmt::format("{}{:08x}{}\n", kChecksumLead, crc, kChecksumTail) + o;
}

Metadata Metadata::from_json(const std::string& text, const std::string& where) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw_error<CheckpointError>("'{}':{}:{}: malformed JSON: {}", where, e.mark.line + 1,
                                 e.mark.column + 1, e.msg);
  }
  if (!root.IsMap())
    throw_error<CheckpointError>("'{}': expected a JSON object at the top level", where);
  const Reader r(where);
  Metadata m;
  const std::string format = r.to_string(r.child(root, "", "format"), "format");
  if (format != kFormatName)
    r.fail("format", fmt::format("expected \"{}\", got \"{}\"", kFormatName, format));
  m.format_version =
      static_cast<int>(r.to_int(r.child(root, "", "format_version"), "format_version"));
  if (m.format_version > kFormatVersion) {
    throw_error<CheckpointError>(
        "'{}': checkpoint format version {} is newer than this build of Parallax reads (version "
        "{}); "
        "load it with a newer Parallax",
        where, m.format_version, kFormatVersion);
  }
  if (m.format_version < 1)
    r.fail("format_version", fmt::format("invalid version {}", m.format_version));
  // From version 2 on the file carries its own checksum (version 1 files have none).
  if (m.format_version >= 2 || root["checksum"].IsDefined()) verify_checksum(text, where);
  m.step = r.to_int(r.child(root, "", "step"), "step");
  if (root["created"].IsDefined()) m.created = r.to_string(root["created"], "created");
  m.config_hash = r.to_string(r.child(root, "", "config_hash"), "config_hash");
  const YAML::Node lay = r.child(root, "", "layout");
  m.world = static_cast<int>(r.to_int(r.child(lay, "layout", "world"), "layout.world"));
  m.layout.dp = static_cast<int>(r.to_int(r.child(lay, "layout", "dp"), "layout.dp"));
  m.layout.tp = static_cast<int>(r.to_int(r.child(lay, "layout", "tp"), "layout.tp"));
  m.layout.pp = static_cast<int>(r.to_int(r.child(lay, "layout", "pp"), "layout.pp"));
  if (m.world < 1 || m.layout.dp < 1 || m.layout.tp < 1 || m.layout.pp < 1 ||
      m.layout.world() != m.world) {
    r.fail("layout", fmt::format("inconsistent layout world={} dp={} tp={} pp={}", m.world,
                                 m.layout.dp, m.layout.tp, m.layout.pp));
  }
  std::set<std::string> file_names;
  const YAML::Node files = r.child(root, "", "files");
  if (!files.IsSequence()) r.fail("files", "expected a list");
  for (size_t i = 0; i < files.size(); ++i) {
    const std::string k = fmt::format("files[{}]", i);
    FileInfo f;
    f.name = r.to_string(r.child(files[i], k, "name"), k + ".name");
    f.rank = static_cast<int>(r.to_int(r.child(files[i], k, "rank"), k + ".rank"));
    f.bytes = r.to_int(r.child(files[i], k, "bytes"), k + ".bytes");
    if (f.name.empty() || f.name.find('/') != std::string::npos || f.name[0] == '.') {
      r.fail(k + ".name", fmt::format("invalid file name '{}'", f.name));
    }
    file_names.insert(f.name);
    m.files.push_back(std::move(f));
  }
  if (const YAML::Node c = root["config"]; c.IsDefined() && !c.IsNull()) {
    SideFile f;
    f.name = r.to_string(r.child(c, "config", "file"), "config.file");
    f.bytes = r.to_int(r.child(c, "config", "bytes"), "config.bytes");
    const int64_t crc = r.to_int(r.child(c, "config", "crc32"), "config.crc32");
    if (crc < 0 || crc > 0xffffffffLL) r.fail("config.crc32", "out of range");
    f.crc32 = static_cast<uint32_t>(crc);
    if (f.name.empty() || f.name.find('/') != std::string::npos || f.name[0] == '.')
      r.fail("config.file", fmt::format("invalid file name '{}'", f.name));
    if (f.bytes < 0) r.fail("config.bytes", "negative");
    m.config = std::move(f);
  }
  if (const YAML::Node extra = root["extra"]; extra.IsDefined() && !extra.IsNull()) {
    if (!extra.IsMap()) r.fail("extra", "expected an object");
    for (const auto& kv : extra) {
      const std::string key = kv.first.Scalar();
      const YAML::Node& v = kv.second;
      if (!v.IsScalar()) r.fail("extra." + key, "expected a number or a string");
      const std::string s = v.Scalar();
      if (v.Tag() == "!") {
        m.extra[key] = s;
      } else if (s.find_first_of(".eE") != std::string::npos || s == "inf" || s == "nan") {
        try {
          m.extra[key] = v.as<double>();
        } catch (const YAML::Exception&) {
          r.fail("extra." + key, fmt::format("expected a number, got '{}'", s));
        }
      } else {
        try {
          m.extra[key] = v.as<int64_t>();
        } catch (const YAML::Exception&) {
          m.extra[key] = s;  // true/false and other bare words read back as strings
        }
      }
    }
  }
  const YAML::Node tensors = r.child(root, "", "tensors");
  if (!tensors.IsMap()) r.fail("tensors", "expected an object");
  // (file, dataset path) -> the shard stored there: two shards in one dataset would read the same
  // bytes (a rank file holds each piece of a tensor once, format.h).
  std::map<std::pair<std::string, std::string>, std::string> datasets;
  for (const auto& kv : tensors) {
    TensorInfo t;
    t.name = kv.first.Scalar();
    const std::string k = "tensors." + t.name;
    const YAML::Node& n = kv.second;
    t.dtype = dtype_from_name(r.to_string(r.child(n, k, "dtype"), k + ".dtype"),
                              fmt::format("'{}': {}", where, k));
    t.shape = r.to_ints(r.child(n, k, "shape"), k + ".shape");
    for (int64_t d : t.shape) {
      if (d < 0) r.fail(k + ".shape", "negative dimension");
    }
    const YAML::Node shards = r.child(n, k, "shards");
    if (!shards.IsSequence()) r.fail(k + ".shards", "expected a list");
    int64_t covered = 0;
    for (size_t i = 0; i < shards.size(); ++i) {
      const std::string sk = fmt::format("{}.shards[{}]", k, i);
      ShardInfo s;
      s.file = r.to_string(r.child(shards[i], sk, "file"), sk + ".file");
      const int64_t crc = r.to_int(r.child(shards[i], sk, "crc32"), sk + ".crc32");
      if (crc < 0 || crc > 0xffffffffLL) r.fail(sk + ".crc32", "out of range");
      s.crc32 = static_cast<uint32_t>(crc);
      if (!file_names.count(s.file))
        r.fail(sk + ".file", fmt::format("'{}' is not listed in \"files\"", s.file));
      if (const YAML::Node p = shards[i]["piece"]; p.IsDefined()) {
        // Piece k > 0 of this tensor in its rank file (format version 4).
        if (m.format_version < kPieceFormatVersion) {
          r.fail(sk + ".piece", fmt::format("pieces need format version {}, the file has {}",
                                            kPieceFormatVersion, m.format_version));
        }
        const int64_t k = r.to_int(p, sk + ".piece");
        if (k < 1 || k > 1000000) r.fail(sk + ".piece", "out of range");
        s.piece = static_cast<int>(k);
      }
      {
        const std::string path = piece_dataset(t.name, s.piece);
        const auto [it, fresh] = datasets.try_emplace({s.file, path}, sk);
        if (!fresh) {
          r.fail(sk, fmt::format("file '{}' dataset '{}' is also the dataset of {}", s.file, path,
                                 it->second));
        }
      }
      if (const YAML::Node f = shards[i]["flat"]; f.IsDefined()) {
        // A flat range [begin, end) of the C-order flattening (format version 3).
        if (m.format_version < kFlatFormatVersion) {
          r.fail(sk + ".flat", fmt::format("flat shards need format version {}, the file has {}",
                                           kFlatFormatVersion, m.format_version));
        }
        if (shards[i]["offsets"].IsDefined() || shards[i]["lengths"].IsDefined())
          r.fail(sk, "a shard has either \"flat\" or \"offsets\" and \"lengths\", not both");
        const std::vector<int64_t> be = r.to_ints(f, sk + ".flat");
        if (be.size() != 2 || be[0] < 0 || be[1] < be[0] || be[1] > t.numel()) {
          r.fail(sk + ".flat",
                 fmt::format("{} is not a range [begin, end) inside the tensor's {} elements",
                             json_ints(be), t.numel()));
        }
        s.flat = FlatRange{be[0], be[1]};
        covered += s.numel();
        t.shards.push_back(std::move(s));
        continue;
      }
      s.offsets = r.to_ints(r.child(shards[i], sk, "offsets"), sk + ".offsets");
      s.lengths = r.to_ints(r.child(shards[i], sk, "lengths"), sk + ".lengths");
      if (s.offsets.size() != t.shape.size() || s.lengths.size() != t.shape.size()) {
        r.fail(sk, fmt::format("offsets/lengths have {}/{} entries for a {}-d tensor",
                               s.offsets.size(), s.lengths.size(), t.shape.size()));
      }
      for (size_t d = 0; d < t.shape.size(); ++d) {
        if (s.offsets[d] < 0 || s.lengths[d] < 0 || s.offsets[d] + s.lengths[d] > t.shape[d]) {
          r.fail(sk, fmt::format("box {} + {} lies outside the shape {}", json_ints(s.offsets),
                                 json_ints(s.lengths), json_ints(t.shape)));
        }
      }
      covered += s.numel();
      t.shards.push_back(std::move(s));
    }
    if (covered != t.numel()) {
      r.fail(k + ".shards",
             fmt::format("the shards hold {} elements but the tensor has {}", covered, t.numel()));
    }
    m.tensors.emplace(t.name, std::move(t));
  }
  return m;
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
