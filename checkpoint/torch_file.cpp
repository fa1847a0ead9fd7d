// torch.save zip files through PyTorchStreamReader and the restricted pickle reader.
#include "checkpoint/torch_file.h"

#include "checkpoint/pickle.h"
#include "core/error.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <unordered_map>

namespace parallax::checkpoint::torch_file {
namespace {

using pickle::Value;
using pickle::ValuePtr;

constexpr int kMaxDepth = 64;
constexpr int64_t kMaxVisits = 10'000'000;  // a pickle may share containers: bound the walk

std::string first_line(const char* text) {
  std::string s(text);
  const size_t eol = s.find('\n');
  return eol == std::string::npos ? s : s.substr(0, eol);
}

// The first bytes of `path` (fewer if the file is shorter); IoError if it cannot be read.
std::string head(const std::string& path, size_t n) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw_error<IoError>("cannot open '{}': {}", path, std::strerror(errno));
  std::string out(n, '\0');
  in.read(out.data(), static_cast<std::streamsize>(n));
  out.resize(static_cast<size_t>(in.gcount()));
  return out;
}

struct Entry {
  SourceTensor info;
  pickle::TensorRef ref;
};

class Source final : public TorchFileSource {
 public:
  explicit Source(const std::string& path) : path_(path) {
    const std::string magic = head(path, 4);
    if (magic != std::string("PK\x03\x04", 4)) {
      if (!magic.empty() && static_cast<uint8_t>(magic[0]) == 0x80)
        throw_error<CheckpointError>(
            "'{}': a torch.save file in the legacy (non-zip) format, which is not read: re-save it "
            "with a current torch.save (torch.save(torch.load(f), f))",
            path);
      throw_error<CheckpointError>("'{}': not a torch.save zip file (no zip magic)", path);
    }
    try {
      reader_ = std::make_unique<caffe2::serialize::PyTorchStreamReader>(path);
    } catch (const c10::Error& e) {
      throw_error<CheckpointError>(
          "'{}': not a readable torch.save zip file (truncated or corrupt?): {}", path,
          first_line(e.what_without_backtrace()));
    }
    std::string pkl;
    try {
      if (!reader_->hasRecord("data.pkl"))
        throw_error<CheckpointError>("'{}': a zip file without data.pkl, not a torch.save file",
                                     path);
      if (reader_->hasRecord("byteorder")) {
        const auto [ptr, n] = reader_->getRecord("byteorder");
        const std::string order(static_cast<const char*>(ptr.get()), n);
        if (order != "little")
          throw_error<CheckpointError>("'{}': saved with byte order '{}'; only little is read",
                                       path, order);
      }
      const auto [ptr, n] = reader_->getRecord("data.pkl");
      pkl.assign(static_cast<const char*>(ptr.get()), n);
    } catch (const c10::Error& e) {
      throw_error<CheckpointError>("'{}': cannot read its records (truncated or corrupt?): {}",
                                   path, first_line(e.what_without_backtrace()));
    }
    pickle::check_globals(pkl, path);
    const ValuePtr root = pickle::load(pkl, path);
    flatten(*root, "", 0);
    if (entries_.empty())
      throw_error<CheckpointError>("'{}': holds no tensor ({} other values)", path, skipped_);
    std::sort(entries_.begin(), entries_.end(),
              [](const Entry& a, const Entry& b) { return a.info.name < b.info.name; });
    for (size_t i = 0; i < entries_.size(); ++i) {
      if (i > 0 && entries_[i].info.name == entries_[i - 1].info.name)
        throw_error<CheckpointError>("'{}': two tensors are named '{}'", path,
                                     entries_[i].info.name);
      validate(entries_[i]);
      list_.push_back(entries_[i].info);
      index_[entries_[i].info.name] = i;
    }
  }

  const std::vector<SourceTensor>& tensors() const override { return list_; }
  at::Tensor read(const std::string& name) override {
    const auto it = index_.find(name);
    if (it == index_.end())
      throw_error<CheckpointError>("'{}': no tensor '{}' in this torch.save file", path_, name);
    const Entry& e = entries_[it->second];
    const auto opts = at::TensorOptions().dtype(e.info.dtype);
    const int64_t numel = c10::multiply_integers(e.info.shape);
    if (numel == 0) return at::empty(e.info.shape, opts);
    const std::string record = "data/" + e.ref.storage_key;
    at::Tensor bytes;
    try {
      const size_t n = reader_->getRecordSize(record);
      bytes = at::empty({static_cast<int64_t>(n)}, at::TensorOptions().dtype(at::kByte));
      reader_->getRecord(record, bytes.data_ptr(), n);
    } catch (const c10::Error& e2) {
      throw_error<IoError>("'{}': cannot read the storage of tensor '{}': {}", path_, name,
                           first_line(e2.what_without_backtrace()));
    }
    at::Tensor t =
        at::empty({0}, opts).set_(bytes.storage(), e.ref.offset, e.info.shape, e.ref.strides);
    // A view of part of a shared storage is copied out, so the whole storage is not kept alive.
    if (t.is_contiguous() && t.nbytes() == bytes.nbytes()) return t;
    return t.clone(at::MemoryFormat::Contiguous);
  }
  std::string path() const override { return path_; }
  std::string format() const override { return "torch.save"; }
  int64_t skipped() const override { return skipped_; }

