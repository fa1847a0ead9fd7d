#include "checkpoint/reader.h"

#include "checkpoint/checksum_error.h"
#include "checkpoint/files.h"
#include "checkpoint/finite.h"
#include "checkpoint/h5.h"
#include "checkpoint/shard_files.h"
#include "checkpoint/tensor_io.h"
#include "core/boxes.h"
#include "core/error.h"
#include "core/log.h"
#include "core/strings.h"

#include <ATen/ATen.h>
#include <c10/util/accumulate.h>
#include <fmt/ranges.h>
#include <zlib.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <tuple>

namespace fs = std::filesystem;

namespace parallax::checkpoint {
namespace {

using core::Box;

// Intersection of two boxes; false when empty.
bool intersect(const Box& s, const Box& r, Box& out) {
  const size_t nd = r.offsets.size();
  out.offsets.resize(nd);
  out.lengths.resize(nd);
  for (size_t d = 0; d < nd; ++d) {
    const int64_t lo = std::max(s.offsets[d], r.offsets[d]);
    const int64_t hi = std::min(s.offsets[d] + s.lengths[d], r.offsets[d] + r.lengths[d]);
    if (hi <= lo) return false;
    out.offsets[d] = lo;
    out.lengths[d] = hi - lo;
  }
  return true;
}

// Byte offset of box `s` inside the C-order image of box `r` when `s` (which lies inside `r`)
// occupies one contiguous run of it; -1 otherwise.
int64_t contiguous_offset(const Box& s, const Box& r, int64_t esize) {
  const size_t nd = r.lengths.size();
  size_t k = 0;  // last dimension where `s` is narrower than the box
  bool any = false;
  for (size_t d = 0; d < nd; ++d) {
    if (s.lengths[d] != r.lengths[d]) {
      k = d;
      any = true;
    }
  }
  if (any) {
    for (size_t d = 0; d < k; ++d) {
      if (s.lengths[d] != 1) return -1;
    }
  }
  int64_t lin = 0;
  for (size_t d = 0; d < nd; ++d) lin = lin * r.lengths[d] + (s.offsets[d] - r.offsets[d]);
  return lin * esize;
}

// A box of a tensor that one shard's dataset holds contiguously, in C order, from element `at`:
// a box shard is one part (its dataset has the box's shape, `at` 0); a flat shard is the boxes of
// its range in order (core::flat_range_boxes), each a run of its 1-D dataset.
struct Part {
  Box box;
  int64_t at = 0;
};

std::vector<Part> parts_of(const TensorInfo& t, const ShardInfo& s) {
  if (!s.flat) return {Part{Box{s.offsets, s.lengths}, 0}};
  std::vector<Part> out;
  int64_t at = 0;
  for (Box& b : core::flat_range_boxes(t.shape, s.flat->begin, s.flat->end)) {
    const int64_t n = b.numel();
    out.push_back(Part{std::move(b), at});
    at += n;
  }
  return out;
}

// Whether shard `s` of `t` may hold elements of box `r` (volume > 0): boxes by intersection, flat
// ranges by the span of `r` in the flattening (cheap, before decomposing the range into boxes).
bool may_overlap(const TensorInfo& t, const ShardInfo& s, const Box& r) {
  if (s.numel() == 0) return false;
  if (!s.flat) {
    Box in;
    return intersect(Box{s.offsets, s.lengths}, r, in);
  }
  int64_t first = 0, last = 0;
  for (size_t d = 0; d < t.shape.size(); ++d) {
    first = first * t.shape[d] + r.offsets[d];
    last = last * t.shape[d] + r.offsets[d] + r.lengths[d] - 1;
  }
  return s.flat->begin <= last && first < s.flat->end;
}

}  // namespace

struct CheckpointReader::Impl {
  std::string dir;
  Metadata meta;
  int64_t block_bytes = 64 << 20;
  std::optional<ShardFiles> shard_files;  // set once the metadata is read
  // A shard is (file, tensor, piece): a rank file may hold several pieces of one tensor.
  using ShardKey = std::tuple<std::string, std::string, int>;
  static ShardKey key_of(const TensorInfo& t, const ShardInfo& s) {
    return {s.file, t.name, s.piece};
  }
  std::set<ShardKey> verified;  // shards whose checksum matched
  // A flat shard touched by the load in progress: the checksums of its parts read whole.
  struct FlatCheck {
    const TensorInfo* t = nullptr;
    const ShardInfo* s = nullptr;
    std::vector<std::optional<uint32_t>> crcs;
  };
  std::map<ShardKey, FlatCheck> flat_checks;
  ReadStats stats;

