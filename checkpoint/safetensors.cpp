// The safetensors reader (memory-mapped, validated whole at open) and writer (atomic), and the
// sharded set behind an index.json. Layout of a file: 8-byte little-endian header length N, N bytes
// of UTF-8 JSON, then the data buffer that the header's data_offsets index into.
#include "checkpoint/safetensors.h"

#include "checkpoint/files.h"
#include "core/error.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>
#include <unordered_map>

namespace fs = std::filesystem;

namespace parallax::checkpoint::safetensors {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors data is little-endian; this reader maps it as is");

using Json = nlohmann::json;

struct DtypeName {
  const char* name;
  at::ScalarType dtype;
};
constexpr DtypeName kDtypes[] = {
    {"F64", at::kDouble},
    {"F32", at::kFloat},
    {"F16", at::kHalf},
    {"BF16", at::kBFloat16},
    {"I64", at::kLong},
    {"I32", at::kInt},
    {"I16", at::kShort},
    {"I8", at::kChar},
    {"U8", at::kByte},
    {"BOOL", at::kBool},
    {"F8_E4M3", at::kFloat8_e4m3fn},
    {"F8_E5M2", at::kFloat8_e5m2},
};

std::string errno_text(int e) {
  return std::strerror(e);
}

using files::Fd;

// A read-only mapping of a whole file; unmapped when the last owner (the source, or a tensor view
// through its deleter) lets go.
class Mapping {
 public:
  Mapping(const std::string& path, int fd, size_t size) : size_(size) {
    addr_ = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (addr_ == MAP_FAILED)
      throw_error<IoError>("cannot map '{}' into memory: {}", path, errno_text(errno));
  }
  ~Mapping() { ::munmap(addr_, size_); }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  const uint8_t* data() const { return static_cast<const uint8_t*>(addr_); }
  size_t size() const { return size_; }

