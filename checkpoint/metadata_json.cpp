// metadata.json's text (format.h): Metadata::to_json writes it behind its checksum line, and
// Metadata::from_json reads it back through yaml-cpp (JSON is YAML's flow style), checking the
// checksum, the version, the layout, every file name and every shard against its tensor, so that
// the readers can trust what it says.
#include "checkpoint/format.h"

#include "checkpoint/tensor_io.h"
#include "core/error.h"
#include "core/strings.h"

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <map>
#include <set>
#include <string_view>
#include <utility>

namespace parallax::checkpoint {
namespace {

// ---- JSON writing ------------------------------------------------------------------------------

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

class MetaReader {
 public:
  explicit MetaReader(std::string where) : where_(std::move(where)) {}

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

// ---- metadata.json's sections, each checked as it is read ---------------------------------------

// "format", "format_version" (a newer one is refused), the checksum, "step", "created",
// "config_hash" and "layout".
void read_header(const YAML::Node& root, const MetaReader& r, const std::string& text,
                 const std::string& where, Metadata& m) {
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
}

// "files" (plain names inside the checkpoint directory) and "config"; returns the file names.
std::set<std::string> read_files(const YAML::Node& root, const MetaReader& r, Metadata& m) {
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
  return file_names;
}

// "extra": numbers as int64 or double, quoted and bare words as strings.
void read_extra(const YAML::Node& root, const MetaReader& r, Metadata& m) {
  const YAML::Node extra = root["extra"];
  if (!extra.IsDefined() || extra.IsNull()) return;
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

// (file, dataset path) -> the shard stored there: two shards in one dataset would read the same
// bytes (a rank file holds each piece of a tensor once, format.h).
using DatasetOwners = std::map<std::pair<std::string, std::string>, std::string>;

// Shard `sk` of tensor `t` (whose name, dtype and shape are read): its file, crc32, piece and
// either its flat range or its box, each checked against the tensor.
ShardInfo read_shard(const YAML::Node& n, const std::string& sk, const TensorInfo& t,
                     const MetaReader& r, const Metadata& m,
                     const std::set<std::string>& file_names, DatasetOwners& datasets) {
  ShardInfo s;
  s.file = r.to_string(r.child(n, sk, "file"), sk + ".file");
  const int64_t crc = r.to_int(r.child(n, sk, "crc32"), sk + ".crc32");
  if (crc < 0 || crc > 0xffffffffLL) r.fail(sk + ".crc32", "out of range");
  s.crc32 = static_cast<uint32_t>(crc);
  if (!file_names.count(s.file))
    r.fail(sk + ".file", fmt::format("'{}' is not listed in \"files\"", s.file));
  if (const YAML::Node p = n["piece"]; p.IsDefined()) {
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
  if (const YAML::Node f = n["flat"]; f.IsDefined()) {
    // A flat range [begin, end) of the C-order flattening (format version 3).
    if (m.format_version < kFlatFormatVersion) {
      r.fail(sk + ".flat", fmt::format("flat shards need format version {}, the file has {}",
                                       kFlatFormatVersion, m.format_version));
    }
    if (n["offsets"].IsDefined() || n["lengths"].IsDefined())
      r.fail(sk, "a shard has either \"flat\" or \"offsets\" and \"lengths\", not both");
    const std::vector<int64_t> be = r.to_ints(f, sk + ".flat");
    if (be.size() != 2 || be[0] < 0 || be[1] < be[0] || be[1] > t.numel()) {
      r.fail(sk + ".flat",
             fmt::format("{} is not a range [begin, end) inside the tensor's {} elements",
                         json_ints(be), t.numel()));
    }
    s.flat = FlatRange{be[0], be[1]};
    return s;
  }
  s.offsets = r.to_ints(r.child(n, sk, "offsets"), sk + ".offsets");
  s.lengths = r.to_ints(r.child(n, sk, "lengths"), sk + ".lengths");
  if (s.offsets.size() != t.shape.size() || s.lengths.size() != t.shape.size()) {
    r.fail(sk, fmt::format("offsets/lengths have {}/{} entries for a {}-d tensor", s.offsets.size(),
                           s.lengths.size(), t.shape.size()));
  }
  for (size_t d = 0; d < t.shape.size(); ++d) {
    if (s.offsets[d] < 0 || s.lengths[d] < 0 || s.offsets[d] + s.lengths[d] > t.shape[d]) {
      r.fail(sk, fmt::format("box {} + {} lies outside the shape {}", json_ints(s.offsets),
                             json_ints(s.lengths), json_ints(t.shape)));
    }
  }
  return s;
}

// "tensors": each tensor's dtype, shape and shards, which must hold exactly its elements.
void read_tensors(const YAML::Node& root, const MetaReader& r, const std::string& where,
                  const std::set<std::string>& file_names, Metadata& m) {
  const YAML::Node tensors = r.child(root, "", "tensors");
  if (!tensors.IsMap()) r.fail("tensors", "expected an object");
  DatasetOwners datasets;
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
      ShardInfo s =
          read_shard(shards[i], fmt::format("{}.shards[{}]", k, i), t, r, m, file_names, datasets);
      covered += s.numel();
      t.shards.push_back(std::move(s));
    }
    if (covered != t.numel()) {
      r.fail(k + ".shards",
             fmt::format("the shards hold {} elements but the tensor has {}", covered, t.numel()));
    }
    m.tensors.emplace(t.name, std::move(t));
  }
}

}  // namespace

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
  const MetaReader r(where);
  Metadata m;
  read_header(root, r, text, where, m);
  const std::set<std::string> file_names = read_files(root, r, m);
  read_extra(root, r, m);
  read_tensors(root, r, where, file_names, m);
  return m;
}

}  // namespace parallax::checkpoint