  void fail_checksum(const TensorInfo& t, const ShardInfo& s, uint32_t got) const {
    // Piece k > 0 of a tensor in its file is named by its dataset (the others by the tensor).
    const std::string piece =
        s.piece > 0 ? fmt::format(", dataset '{}'", piece_dataset(t.name, s.piece)) : "";
    throw_error<ChecksumError>(
        "checkpoint '{}': checksum mismatch in shard file '{}' for tensor '{}' ({}{}): crc32 "
        "{:08x} recorded, {:08x} read; the file is corrupt",
        dir, s.file, t.name, s.describe(), piece, s.crc32, got);
  }

  // Streams shard `s` in blocks and checks its crc32; with `nonfinite`, adds the shard's NaN and
  // infinity counts to it.
  void verify_shard(const TensorInfo& t, const ShardInfo& s, bool extra,
                    NonFiniteCount* nonfinite = nullptr) {
    if (s.numel() == 0 || verified.count(key_of(t, s))) return;
    const bool scan = nonfinite != nullptr && can_be_nonfinite(t.dtype);
    h5::Id d = shard_files->dataset(t, s);
    const hid_t type = h5::storage_type(t.dtype, t.name);
    const int64_t esize = static_cast<int64_t>(c10::elementSize(t.dtype));
    const int64_t budget = std::min<int64_t>(block_bytes, s.numel() * esize);
    std::vector<uint8_t> buf(static_cast<size_t>(budget));
    uint32_t crc = 0;
    const std::vector<int64_t> dims = s.stored_dims();
    h5::for_each_block(dims, esize, budget, [&](const h5::Block& b) {
      herr_t rc;
      if (dims.empty()) {
        rc = H5Dread(d, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf.data());
      } else {
        h5::Id fspace(H5Dget_space(d));
        h5::Id mspace = h5::make_space(b.count);
        rc = H5Sselect_hyperslab(fspace, H5S_SELECT_SET, b.start.data(), nullptr, b.count.data(),
                                 nullptr);
        if (rc >= 0) rc = H5Dread(d, type, mspace, fspace, H5P_DEFAULT, buf.data());
      }
      if (rc < 0) {
        h5::fail<CheckpointError>(fmt::format(
            "checkpoint '{}': cannot read tensor '{}' from shard file '{}'", dir, t.name, s.file));
      }
      crc = tensor_io::crc32_update(crc, buf.data(), b.bytes, /*parallel=*/true);
      if (scan && !all_finite(buf.data(), b.bytes / esize, t.dtype, /*parallel=*/true)) {
        const NonFiniteCount c = count_nonfinite(
            at::from_blob(buf.data(), {b.bytes / esize}, at::TensorOptions().dtype(t.dtype)));
        nonfinite->nan += c.nan;
        nonfinite->inf += c.inf;
      }
    });
    stats.bytes_verified += s.numel() * esize;
    if (extra) stats.extra_bytes += s.numel() * esize;
    if (crc != s.crc32) fail_checksum(t, s, crc);
    verified.insert(key_of(t, s));
  }