 private:
  void* addr_;
  size_t size_;
};

struct Entry {
  SourceTensor info;
  int64_t begin = 0;  // offsets into the data buffer
  int64_t end = 0;
};

int64_t to_offset(const Json& v, const std::string& path, const std::string& tensor,
                  const char* what) {
  if (!v.is_number_integer() ||
      (v.is_number_integer() && !v.is_number_unsigned() && v.get<int64_t>() < 0))
    throw_error<CheckpointError>("'{}': tensor '{}': {} holds '{}', not a non-negative integer",
                                 path, tensor, what, v.dump());
  const uint64_t u = v.get<uint64_t>();
  if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    throw_error<CheckpointError>("'{}': tensor '{}': {} {} is too large", path, tensor, what, u);
  return static_cast<int64_t>(u);
}

Entry parse_entry(const std::string& path, const std::string& name, const Json& e) {
  if (!e.is_object())
    throw_error<CheckpointError>("'{}': tensor '{}': header entry is not an object", path, name);
  Entry out;
  out.info.name = name;
  const auto dt = e.find("dtype");
  if (dt == e.end() || !dt->is_string())
    throw_error<CheckpointError>("'{}': tensor '{}': no \"dtype\" string", path, name);
  const auto dtype = dtype_from_name(dt->get<std::string>());
  if (!dtype)
    throw_error<CheckpointError>(
        "'{}': tensor '{}': dtype '{}' is not read (F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL "
        "F8_E4M3 F8_E5M2 are)",
        path, name, dt->get<std::string>());
  out.info.dtype = *dtype;
  const auto sh = e.find("shape");
  if (sh == e.end() || !sh->is_array())
    throw_error<CheckpointError>("'{}': tensor '{}': no \"shape\" list", path, name);
  int64_t numel = 1;
  for (const Json& d : *sh) {
    const int64_t n = to_offset(d, path, name, "a shape dimension");
    out.info.shape.push_back(n);
    if (__builtin_mul_overflow(numel, n, &numel))
      throw_error<CheckpointError>("'{}': tensor '{}': shape {} overflows", path, name, sh->dump());
  }
  int64_t bytes = 0;
  if (__builtin_mul_overflow(numel, static_cast<int64_t>(c10::elementSize(*dtype)), &bytes))
    throw_error<CheckpointError>("'{}': tensor '{}': shape {} overflows", path, name, sh->dump());
  const auto off = e.find("data_offsets");
  if (off == e.end() || !off->is_array() || off->size() != 2)
    throw_error<CheckpointError>("'{}': tensor '{}': no \"data_offsets\" [begin, end]", path, name);
  out.begin = to_offset((*off)[0], path, name, "data_offsets");
  out.end = to_offset((*off)[1], path, name, "data_offsets");
  if (out.begin > out.end)
    throw_error<CheckpointError>("'{}': tensor '{}': data_offsets {} begin after they end", path,
                                 name, off->dump());
  if (out.end - out.begin != bytes)
    throw_error<CheckpointError>(
        "'{}': tensor '{}': data_offsets {} span {} bytes, but {} {} needs {} ({} elements of {})",
        path, name, off->dump(), out.end - out.begin, dt->get<std::string>(), sh->dump(), bytes,
        numel, c10::elementSize(*dtype));
  return out;
}

class SafetensorsFile final : public TensorSource {
 public:
  explicit SafetensorsFile(const std::string& path) : path_(path) {
    Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd.get() < 0) throw_error<IoError>("cannot open '{}': {}", path, errno_text(errno));
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0)
      throw_error<IoError>("cannot stat '{}': {}", path, errno_text(errno));
    if (!S_ISREG(st.st_mode)) throw_error<IoError>("'{}' is not a regular file", path);
    const int64_t size = st.st_size;
    if (size < 8)
      throw_error<CheckpointError>(
          "'{}': {} bytes, too short for a safetensors file (8 bytes of header length first)", path,
          size);
    map_ = std::make_shared<Mapping>(path, fd.get(), static_cast<size_t>(size));
    uint64_t n = 0;
    std::memcpy(&n, map_->data(), 8);  // little-endian (static_assert above)
    if (n > static_cast<uint64_t>(kMaxHeaderBytes))
      throw_error<CheckpointError>(
          "'{}': header length {} is over safetensors' limit of {} bytes (not a safetensors file, "
          "or corrupt)",
          path, n, kMaxHeaderBytes);
    if (n > static_cast<uint64_t>(size - 8))
      throw_error<CheckpointError>(
          "'{}': header length {} is past the end of the file ({} bytes): truncated or corrupt",
          path, n, size);
    data_offset_ = 8 + static_cast<int64_t>(n);
    const int64_t data_size = size - data_offset_;
    parse_header(std::string(reinterpret_cast<const char*>(map_->data()) + 8, n), data_size);
  }

  const std::vector<SourceTensor>& tensors() const override { return list_; }
  at::Tensor read(const std::string& name) override {
    const auto it = index_.find(name);
    if (it == index_.end())
      throw_error<CheckpointError>("'{}': no tensor '{}' in this safetensors file", path_, name);
    const Entry& e = entries_[it->second];
    // The view's deleter holds the mapping: it stays mapped while any view lives.
    auto map = map_;
    void* ptr = const_cast<uint8_t*>(map->data() + data_offset_ + e.begin);
    return at::from_blob(
        ptr, e.info.shape, [map](void*) {}, at::TensorOptions().dtype(e.info.dtype));
  }
  std::string path() const override { return path_; }
  std::string format() const override { return "safetensors"; }
  std::map<std::string, std::string> metadata() const override { return metadata_; }

  std::pair<const void*, const void*> range() const {
    return {map_->data(), map_->data() + map_->size()};
  }

 private:
  void parse_header(const std::string& text, int64_t data_size) {
    // Duplicate keys of the top-level object: nlohmann keeps the last one silently; refuse them.
    std::set<std::string> seen;
    std::string duplicate;
    Json header;
    try {
      header = Json::parse(text, [&](int depth, Json::parse_event_t event, Json& parsed) {
        if (event == Json::parse_event_t::key && depth == 1) {
          const std::string k = parsed.get<std::string>();
          if (!seen.insert(k).second && duplicate.empty()) duplicate = k;
        }
        return true;
      });
    } catch (const Json::exception& e) {
      throw_error<CheckpointError>("'{}': the header is not valid UTF-8 JSON ({})", path_,
                                   e.what());
    }
    if (!duplicate.empty())
      throw_error<CheckpointError>("'{}': the header names tensor '{}' twice", path_, duplicate);
    if (!header.is_object())
      throw_error<CheckpointError>("'{}': the header is JSON but not an object", path_);
    for (const auto& [key, value] : header.items()) {
      if (key == "__metadata__") {
        if (!value.is_object())
          throw_error<CheckpointError>("'{}': \"__metadata__\" is not an object", path_);
        for (const auto& [mk, mv] : value.items()) {
          if (!mv.is_string())
            throw_error<CheckpointError>("'{}': \"__metadata__\" key '{}' is not a string", path_,
                                         mk);
          metadata_[mk] = mv.get<std::string>();
        }
        continue;
      }
      Entry e = parse_entry(path_, key, value);
      if (e.end > data_size)
        throw_error<CheckpointError>(
            "'{}': tensor '{}': data_offsets end at {}, past the {} bytes of data: truncated or "
            "corrupt",
            path_, key, e.end, data_size);
      entries_.push_back(std::move(e));
    }
    // The tensors must tile the data buffer exactly: no overlap, no hole, nothing left over (as
    // the reference implementation requires).
    std::vector<const Entry*> by_offset;
    for (const Entry& e : entries_) by_offset.push_back(&e);
    std::sort(by_offset.begin(), by_offset.end(), [](const Entry* a, const Entry* b) {
      return std::tie(a->begin, a->end) < std::tie(b->begin, b->end);
    });
    int64_t covered = 0;
    const Entry* prev = nullptr;
    for (const Entry* e : by_offset) {
      if (e->begin < covered)
        throw_error<CheckpointError>("'{}': tensors '{}' and '{}' overlap (bytes {} to {})", path_,
                                     prev->info.name, e->info.name, e->begin, covered);
      if (e->begin > covered)
        throw_error<CheckpointError>(
            "'{}': a hole in the data: bytes {} to {} belong to no tensor (before '{}')", path_,
            covered, e->begin, e->info.name);
      covered = e->end;
      prev = e;
    }
    if (covered != data_size)
      throw_error<CheckpointError>(
          "'{}': the tensors cover {} bytes of data but the file holds {}: corrupt", path_, covered,
          data_size);
    std::sort(entries_.begin(), entries_.end(),
              [](const Entry& a, const Entry& b) { return a.info.name < b.info.name; });
    for (size_t i = 0; i < entries_.size(); ++i) {
      list_.push_back(entries_[i].info);
      index_[entries_[i].info.name] = i;
    }
  }

  std::string path_;
  std::shared_ptr<Mapping> map_;
  int64_t data_offset_ = 0;
  std::vector<Entry> entries_;  // sorted by name
  std::vector<SourceTensor> list_;
  std::unordered_map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// A sharded set: the union of its shards' tensors.
