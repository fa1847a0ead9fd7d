// Which reader a path needs (by name, directory layout and magic bytes), and the dispatch to it.
#include "checkpoint/tensor_source.h"

#include "checkpoint/safetensors.h"
#include "checkpoint/torch_file.h"
#include "core/error.h"

#include <cstring>
#include <filesystem>
#include <fstream>

namespace fs = std::filesystem;

namespace parallax::checkpoint {
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

constexpr const char* kIndexSuffix = ".safetensors.index.json";
constexpr const char* kHfFile = "model.safetensors";
constexpr const char* kHfIndex = "model.safetensors.index.json";

// A safetensors file under another name: 8-byte header length, then '{'.
bool looks_like_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char b[9] = {};
  if (!in.read(b, 9)) return false;
  uint64_t n = 0;
  std::memcpy(&n, b, 8);
  return b[8] == '{' && n >= 2 && n <= static_cast<uint64_t>(safetensors::kMaxHeaderBytes);
}

}  // namespace

bool is_tensor_source(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec))
    return fs::is_regular_file(fs::path(path) / kHfFile, ec) ||
           fs::is_regular_file(fs::path(path) / kHfIndex, ec);
  if (!fs::is_regular_file(path, ec)) return false;
  for (const char* suffix : {".safetensors", kIndexSuffix, ".pt", ".pth", ".bin", ".ckpt"})
    if (ends_with(path, suffix)) return true;
  return torch_file::is_torch_zip(path);
}

std::unique_ptr<TensorSource> open_tensor_source(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    const fs::path dir(path);
    if (fs::exists(dir / kHfFile, ec)) return safetensors::open_file((dir / kHfFile).string());
    if (fs::exists(dir / kHfIndex, ec)) return safetensors::open_index((dir / kHfIndex).string());
    throw_error<CheckpointError>("'{}': a directory without {} or {}", path, kHfFile, kHfIndex);
  }
  if (!fs::exists(path, ec)) throw_error<IoError>("cannot open '{}': no such file", path);
  if (ends_with(path, kIndexSuffix)) return safetensors::open_index(path);
  if (ends_with(path, ".safetensors")) return safetensors::open_file(path);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw_error<IoError>("cannot open '{}': {}", path, std::strerror(errno));
  char magic[4] = {};
  in.read(magic, 4);
  if (in.gcount() == 4 && std::memcmp(magic, "PK\x03\x04", 4) == 0) return torch_file::open(path);
  if (in.gcount() >= 1 && static_cast<uint8_t>(magic[0]) == 0x80) return torch_file::open(path);
  if (looks_like_safetensors(path)) return safetensors::open_file(path);
  throw_error<CheckpointError>(
      "'{}': neither a safetensors file nor a torch.save zip file (no known magic bytes)", path);
}

}  // namespace parallax::checkpoint