  // Reads box `r` of `t` into `host` (contiguous CPU, t.dtype, shape r.lengths). With
  // verification, a box shard read whole is checked on the bytes read, one read in part is
  // streamed whole (verify_shard); the parts of a flat shard read whole are checksummed as read
  // and the shard is checked once the load has read all it will (finish_flat_checks).
  void read_box(const TensorInfo& t, const Box& r, const at::Tensor& host, const ReadOptions& opt) {
    const int64_t esize = static_cast<int64_t>(c10::elementSize(t.dtype));
    const hid_t type = h5::storage_type(t.dtype, t.name);
    auto* base = static_cast<uint8_t*>(host.data_ptr());
    int64_t covered = 0;
    for (const ShardInfo& s : t.shards) {
      if (!may_overlap(t, s, r)) continue;
      h5::Id d = shard_files->dataset(t, s);
      if (s.flat) {
        covered += read_flat(d, type, t, s, r, base, esize, opt);
        continue;
      }
      Box in;
      const Box sb{s.offsets, s.lengths};
      intersect(sb, r, in);
      herr_t rc;
      if (r.lengths.empty()) {
        rc = H5Dread(d, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, base);
      } else {
        std::vector<hsize_t> fstart(in.offsets.size()), mstart(in.offsets.size());
        for (size_t k = 0; k < in.offsets.size(); ++k) {
          fstart[k] = static_cast<hsize_t>(in.offsets[k] - s.offsets[k]);
          mstart[k] = static_cast<hsize_t>(in.offsets[k] - r.offsets[k]);
        }
        const std::vector<hsize_t> count = h5::to_hsize(in.lengths);
        h5::Id fspace(H5Dget_space(d));
        h5::Id mspace = h5::make_space(h5::to_hsize(r.lengths));
        rc = H5Sselect_hyperslab(fspace, H5S_SELECT_SET, fstart.data(), nullptr, count.data(),
                                 nullptr);
        if (rc >= 0)
          rc = H5Sselect_hyperslab(mspace, H5S_SELECT_SET, mstart.data(), nullptr, count.data(),
                                   nullptr);
        if (rc >= 0) rc = H5Dread(d, type, mspace, fspace, H5P_DEFAULT, base);
      }
      if (rc < 0) fail_read(t, s);
      covered += c10::multiply_integers(in.lengths);
      if (!opt.verify || verified.count(key_of(t, s))) continue;
      const bool whole = in.lengths == s.lengths;
      const int64_t off = whole ? contiguous_offset(sb, r, esize) : -1;
      if (off >= 0) {
        const int64_t n = s.numel() * esize;
        const uint32_t crc = tensor_io::crc32_update(0, base + off, n, /*parallel=*/true);
        stats.bytes_verified += n;
        if (crc != s.crc32) fail_checksum(t, s, crc);
        verified.insert(key_of(t, s));
      } else {
        verify_shard(t, s, /*extra=*/true);
      }
    }
    if (covered != c10::multiply_integers(r.lengths)) {
      throw_error<CheckpointError>(
          "checkpoint '{}': the shards of tensor '{}' cover {} of the {} elements of box {} x {}",
          dir, t.name, covered, c10::multiply_integers(r.lengths), r.offsets, r.lengths);
    }
    stats.bytes_read += c10::multiply_integers(r.lengths) * esize;
  }

  [[noreturn]] void fail_read(const TensorInfo& t, const ShardInfo& s) const {
    h5::fail<CheckpointError>(fmt::format(
        "checkpoint '{}': cannot read tensor '{}' from shard file '{}'", dir, t.name, s.file));
  }

  // The parts of flat shard `s` (dataset `d`) that overlap box `r`, into `base` (the C-order image
  // of `r`); returns the elements read. Only the overlap is read: in the 1-D dataset, the
  // overlap of a part and `r` is `count` runs of `block` contiguous elements at a fixed stride,
  // once per index of the dimensions before those (one hyperslab read per index; a single read for
  // whole tensors, flat ranges of any layout, and splits along one dimension).
  int64_t read_flat(hid_t d, hid_t type, const TensorInfo& t, const ShardInfo& s, const Box& r,
                    uint8_t* base, int64_t esize, const ReadOptions& opt) {
    const std::vector<Part> parts = parts_of(t, s);
    const size_t n = t.shape.size();
    int64_t covered = 0;
    for (size_t k = 0; k < parts.size(); ++k) {
      const Part& p = parts[k];
      Box in;
      if (!intersect(p.box, r, in)) continue;
      std::vector<int64_t> stride(n, 1);  // the part's C-order strides, in elements
      for (size_t q = n; q-- > 1;) stride[q - 1] = stride[q] * p.box.lengths[q];
      // Dimensions [m, n) of the overlap are one contiguous run of the part: every dimension
      // after m is whole in the part.
      size_t m = 0;
      int64_t block = 1;
      if (n > 0) {
        m = n - 1;
        block = in.lengths[m];
        while (m > 0 && in.lengths[m] == p.box.lengths[m]) {
          --m;
          block *= in.lengths[m];
        }
      }
      const size_t j = m > 0 ? m - 1 : 0;  // the strided dimension (none when m == 0)
      const hsize_t count = m > 0 ? static_cast<hsize_t>(in.lengths[j]) : 1;
      const hsize_t step = count > 1 ? static_cast<hsize_t>(stride[j]) : 1;
      const hsize_t run = static_cast<hsize_t>(block);
      std::vector<int64_t> idx(j, 0);  // the index into the overlap's dimensions before j
      for (;;) {
        int64_t start = p.at;
        for (size_t q = 0; q < n; ++q)
          start += (in.offsets[q] - p.box.offsets[q] + (q < j ? idx[q] : 0)) * stride[q];
        h5::Id fspace(H5Dget_space(d));
        const hsize_t fstart = static_cast<hsize_t>(start);
        herr_t rc = H5Sselect_hyperslab(fspace, H5S_SELECT_SET, &fstart, &step, &count, &run);
        h5::Id mspace = h5::make_space(h5::to_hsize(r.lengths));
        if (rc >= 0 && n > 0) {
          std::vector<hsize_t> mstart(n), mcount(n);
          for (size_t q = 0; q < n; ++q) {
            mstart[q] = static_cast<hsize_t>(in.offsets[q] - r.offsets[q] + (q < j ? idx[q] : 0));
            mcount[q] = static_cast<hsize_t>(q < j ? 1 : in.lengths[q]);
          }
          rc = H5Sselect_hyperslab(mspace, H5S_SELECT_SET, mstart.data(), nullptr, mcount.data(),
                                   nullptr);
        }
        if (rc >= 0) rc = H5Dread(d, type, mspace, fspace, H5P_DEFAULT, base);
        if (rc < 0) fail_read(t, s);
        size_t q = j;  // next index of the dimensions before j, last fastest
        while (q > 0 && ++idx[q - 1] == in.lengths[q - 1]) idx[--q] = 0;
        if (q == 0) break;
      }
      covered += c10::multiply_integers(in.lengths);
      if (!opt.verify || verified.count(key_of(t, s))) continue;
      FlatCheck& c = flat_checks[key_of(t, s)];
      if (c.crcs.empty()) {
        c.t = &t;
        c.s = &s;
        c.crcs.resize(parts.size());
      }
      const int64_t off =
          in.lengths == p.box.lengths ? contiguous_offset(p.box, r, esize) : int64_t{-1};
      if (off >= 0) {
        const int64_t bytes = p.box.numel() * esize;
        c.crcs[k] = tensor_io::crc32_update(0, base + off, bytes, /*parallel=*/true);
        stats.bytes_verified += bytes;
      }
    }
    return covered;
  }