class ShardedSource final : public TensorSource {
 public:
  explicit ShardedSource(const std::string& index_path) : path_(index_path) {
    Json index;
    const std::string text = files::read_text(index_path);
    try {
      index = Json::parse(text);
    } catch (const Json::exception& e) {
      throw_error<CheckpointError>("'{}': not valid JSON ({})", path_, e.what());
    }
    if (!index.is_object()) throw_error<CheckpointError>("'{}': not a JSON object", path_);
    const auto wm = index.find("weight_map");
    if (wm == index.end() || !wm->is_object())
      throw_error<CheckpointError>("'{}': no \"weight_map\" object", path_);
    if (const auto md = index.find("metadata"); md != index.end()) {
      if (!md->is_object())
        throw_error<CheckpointError>("'{}': \"metadata\" is not an object", path_);
      for (const auto& [k, v] : md->items())
        metadata_[k] = v.is_string() ? v.get<std::string>() : v.dump();
    }
    const fs::path dir = fs::path(index_path).parent_path();
    std::map<std::string, size_t> shard_of_file;
    for (const auto& [tensor, file] : wm->items()) {
      if (!file.is_string())
        throw_error<CheckpointError>("'{}': weight_map entry '{}' is not a file name", path_,
                                     tensor);
      const std::string rel = file.get<std::string>();
      if (shard_of_file.count(rel)) continue;
      check_relative(rel, tensor);
      shard_of_file[rel] = shards_.size();
      shards_.push_back(open_file((dir / rel).string()));
    }
    for (const auto& [tensor, file] : wm->items()) {
      const auto& shard = *shards_[shard_of_file.at(file.get<std::string>())];
      const auto& ts = shard.tensors();
      const bool held =
          std::binary_search(ts.begin(), ts.end(), tensor,
                             [](const auto& a, const auto& b) { return name_of(a) < name_of(b); });
      if (!held)
        throw_error<CheckpointError>("'{}': weight_map puts tensor '{}' in '{}', which lacks it",
                                     path_, tensor, shard.path());
    }
    for (size_t s = 0; s < shards_.size(); ++s) {
      for (const SourceTensor& t : shards_[s]->tensors()) {
        const auto [it, fresh] = owner_.emplace(t.name, s);
        if (!fresh)
          throw_error<CheckpointError>("'{}': tensor '{}' is in two shards, '{}' and '{}'", path_,
                                       t.name, shards_[it->second]->path(), shards_[s]->path());
        list_.push_back(t);
      }
    }
    std::sort(list_.begin(), list_.end(),
              [](const SourceTensor& a, const SourceTensor& b) { return a.name < b.name; });
  }

  const std::vector<SourceTensor>& tensors() const override { return list_; }
  at::Tensor read(const std::string& name) override {
    const auto it = owner_.find(name);
    if (it == owner_.end())
      throw_error<CheckpointError>("'{}': no tensor '{}' in this sharded set", path_, name);
    return shards_[it->second]->read(name);
  }
  std::string path() const override { return path_; }
  std::string format() const override { return "safetensors"; }
  std::map<std::string, std::string> metadata() const override { return metadata_; }

 private:
  static const std::string& name_of(const SourceTensor& t) { return t.name; }
  static const std::string& name_of(const std::string& s) { return s; }

