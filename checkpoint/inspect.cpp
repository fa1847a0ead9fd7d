#include "checkpoint/inspect.h"

#include "checkpoint/reader.h"
#include "core/error.h"
#include "core/strings.h"
#include "core/timer.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

namespace parallax::checkpoint {

std::string inspect(const std::string& path, std::ostream& out, const InspectOptions& options) {
  CheckpointReader reader(path);
  const Metadata& m = reader.metadata();
  int64_t file_bytes = 0;
  for (const auto& f : m.files) file_bytes += f.bytes;
  int64_t tensor_bytes = 0;
  std::map<std::string, std::pair<int64_t, int64_t>>
      groups;  // top-level prefix -> (tensors, bytes)
  for (const auto& [name, t] : m.tensors) {
    tensor_bytes += t.nbytes();
    const auto slash = name.find('/');
    auto& g = groups[slash == std::string::npos ? std::string("(root)") : name.substr(0, slash)];
    g.first += 1;
    g.second += t.nbytes();
  }
  out << fmt::format("checkpoint {}\n", reader.dir());
  out << fmt::format("  format version {}, step {}, created {}\n", m.format_version, m.step,
                     m.created.empty() ? "?" : m.created);
  out << fmt::format("  layout {} (world {}), config hash {}\n", m.layout.to_string(), m.world,
                     m.config_hash.empty() ? "(none)" : m.config_hash);
  out << fmt::format("  files: {} ({})\n", m.files.size(),
                     core::human_bytes(static_cast<double>(file_bytes)));
  out << fmt::format("  config: {}\n",
                     m.config ? fmt::format("{} ({} bytes)", m.config->name, m.config->bytes)
                              : std::string("(not saved with the checkpoint)"));
  out << fmt::format("  tensors: {} ({})", m.tensors.size(),
                     core::human_bytes(static_cast<double>(tensor_bytes)));
  for (const auto& [g, v] : groups) {
    out << fmt::format("; {} {} ({})", g, v.first,
                       core::human_bytes(static_cast<double>(v.second)));
  }
  out << "\n";
  if (!m.extra.empty()) {
    out << "  extra:\n";
    for (const auto& [k, v] : m.extra) {
      std::visit([&](const auto& x) { out << fmt::format("    {} = {}\n", k, x); }, v);
    }
  }
  if (options.list_tensors) {
    size_t width = 4;
    for (const auto& [name, t] : m.tensors) width = std::max(width, name.size());
    // The shards column says "4 flat" when the pieces are flat ranges of the tensor (ZeRO).
    out << fmt::format("  {:<{}}  {:<9} {:<20} {:>8} {:>10}\n", "name", width, "dtype", "shape",
                       "shards", "size");
    for (const auto& [name, t] : m.tensors) {
      const auto flat = std::count_if(t.shards.begin(), t.shards.end(),
                                      [](const ShardInfo& s) { return s.is_flat(); });
      const std::string shards =
          flat == 0 ? fmt::format("{}", t.shards.size())
                    : (static_cast<size_t>(flat) == t.shards.size()
                           ? fmt::format("{} flat", flat)
                           : fmt::format("{}+{} flat", t.shards.size() - flat, flat));
      out << fmt::format("  {:<{}}  {:<9} {:<20} {:>8} {:>10}\n", name, width, dtype_name(t.dtype),
                         fmt::format("{}", t.shape), shards,
                         core::human_bytes(static_cast<double>(t.nbytes())));
      if (options.list_shards) {
        for (const auto& s : t.shards) {
          // Piece k > 0 of the tensor in its file: the dataset it is stored under (format.h).
          const std::string dataset =
              s.piece > 0 ? fmt::format(" dataset {}", piece_dataset(name, s.piece)) : "";
          if (s.flat) {
            out << fmt::format("      {} flat [{}, {}) ({} elements) crc32 {:08x}{}\n", s.file,
                               s.flat->begin, s.flat->end, s.numel(), s.crc32, dataset);
          } else {
            out << fmt::format("      {} offsets {} lengths {} crc32 {:08x}{}\n", s.file, s.offsets,
                               s.lengths, s.crc32, dataset);
          }
        }
      }
    }
  }
  out.flush();
  if (options.verify) {
    core::Stopwatch sw;
    std::vector<NonFiniteTensor> nonfinite;
    const int64_t bytes = reader.verify_all(nullptr, &nonfinite);
    size_t shards = 0;
    for (const auto& [name, t] : m.tensors) shards += t.shards.size();
    for (const auto& t : nonfinite) {
      out << fmt::format("  non-finite: {}: {} NaN, {} inf (in {})\n", t.name, t.nan, t.inf,
                         core::join(t.files, ", "));
    }
    out << fmt::format("  verified: {} shards in {} files, {} checksummed in {:.2f} s: {}\n",
                       shards, m.files.size(), core::human_bytes(static_cast<double>(bytes)),
                       sw.elapsed_s(), nonfinite.empty() ? "OK" : "NOT OK");
    out.flush();
    if (!nonfinite.empty()) {
      std::vector<std::string> names;
      for (const auto& t : nonfinite) names.push_back(t.name);
      const size_t shown = std::min<size_t>(names.size(), 5);
      throw_error<CheckpointError>(
          "checkpoint '{}' (step {}): {} tensor(s) hold NaN or infinite values: {}{}; do not "
          "resume or export from it",
          reader.dir(), m.step, names.size(),
          core::join(std::vector<std::string>(names.begin(), names.begin() + shown), ", "),
          names.size() > shown ? ", ..." : "");
    }
  } else {
    out << "  not verified (--quick): checksums and finiteness unchecked\n";
  }
  return reader.dir();
}

}  // namespace parallax::checkpoint