  // Checks the flat shards a load read from: by their parts' checksums when every part was read
  // whole (crc32_combine, no extra I/O), else by streaming the shard (verify_shard).
  void finish_flat_checks() {
    std::map<ShardKey, FlatCheck> checks;
    checks.swap(flat_checks);
    for (const auto& [key, c] : checks) {
      if (verified.count(key)) continue;
      const bool all = std::all_of(c.crcs.begin(), c.crcs.end(),
                                   [](const std::optional<uint32_t>& x) { return x.has_value(); });
      if (!all) {
        verify_shard(*c.t, *c.s, /*extra=*/true);
        continue;
      }
      const int64_t esize = static_cast<int64_t>(c10::elementSize(c.t->dtype));
      const std::vector<Part> parts = parts_of(*c.t, *c.s);
      uint32_t crc = *c.crcs[0];
      for (size_t k = 1; k < parts.size(); ++k) {
        crc = static_cast<uint32_t>(
            crc32_combine(crc, *c.crcs[k], static_cast<z_off_t>(parts[k].box.numel() * esize)));
      }
      if (crc != c.s->crc32) fail_checksum(*c.t, *c.s, crc);
      verified.insert(key);
    }
  }

  const TensorInfo& info(const std::string& name) const {
    if (const TensorInfo* t = meta.find(name)) return *t;
    std::vector<std::string> names;
    for (const auto& [n, t] : meta.tensors) names.push_back(n);
    throw_error<CheckpointError>("checkpoint '{}' has no tensor '{}'{}", dir, name,
                                 core::did_you_mean(name, names));
  }

  // Problems of one target that can be found without reading data; "" when none.
  std::string check_target(const LoadTarget& tg, const ReadOptions& opt) const {
    const TensorInfo* t = meta.find(tg.name);
    if (!t) return fmt::format("tensor '{}' is not in the checkpoint", tg.name);
    if (!tg.dest.defined())
      return fmt::format("tensor '{}': the destination is undefined", tg.name);
    const std::vector<int64_t> len = tg.dest.sizes().vec();
    const std::vector<int64_t> off =
        tg.offsets.empty() ? std::vector<int64_t>(len.size(), 0) : tg.offsets;
    if (tg.offsets.empty() && len != t->shape) {
      return fmt::format("tensor '{}': the checkpoint holds shape {}, the destination has shape {}",
                         tg.name, t->shape, len);
    }
    if (len.size() != t->shape.size() || off.size() != t->shape.size()) {
      return fmt::format(
          "tensor '{}': the checkpoint holds shape {}, the destination has shape {} (at offsets "
          "{})",
          tg.name, t->shape, len, off);
    }
    for (size_t d = 0; d < len.size(); ++d) {
      if (off[d] < 0 || off[d] + len[d] > t->shape[d]) {
        return fmt::format(
            "tensor '{}': the checkpoint holds shape {}, the destination box {} at offsets {} does "
            "not fit in it",
            tg.name, t->shape, len, off);
      }
    }
    if (tg.dest.scalar_type() != t->dtype && !opt.allow_cast) {
      return fmt::format("tensor '{}': the checkpoint holds {}, the destination is {}", tg.name,
                         dtype_name(t->dtype), dtype_name(tg.dest.scalar_type()));
    }
    return "";
  }