  // A shard must lie inside the index's directory: no absolute path, no "..".
  void check_relative(const std::string& rel, const std::string& tensor) const {
    const fs::path p(rel);
    bool escapes = rel.empty() || p.is_absolute() || p.has_root_path();
    for (const auto& part : p)
      if (part == "..") escapes = true;
    if (escapes)
      throw_error<CheckpointError>(
          "'{}': shard '{}' (of tensor '{}') is not a path inside the index's directory", path_,
          rel, tensor);
  }

  std::string path_;
  std::vector<std::unique_ptr<TensorSource>> shards_;
  std::unordered_map<std::string, size_t> owner_;
  std::vector<SourceTensor> list_;
  std::map<std::string, std::string> metadata_;
};

// Writes all of `n` bytes or throws (a short write is retried; ENOSPC and the like are errors).
void write_all(int fd, const void* data, size_t n, const std::string& path) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t{1} << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      throw_error<IoError>("cannot write '{}': {}", path, errno_text(errno));
    }
    if (w == 0) throw_error<IoError>("cannot write '{}': the device took no bytes", path);
    p += w;
    n -= static_cast<size_t>(w);
  }
}

}  // namespace

std::optional<at::ScalarType> dtype_from_name(const std::string& name) {
  for (const auto& d : kDtypes)
    if (name == d.name) return d.dtype;
  return std::nullopt;
}

std::optional<std::string> dtype_name(at::ScalarType dtype) {
  for (const auto& d : kDtypes)
    if (dtype == d.dtype) return std::string(d.name);
  return std::nullopt;
}

std::unique_ptr<TensorSource> open_file(const std::string& path) {
  return std::make_unique<SafetensorsFile>(path);
}

std::unique_ptr<TensorSource> open_index(const std::string& index_path) {
  return std::make_unique<ShardedSource>(index_path);
}

std::pair<const void*, const void*> mapped_range(const TensorSource& source) {
  if (const auto* f = dynamic_cast<const SafetensorsFile*>(&source)) return f->range();
  return {nullptr, nullptr};
}

}  // namespace parallax::checkpoint::safetensors

namespace parallax::checkpoint {

int64_t write_safetensors(const std::string& path,
                          const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                          const std::map<std::string, std::string>& metadata) {
  using safetensors::Json;
  // Everything is checked before the file is created.
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return tensors[a].first < tensors[b].first; });
  nlohmann::ordered_json header;
  header["__metadata__"] = nlohmann::ordered_json::object();
  for (const auto& [k, v] : metadata) header["__metadata__"][k] = v;
  int64_t offset = 0;
  for (size_t k = 0; k < order.size(); ++k) {
    const auto& [name, t] = tensors[order[k]];
    if (k > 0 && tensors[order[k - 1]].first == name)
      throw_error<CheckpointError>("'{}': tensor '{}' is given twice", path, name);
    if (name == "__metadata__")
      throw_error<CheckpointError>("'{}': '__metadata__' cannot name a tensor", path);
    PARALLAX_CHECK(t.defined(), CheckpointError, "'{}': tensor '{}' is undefined", path, name);
    const auto dt = safetensors::dtype_name(t.scalar_type());
    if (!dt)
      throw_error<CheckpointError>("'{}': tensor '{}': dtype {} has no safetensors name here", path,
                                   name, c10::toString(t.scalar_type()));
    const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
    header[name] = {
        {"dtype", *dt}, {"shape", t.sizes().vec()}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t n = text.size();

  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  const std::string tmp =
      (dir / ("." + target.filename().string() + ".tmp." + files::random_hex(4))).string();
  files::Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
  if (fd.get() < 0)
    throw_error<IoError>("cannot create '{}': {}", tmp, safetensors::errno_text(errno));
  try {
    safetensors::write_all(fd.get(), &n, 8, path);
    safetensors::write_all(fd.get(), text.data(), text.size(), path);
    for (const size_t i : order) {
      const at::Tensor t = tensors[i].second.detach().to(at::kCPU).contiguous();
      if (t.numel() > 0) safetensors::write_all(fd.get(), t.const_data_ptr(), t.nbytes(), path);
    }
    if (::fsync(fd.get()) != 0)
      throw_error<IoError>("cannot sync '{}' to disk: {}", path, safetensors::errno_text(errno));
    if (::close(fd.release()) != 0)
      throw_error<IoError>("cannot close '{}': {}", path, safetensors::errno_text(errno));
    if (::rename(tmp.c_str(), path.c_str()) != 0)
      throw_error<IoError>("cannot rename '{}' to '{}': {}", tmp, path,
                           safetensors::errno_text(errno));
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  files::fsync_path(dir.string(), /*directory=*/true);
  return static_cast<int64_t>(8 + n + static_cast<uint64_t>(offset));
}

}  // namespace parallax::checkpoint