 private:
  static std::string join(const std::string& prefix, const std::string& key) {
    return prefix.empty() ? key : prefix + "." + key;
  }

  void flatten(const Value& v, const std::string& name, int depth) {
    if (depth > kMaxDepth)
      throw_error<CheckpointError>("'{}': containers nested deeper than {} (at '{}')", path_,
                                   kMaxDepth, name);
    if (++visits_ > kMaxVisits)
      throw_error<CheckpointError>("'{}': more than {} values in the pickle", path_, kMaxVisits);
    switch (v.kind) {
      case Value::Kind::kTensor: {
        Entry e;
        e.info = {name, v.tensor.dtype, v.tensor.sizes};
        e.ref = v.tensor;
        entries_.push_back(std::move(e));
        break;
      }
      case Value::Kind::kDict:
        for (const auto& [k, value] : v.entries) {
          std::string key;
          if (k->kind == Value::Kind::kString)
            key = k->s;
          else if (k->kind == Value::Kind::kInt)
            key = std::to_string(k->i);
          else
            throw_error<CheckpointError>(
                "'{}': a dict under '{}' has a key that is not a string or an integer", path_,
                name);
          flatten(*value, join(name, key), depth + 1);
        }
        break;
      case Value::Kind::kList:
      case Value::Kind::kTuple:
        for (size_t i = 0; i < v.items.size(); ++i)
          flatten(*v.items[i], join(name, std::to_string(i)), depth + 1);
        break;
      default:
        ++skipped_;
    }
  }

  // The view must lie inside its storage record.
  void validate(const Entry& e) {
    const auto& r = e.ref;
    const std::string& name = e.info.name;
    const auto fail = [&](const std::string& what) {
      throw_error<CheckpointError>("'{}': tensor '{}': {}", path_, name, what);
    };
    if (r.sizes.size() != r.strides.size()) fail("size and stride differ in length");
    if (r.offset < 0) fail("a negative storage offset");
    int64_t last = r.offset, numel = 1;
    for (size_t d = 0; d < r.sizes.size(); ++d) {
      if (r.sizes[d] < 0 || r.strides[d] < 0) fail("a negative size or stride");
      if (__builtin_mul_overflow(numel, r.sizes[d], &numel)) fail("its size overflows");
      int64_t reach = 0;
      if (r.sizes[d] > 0 && (__builtin_mul_overflow(r.sizes[d] - 1, r.strides[d], &reach) ||
                             __builtin_add_overflow(last, reach, &last)))
        fail("its extent overflows");
    }
    if (numel == 0) return;
    const int64_t item = static_cast<int64_t>(c10::elementSize(e.info.dtype));
    int64_t end = 0;
    if (__builtin_mul_overflow(last + 1, item, &end) || end > r.storage_bytes)
      fail(fmt::format("its view reaches byte {} of a storage of {} bytes", end, r.storage_bytes));
    const std::string record = "data/" + r.storage_key;
    int64_t have = -1;
    try {
      if (reader_->hasRecord(record)) have = static_cast<int64_t>(reader_->getRecordSize(record));
    } catch (const c10::Error&) {
    }
    if (have < 0) fail(fmt::format("its storage record '{}' is missing", record));
    if (have < r.storage_bytes)
      fail(fmt::format("its storage record '{}' holds {} bytes, not the {} stated: truncated",
                       record, have, r.storage_bytes));
  }

  std::string path_;
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> reader_;
  std::vector<Entry> entries_;
  std::vector<SourceTensor> list_;
  std::unordered_map<std::string, size_t> index_;
  int64_t skipped_ = 0;
  int64_t visits_ = 0;
};

}  // namespace

std::unique_ptr<TorchFileSource> open(const std::string& path) {
  return std::make_unique<Source>(path);
}

bool is_torch_zip(const std::string& path) {
  try {
    if (head(path, 4) != std::string("PK\x03\x04", 4)) return false;
    caffe2::serialize::PyTorchStreamReader reader(path);
    return reader.hasRecord("data.pkl");
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace parallax::checkpoint::torch_file
