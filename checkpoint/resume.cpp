// Resume points (checkpoint/resume.h): which checkpoint train.resume=auto trusts, and the checks
// that decide it (cheap ones on every candidate, the shards' checksums on the one chosen).
#include "checkpoint/resume.h"

#include "checkpoint/files.h"
#include "checkpoint/format.h"
#include "checkpoint/reader.h"
#include "core/error.h"
#include "core/log.h"
#include "core/strings.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <utility>

namespace fs = std::filesystem;

namespace parallax::checkpoint {

std::string checkpoint_problem(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return fmt::format("'{}' does not exist", dir);
  if (files::file_size((fs::path(dir) / kMetadataFile).string()) < 0)
    return fmt::format("'{}' has no {} (an incomplete or damaged checkpoint)", dir, kMetadataFile);
  try {
    CheckpointReader r(dir);  // metadata.json: its checksum, and the step of its directory
    r.config_text();          // config.yaml against its record
    for (const FileInfo& f : r.metadata().files) {
      const std::string path = (fs::path(r.dir()) / f.name).string();
      const int64_t size = files::file_size(path);
      if (size < 0)
        return fmt::format("checkpoint '{}': shard file '{}' (rank {}) is missing", dir, f.name,
                           f.rank);
      if (size != f.bytes) {
        return fmt::format(
            "checkpoint '{}': shard file '{}' (rank {}) is {}: {} bytes on disk, {} recorded in "
            "{}",
            dir, f.name, f.rank, size < f.bytes ? "truncated" : "altered", size, f.bytes,
            kMetadataFile);
      }
    }
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::optional<ResumePoint> find_resume_point(const std::string& resume,
                                             const std::string& checkpoints_dir,
                                             const std::map<int64_t, std::string>& known_problems) {
  if (resume.empty()) return std::nullopt;
  if (resume != "auto") {
    CheckpointReader r(resume);
    return ResumePoint{r.dir(), r.metadata().step, {}};
  }
  const auto problem_of = [&](int64_t step, const std::string& path) {
    const auto known = known_problems.find(step);
    return known != known_problems.end() ? known->second : checkpoint_problem(path);
  };
  const fs::path dir(checkpoints_dir);
  const fs::path latest = dir / kLatestFile;
  std::error_code ec;
  const bool has_latest = fs::exists(fs::symlink_status(latest, ec));
  std::string why;                // why `latest` is not resumed from
  std::optional<int64_t> before;  // the step `latest` names: only older ones are candidates
  if (has_latest) {
    std::string target;  // the step directory `latest` names
    try {
      target = fs::is_directory(latest, ec) ? fs::canonical(latest).filename().string()
                                            : core::trim(files::read_text(latest.string()));
    } catch (const std::exception& e) {
      why = fmt::format("'{}' cannot be read: {}", latest.string(), e.what());
    }
    if (why.empty()) {
      if (const auto step = parse_step_dir_name(target)) {
        const std::string path = (dir / target).string();
        const std::string problem = problem_of(*step, path);
        if (problem.empty()) return ResumePoint{path, *step, {}};
        why = fmt::format("'{}' names {}, which cannot be resumed from: {}", latest.string(),
                          target, problem);
        before = *step;
      } else {
        why = fmt::format("'{}' holds '{}', not a checkpoint directory name (step_XXXXXXXX)",
                          latest.string(), core::clip(target, 80));
      }
    }
  }
  std::vector<std::pair<int64_t, std::string>> steps;  // newest first
  for (const auto& de : fs::directory_iterator(dir, ec)) {
    const auto step = parse_step_dir_name(de.path().filename().string());
    std::error_code e2;
    if (step && de.is_directory(e2) && (!before || *step < *before))
      steps.emplace_back(*step, de.path().string());
  }
  std::sort(steps.rbegin(), steps.rend());
  if (!has_latest) {
    if (steps.empty()) return std::nullopt;  // nothing was ever committed here: a fresh start
    why = fmt::format("'{}' is missing", latest.string());
  }
  std::vector<std::string> skipped;
  for (const auto& [step, path] : steps) {
    const std::string problem = problem_of(step, path);
    if (!problem.empty()) {
      skipped.push_back(fmt::format("step {}: {}", step, problem));
      continue;
    }
    ResumePoint point{path, step, {}};
    point.warnings.push_back(fmt::format(
        "train.resume=auto: {}; resuming from '{}' (step {}), the newest {}checkpoint that "
        "verifies{}",
        why, path, step, before ? "older " : "",
        skipped.empty() ? std::string()
                        : fmt::format(" (skipped: {})", core::join(skipped, "; "))));
    return point;
  }
  throw_error<CheckpointError>(
      "train.resume=auto: {}; no {}checkpoint in '{}' verifies{}. Not starting over: repair or "
      "remove the checkpoints, set train.resume to a checkpoint path, or train.resume='' to start "
      "fresh",
      why, before ? "older " : "", checkpoints_dir,
      skipped.empty() ? std::string(" (there is none)")
                      : fmt::format(": {}", core::join(skipped, "; ")));
}

std::optional<std::string> resume_checkpoint(const std::string& resume,
                                             const std::string& checkpoints_dir) {
  auto point = find_resume_point(resume, checkpoints_dir);
  if (!point) return std::nullopt;
  for (const std::string& w : point->warnings) core::log::warn("{}", w);
  return point->path;
}

int64_t verify_checkpoint_part(const std::string& dir, int part, int parts) {
  if (const std::string problem = checkpoint_problem(dir); !problem.empty())
    throw_error<CheckpointError>("{}", problem);
  CheckpointReader reader(dir);
  std::map<std::string, int> index;  // rank file -> its position in metadata.json
  for (const FileInfo& f : reader.metadata().files)
    index.emplace(f.name, static_cast<int>(index.size()));
  const auto mine = [&](const ShardInfo& s) {
    const auto it = index.find(s.file);
    return parts <= 1 || (it != index.end() && it->second % parts == part);
  };
  return reader.verify_all(nullptr, nullptr, mine);
}

}  // namespace parallax::checkpoint
