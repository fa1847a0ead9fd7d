#include "checkpoint/prune.h"

#include "checkpoint/files.h"
#include "checkpoint/format.h"
#include "core/log.h"
#include "core/strings.h"

#include <algorithm>
#include <filesystem>
#include <utility>
#include <vector>

namespace parallax::checkpoint {

namespace fs = std::filesystem;

void remove_leftovers(const std::string& dir) {
  std::error_code ec;
  for (const auto& de : fs::directory_iterator(dir, ec)) {
    const std::string n = de.path().filename().string();
    if (core::starts_with(n, kTempPrefix) ||
        core::starts_with(n, std::string(kLatestFile) + ".tmp-")) {
      std::error_code rm;
      fs::remove_all(de.path(), rm);
      if (rm)
        core::log::warn("checkpoint: cannot remove leftover '{}': {}", de.path().string(),
                        rm.message());
      else
        core::log::info("checkpoint: removed leftover '{}' of an interrupted save",
                        de.path().string());
    }
  }
}

void prune_checkpoints(const std::string& dir, int64_t step, int keep_last) {
  if (keep_last <= 0) return;
  std::vector<std::pair<int64_t, std::string>> older;
  std::error_code ec;
  for (const auto& de : fs::directory_iterator(dir, ec)) {
    const std::string n = de.path().filename().string();
    if (auto s = parse_step_dir_name(n); s && *s < step && de.is_directory())
      older.emplace_back(*s, n);
  }
  std::sort(older.rbegin(), older.rend());
  for (size_t i = static_cast<size_t>(keep_last - 1); i < older.size(); ++i) {
    const fs::path from = fs::path(dir) / older[i].second;
    const fs::path to = fs::path(dir) / (kTempPrefix + std::string("prune-") + older[i].second +
                                         "-" + files::random_hex(4));
    std::error_code e1, e2;
    fs::rename(from, to, e1);
    if (!e1) fs::remove_all(to, e2);
    if (e1 || e2) {
      core::log::warn("checkpoint: cannot prune '{}': {}", from.string(), (e1 ? e1 : e2).message());
    } else {
      core::log::debug("checkpoint: pruned '{}' (keep_last={})", from.string(), keep_last);
    }
  }
}

}  // namespace parallax::checkpoint
