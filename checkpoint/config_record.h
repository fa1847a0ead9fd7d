// The run's resolved config across resumes: what changed since a checkpoint was saved, and the
// run directory's config history.
//
// Every checkpoint keeps the resolved config it was saved with (config.yaml beside metadata.json,
// CheckpointReader::config_text). On resume the trainer compares it with the config of the new run
// (diff_configs) and warns about each changed key; when the checkpoint does not load (a tensor of
// another shape), the changed keys name the likely cause (`model.size`). In the run directory,
// config.yaml is the config of the current (latest) start and config_history/ keeps each
// config.yaml it replaced, named for the step at which it was replaced (record_config).
//
// Thread-safety: pure functions and single-process file operations (rank 0 only).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace parallax::checkpoint {

struct ConfigChange {
  std::string key;     // dotted path, "optim.lr"; a list is one value ("optim.betas")
  std::string before;  // the value as YAML flow text; "(absent)" when the key did not exist
  std::string after;
};

// The keys whose values differ between two configs given as YAML text, in the order of `after`
// (keys only in `before` last). Keys listed in `ignore` (dotted paths, and everything under them)
// are skipped. Throws CheckpointError naming `before_name` or `after_name` for text that is not a
// YAML map.
std::vector<ConfigChange> diff_configs(const std::string& before, const std::string& after,
                                       const std::vector<std::string>& ignore = {},
                                       const std::string& before_name = "the checkpoint's config",
                                       const std::string& after_name = "the run's config");

// "optim.lr: 0.003 -> 0.001, data.batch_size: 32 -> 16"
std::string describe_changes(const std::vector<ConfigChange>& changes);

// The changes whose key starts with one of `prefixes` ("model." ...).
std::vector<ConfigChange> changes_under(const std::vector<ConfigChange>& changes,
                                        const std::vector<std::string>& prefixes);

inline constexpr const char* kConfigHistoryDir = "config_history";

// Writes `text` as <run_dir>/config.yaml (atomically). When a config.yaml with other content is
// there, it is first moved to <run_dir>/config_history/step_XXXXXXXX.yaml, `step` being where the
// run that replaces it starts (a "-N" suffix keeps earlier replacements at the same step). Returns
// the path of the archived file, or "" when there was nothing to archive. Throws IoError.
std::string record_config(const std::string& run_dir, const std::string& text, int64_t step);

}  // namespace parallax::checkpoint
