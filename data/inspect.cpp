#include "data/inspect.h"

#include "core/error.h"
#include "core/progress.h"
#include "core/strings.h"
#include "data/dataset.h"
#include "data/shard.h"

#include <fmt/format.h>

#include <filesystem>
#include <vector>

namespace fs = std::filesystem;

namespace parallax::data {
namespace {

void say(std::FILE* out, const std::string& s) {
  std::fputs(s.c_str(), out);
  std::fputc('\n', out);
}

struct Histograms {
  std::vector<int64_t> bev, boxes, visible;
  int64_t scenes = 0;

  explicit Histograms(const DatasetInfo& info)
      : bev(info.bev_classes.size(), 0),
        boxes(info.box_classes.size(), 0),
        visible(info.box_classes.size(), 0) {}

  void add(const SceneRecord& s) {
    const at::Tensor sem = s.bev_semantics.contiguous();
    const uint8_t* p = sem.data_ptr<uint8_t>();
    for (int64_t i = 0; i < sem.numel(); ++i) {
      if (p[i] < bev.size()) ++bev[p[i]];
    }
    const at::Tensor b = s.boxes.contiguous();
    for (int64_t k = 0; k < b.size(0); ++k) {
      const float* row = b.data_ptr<float>() + k * kBoxColumns;
      const auto c = static_cast<size_t>(row[kBoxClass]);
      if (c < boxes.size()) {
        ++boxes[c];
        if (row[kBoxVisibility] > 0) ++visible[c];
      }
    }
    ++scenes;
  }