  void read_into(const LoadTarget& tg, const ReadOptions& opt) {
    const TensorInfo& t = info(tg.name);
    Box r;
    r.lengths = tg.dest.sizes().vec();
    r.offsets = tg.offsets.empty() ? std::vector<int64_t>(r.lengths.size(), 0) : tg.offsets;
    if (c10::multiply_integers(r.lengths) == 0) return;
    const bool direct =
        tg.dest.is_cpu() && tg.dest.is_contiguous() && tg.dest.scalar_type() == t.dtype;
    if (direct) {
      read_box(t, r, tg.dest, opt);
      return;
    }
    at::Tensor host = at::empty(r.lengths, at::TensorOptions().dtype(t.dtype));
    read_box(t, r, host, opt);
    at::NoGradGuard no_grad;
    tg.dest.copy_(host);
  }
};

std::vector<LoadTarget> flat_load_targets(const std::string& name, const at::Tensor& flat,
                                          const std::vector<int64_t>& shape, int64_t begin) {
  PARALLAX_CHECK(flat.defined() && flat.dim() == 1, CheckpointError,
                 "tensor '{}': a flat range loads into a 1-D tensor, got {}", name,
                 flat.defined() ? fmt::format("shape {}", flat.sizes().vec()) : "none");
  const int64_t total = c10::multiply_integers(shape);
  PARALLAX_CHECK(begin >= 0 && begin + flat.numel() <= total, CheckpointError,
                 "tensor '{}': flat range [{}, {}) lies outside its {} elements (shape {})", name,
                 begin, begin + flat.numel(), total, shape);
  std::vector<LoadTarget> out;
  int64_t at = 0;
  for (const Box& b : core::flat_range_boxes(shape, begin, begin + flat.numel())) {
    out.push_back(LoadTarget{name, flat.narrow(0, at, b.numel()).view(b.lengths), b.offsets});
    at += b.numel();
  }
  return out;
}

CheckpointReader::CheckpointReader(const std::string& path, int64_t block_bytes)
    : impl_(std::make_unique<Impl>()) {
  Impl& I = *impl_;
  I.dir = resolve_checkpoint(path);
  I.block_bytes = std::max<int64_t>(block_bytes, 4096);
  const std::string mpath = (fs::path(I.dir) / kMetadataFile).string();
  std::string text;
  try {
    text = files::read_text(mpath);
  } catch (const IoError& e) {
    throw_error<CheckpointError>("checkpoint '{}': {}", I.dir, e.what());
  }
  I.meta = Metadata::from_json(text, mpath);
  I.shard_files.emplace(I.dir, I.meta.files);
  // A step directory holds the step it is named for (the commit names it from the same step).
  fs::path d = fs::path(I.dir).lexically_normal();
  if (d.filename().empty()) d = d.parent_path();
  if (const auto named = parse_step_dir_name(d.filename().string());
      named && *named != I.meta.step) {
    throw_error<CheckpointError>(
        "'{}': metadata.json records step {} but its directory is named for step {}", mpath,
        I.meta.step, *named);
  }
}

CheckpointReader::~CheckpointReader() = default;

const std::string& CheckpointReader::dir() const {
  return impl_->dir;
}
const Metadata& CheckpointReader::metadata() const {
  return impl_->meta;
}
bool CheckpointReader::contains(const std::string& name) const {
  return impl_->meta.find(name) != nullptr;
}
const TensorInfo& CheckpointReader::info(const std::string& name) const {
  return impl_->info(name);
}
const ReadStats& CheckpointReader::stats() const {
  return impl_->stats;
}

std::vector<std::string> CheckpointReader::names(const std::string& prefix) const {
  std::vector<std::string> out;
  for (const auto& [n, t] : impl_->meta.tensors) {
    if (core::starts_with(n, prefix)) out.push_back(n);
  }
  return out;
}

void CheckpointReader::load(const std::vector<LoadTarget>& targets, const ReadOptions& options) {
  Impl& I = *impl_;
  std::vector<std::string> problems;
  for (const auto& tg : targets) {
    std::string p = I.check_target(tg, options);
    if (!p.empty()) problems.push_back(std::move(p));
  }
  if (!problems.empty()) {
    const size_t shown = std::min<size_t>(problems.size(), 20);
    throw_error<CheckpointError>(
        "checkpoint '{}': {} problem(s), nothing was loaded: {}{}", I.dir, problems.size(),
        core::join(std::vector<std::string>(problems.begin(), problems.begin() + shown), "; "),
        problems.size() > shown ? "; ..." : "");
  }
  // Every file and dataset the targets touch: present, right size and shape.
  for (const auto& tg : targets) {
    const TensorInfo& t = I.info(tg.name);
    Box r;
    r.lengths = tg.dest.sizes().vec();
    r.offsets = tg.offsets.empty() ? std::vector<int64_t>(r.lengths.size(), 0) : tg.offsets;
    if (c10::multiply_integers(r.lengths) == 0) continue;
    for (const ShardInfo& s : t.shards) {
      if (may_overlap(t, s, r)) I.shard_files->dataset(t, s);
    }
  }
  I.flat_checks.clear();
  for (const auto& tg : targets) I.read_into(tg, options);
  I.finish_flat_checks();
}

void CheckpointReader::read(const std::string& name, const at::Tensor& dest,
                            const std::vector<int64_t>& offsets, const ReadOptions& options) {
  load({LoadTarget{name, dest, offsets}}, options);
}

at::Tensor CheckpointReader::read(const std::string& name, const ReadOptions& options) {
  const TensorInfo& t = impl_->info(name);
  at::Tensor out = at::empty(t.shape, at::TensorOptions().dtype(t.dtype));
  read(name, out, {}, options);
  return out;
}

std::optional<std::string> CheckpointReader::config_text() {
  Impl& I = *impl_;
  if (!I.meta.config) return std::nullopt;
  const SideFile& c = *I.meta.config;
  const std::string p = I.shard_files->path_of(c.name);
  if (files::file_size(p) < 0)
    throw_error<CheckpointError>("checkpoint '{}': '{}' (the run's config) is missing", I.dir, p);
  const std::string text = files::read_text(p);
  const uint32_t crc =
      tensor_io::crc32_update(0, text.data(), static_cast<int64_t>(text.size()), false);
  if (static_cast<int64_t>(text.size()) != c.bytes || crc != c.crc32) {
    throw_error<CheckpointError>(
        "checkpoint '{}': '{}' does not match metadata.json ({} bytes, crc32 {:08x} on disk; {} "
        "bytes, crc32 {:08x} recorded): it was edited or is corrupt",
        I.dir, p, text.size(), crc, c.bytes, c.crc32);
  }
  return text;
}

int64_t CheckpointReader::verify_all(const std::function<bool(const TensorInfo&)>& filter,
                                     std::vector<NonFiniteTensor>* nonfinite,
                                     const std::function<bool(const ShardInfo&)>& shard_filter) {
  Impl& I = *impl_;
  for (const FileInfo& f : I.meta.files) I.shard_files->check_file(f.name, "");
  config_text();
  int64_t bytes = 0;
  for (const auto& [name, t] : I.meta.tensors) {
    if (filter && !filter(t)) continue;
    NonFiniteTensor bad{name, 0, 0, {}};
    for (const ShardInfo& s : t.shards) {
      if (shard_filter && !shard_filter(s)) continue;
      I.verified.erase(I.key_of(t, s));
      NonFiniteCount c;
      I.verify_shard(t, s, /*extra=*/false, nonfinite ? &c : nullptr);
      if (c.any()) {
        bad.nan += c.nan;
        bad.inf += c.inf;
        // A file holding several pieces of the tensor is named once.
        if (std::find(bad.files.begin(), bad.files.end(), s.file) == bad.files.end())
          bad.files.push_back(s.file);
      }
      bytes += s.numel() * static_cast<int64_t>(c10::elementSize(t.dtype));
    }
    if (nonfinite && (bad.nan > 0 || bad.inf > 0)) nonfinite->push_back(std::move(bad));
  }
  return bytes;
}

}  // namespace parallax::checkpoint