  void print(std::FILE* out, const DatasetInfo& info, const std::string& indent) const {
    int64_t cells = 0;
    for (int64_t v : bev) cells += v;
    std::vector<std::string> parts;
    for (size_t c = 0; c < bev.size(); ++c) {
      parts.push_back(
          fmt::format("{} {:.2f}%", info.bev_classes[c], cells ? 100.0 * bev[c] / cells : 0.0));
    }
    say(out, fmt::format("{}bev cells: {}", indent, core::join(parts, ", ")));
    parts.clear();
    int64_t total = 0;
    for (size_t c = 0; c < boxes.size(); ++c) {
      parts.push_back(fmt::format("{} {} ({} visible)", info.box_classes[c], boxes[c], visible[c]));
      total += boxes[c];
    }
    say(out, fmt::format("{}boxes: {} | {:.1f} per scene", indent, core::join(parts, ", "),
                         scenes ? static_cast<double>(total) / scenes : 0.0));
  }
};

std::string shapes_line(const ShardReader& shard, int64_t index) {
  std::vector<std::string> parts;
  const auto shapes = shard.shapes(index);
  for (const auto& name : scene_dataset_names())
    parts.push_back(name + " " + shapes.at(name).describe());
  std::string line = core::join(parts, ", ");
  // Where the scene sits in its sequence (docs/data.md, "Sequences"), when it does.
  const SequenceInfo seq = shard.sequence_info(index);
  if (seq.in_sequence()) {
    line += fmt::format(" | sequence {} frame {} prev {}", seq.sequence, seq.frame,
                        seq.prev_index < 0 ? std::string("-") : scene_name(seq.prev_index));
  }
  if (seq.timestamp_us >= 0) line += fmt::format(" t {} us", seq.timestamp_us);
  return line;
}

void print_scene_shapes(std::FILE* out, const ShardReader& shard, const InspectOptions& opts) {
  const auto& idx = shard.scene_indices();
  const auto n = static_cast<int64_t>(idx.size());
  const int64_t shown = std::min(n, opts.max_scene_lines);
  say(out, fmt::format("  per-scene shapes ({}):", fs::path(shard.path()).filename().string()));
  for (int64_t i = 0; i < shown; ++i) {
    say(out, fmt::format("    {}: {}", scene_name(idx[static_cast<size_t>(i)]),
                         shapes_line(shard, idx[static_cast<size_t>(i)])));
  }
  if (n > shown) say(out, fmt::format("    ... {} more scenes", n - shown));
}

void print_header(std::FILE* out, const DatasetInfo& info) {
  say(out, fmt::format("schema version: {}", info.schema_version));
  if (!info.generator.empty()) say(out, fmt::format("generator: {}", info.generator));
  say(out, fmt::format("cameras: {}, images {} x {} (H x W), stored {}", info.cameras,
                       info.image_height, info.image_width,
                       info.image_codec == "jpeg"
                           ? fmt::format("as JPEG (quality {}; every image decoded to verify)",
                                         info.jpeg_quality)
                           : std::string("raw")));
  const auto& g = info.bev;
  say(out, fmt::format("bev grid: {} x {} cells of {} m over x [{}, {}) y [{}, {})", g.x_cells(),
                       g.y_cells(), g.resolution, g.x_min, g.x_max, g.y_min, g.y_max));
  say(out, fmt::format("bev classes: {}", core::join(info.bev_classes, ", ")));
  say(out, fmt::format("box classes: {}", core::join(info.box_classes, ", ")));
  say(out, info.sequence_length > 1
               ? fmt::format("sequences: {} frames each, {} s apart", info.sequence_length,
                             info.frame_interval)
               : std::string("sequences: none declared (a converted dataset's scenes may still "
                             "link their previous frame: see the per-scene lines)"));
}

int64_t file_bytes(const std::string& path) {
  std::error_code ec;
  const auto n = fs::file_size(path, ec);
  return ec ? 0 : static_cast<int64_t>(n);
}

}  // namespace

void inspect_dataset(const std::string& dir, std::FILE* out, const InspectOptions& opts) {
  const DatasetInfo info = read_dataset_info(dir);
  say(out, fmt::format("dataset: {}", dir));
  print_header(out, info);
  for (const auto& [split, si] : info.splits) {
    const auto ds = Dataset::open(dir, split);
    int64_t bytes = 0;
    for (const auto& s : si.shards) bytes += file_bytes(join_path(dir, s));
    say(out, fmt::format("split {}: {} scenes in {} shard(s), {}", split, si.scenes,
                         si.shards.size(), core::human_bytes(static_cast<double>(bytes))));
    for (const auto& shard : ds->shards()) {
      const auto& idx = shard->scene_indices();
      say(out, fmt::format(
                   "  {}: {} scenes{}, {}", fs::path(shard->path()).filename().string(), idx.size(),
                   idx.empty()
                       ? ""
                       : fmt::format(" ({}..{})", scene_name(idx.front()), scene_name(idx.back())),
                   core::human_bytes(static_cast<double>(file_bytes(shard->path())))));
    }
    if (!ds->shards().empty()) print_scene_shapes(out, *ds->shards().front(), opts);
    if (!opts.verify) continue;
    Histograms h(info);
    core::Progress progress("inspect " + split + " scene", ds->size(), 5.0);
    for (int64_t i = 0; i < ds->size(); ++i) {
      h.add(ds->read(i));
      progress.update(i + 1);
    }
    say(out, fmt::format("  verified: all {} scenes read with consistent shapes", ds->size()));
    h.print(out, info, "  ");
  }
}

void inspect_shard(const std::string& path, std::FILE* out, const InspectOptions& opts) {
  const ShardReader shard(path);
  const fs::path dir = fs::path(path).parent_path();
  DatasetInfo info;
  bool from_json = false;
  if (fs::exists(dir / "dataset.json")) {
    info = read_dataset_info(dir.empty() ? "." : dir.string());
    for (const auto& [split, si] : info.splits) {
      for (const auto& s : si.shards)
        from_json = from_json || s == fs::path(path).filename().string();
    }
  }
  if (!from_json) info = infer_info(shard);
  say(out, fmt::format("shard: {} ({})", path,
                       core::human_bytes(static_cast<double>(file_bytes(path)))));
  say(out, from_json ? fmt::format("metadata: {}", (dir / "dataset.json").string())
                     : std::string("metadata: none found next to the shard; expected shapes taken "
                                   "from its first scene"));
  print_header(out, info);
  const auto& idx = shard.scene_indices();
  say(out, fmt::format("scenes: {}{}", idx.size(),
                       idx.empty() ? ""
                                   : fmt::format(" ({}..{})", scene_name(idx.front()),
                                                 scene_name(idx.back()))));
  print_scene_shapes(out, shard, opts);
  if (!opts.verify) return;
  Histograms h(info);
  core::Progress progress("inspect scene", static_cast<int64_t>(idx.size()), 5.0);
  for (size_t i = 0; i < idx.size(); ++i) {
    h.add(shard.read(idx[i], &info));
    progress.update(static_cast<int64_t>(i) + 1);
  }
  say(out, fmt::format("verified: all {} scenes read with consistent shapes", idx.size()));
  h.print(out, info, "");
}

}  // namespace parallax::data
