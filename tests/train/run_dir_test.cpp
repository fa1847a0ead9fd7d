// RunDirectory: run-name checks, creation, and the run-directory lock within one process (the
// multi-process cases, SIGKILL and mpirun included, are in test_run_dir.py).
#include "train/run_dir.h"

#include "core/error.h"
#include "core/log.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

namespace fs = std::filesystem;
using parallax::ConfigError;
using parallax::IoError;
using parallax::train::ExperimentConfig;
using parallax::train::RunDirectory;

namespace {

class RunDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::random_device rd;
    root_ = fs::temp_directory_path() / ("parallax_rundir_" + std::to_string(rd()));
    out_ = root_ / "deep" / "runs";
    fs::create_directories(out_);
  }
  void TearDown() override { fs::remove_all(root_); }

  ExperimentConfig experiment(const std::string& name) const {
    ExperimentConfig e;
    e.name = name;
    e.output_dir = out_.string();
    return e;
  }
  static std::string read(const fs::path& p) {
    std::ifstream in(p);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  static std::string host() {
    char buf[256] = {};
    gethostname(buf, sizeof(buf) - 1);
    return buf;
  }

  fs::path root_, out_;
};

TEST_F(RunDirTest, UnsafeNamesAreConfigErrorsAndCreateNothing) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"../../escape", "contains '/'"},
      {"/abs", "contains '/'"},
      {"a/b", "contains '/'"},
      {"..", "is '..'"},
      {".", "is '.'"},
      {"", "is empty"},
      {"~", "starts with '~'"},
      {"~user", "starts with '~'"},
      {std::string("a\0b", 3), "control character"},
      {"a\nb", "control character"}};
  for (const auto& [name, why] : bad) {
    try {
      RunDirectory::open_local(experiment(name));
      ADD_FAILURE() << "accepted '" << name << "'";
    } catch (const ConfigError& e) {
      const std::string msg = e.what();
      EXPECT_EQ(msg.rfind("key 'experiment.name' must be one folder name, got '", 0), 0u) << msg;
      EXPECT_NE(msg.find(why), std::string::npos) << msg;
    }
  }
  EXPECT_TRUE(fs::is_empty(out_));
  EXPECT_EQ(std::distance(fs::directory_iterator(root_), fs::directory_iterator()),
            1);  // only deep/
}

TEST_F(RunDirTest, CreatesTheDirectoryUnderAnAbsoluteOutputDirAndRecordsTheHolder) {
  ASSERT_TRUE(out_.is_absolute());
  const RunDirectory dir = RunDirectory::open_local(experiment("run1"));
  EXPECT_EQ(dir.path(), out_ / "run1");
  EXPECT_TRUE(dir.locked());
  std::istringstream record(read(out_ / "run1" / parallax::train::kRunLockFile));
  long long pid = 0;
  std::string host_name, started;
  record >> pid >> host_name >> started;
  EXPECT_EQ(pid, static_cast<long long>(getpid()));
  EXPECT_EQ(host_name, host());
  EXPECT_EQ(started.size(), 20u) << started;  // 2025-01-01T10:00:00Z
}

TEST_F(RunDirTest, ASecondOpenFailsAtOnceNamingTheHolderUntilTheFirstIsReleased) {
  {
    RunDirectory first = RunDirectory::open_local(experiment("shared"));
    try {
      RunDirectory::open_local(experiment("shared"));
      ADD_FAILURE() << "the second open took a held lock";
    } catch (const IoError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("run directory '" + (out_ / "shared").string() +
                         "' is in use by another job: pid " + std::to_string(getpid()) +
                         " on host " + host() + " (started "),
                std::string::npos)
          << msg;
    }
    // Moving the directory moves the lock with it.
    const RunDirectory moved = std::move(first);
    EXPECT_TRUE(moved.locked());
    EXPECT_THROW(RunDirectory::open_local(experiment("shared")), IoError);
  }
  EXPECT_TRUE(RunDirectory::open_local(experiment("shared")).locked());  // released with its owner
}

TEST_F(RunDirTest, ALockFileLeftBehindDoesNotBlock) {
  // What a killed job leaves: the file and its record, but no flock (the kernel dropped it).
  fs::create_directories(out_ / "stale");
  std::ofstream(out_ / "stale" / parallax::train::kRunLockFile)
      << "999999999 some-other-host 2020-01-01T00:00:00Z\n";
  const RunDirectory dir = RunDirectory::open_local(experiment("stale"));
  EXPECT_TRUE(dir.locked());
  EXPECT_EQ(
      read(out_ / "stale" / parallax::train::kRunLockFile).rfind(std::to_string(getpid()) + " ", 0),
      0u);
}

TEST_F(RunDirTest, SymbolicLinksAmongWhatARunWritesAreRefusedNamingTheirTarget) {
  // Pre-planted links to a file and a folder outside the run directory: writing through them
  // would append metrics to, lock, or checkpoint into someone else's files.
  const fs::path victim = root_ / "elsewhere" / "victim.txt";
  fs::create_directories(victim.parent_path());
  std::ofstream(victim) << "not yours\n";
  const std::vector<std::pair<std::string, fs::path>> links = {
      {"metrics.jsonl", victim},
      {"config.yaml", victim},
      {parallax::train::kRunLockFile, victim},
      {"checkpoints", victim.parent_path()},
      {"checkpoints/latest", victim},
      {"checkpoints/step_00000004", victim.parent_path()}};
  int i = 0;
  for (const auto& [entry, target] : links) {
    const std::string name = "linked" + std::to_string(i++);
    const fs::path run = out_ / name;
    fs::create_directories((run / entry).parent_path());
    fs::create_symlink(target, run / entry);
    try {
      RunDirectory::open_local(experiment(name));
      ADD_FAILURE() << "a symbolic link at " << entry << " was accepted";
    } catch (const IoError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("run directory '" + run.string() + "': '" + entry +
                         "' is a symbolic link (to '" + target.string() + "')"),
                std::string::npos)
          << msg;
    }
    EXPECT_EQ(read(victim), "not yours\n") << entry;
  }
  EXPECT_EQ(std::distance(fs::directory_iterator(victim.parent_path()), fs::directory_iterator()),
            1);
  // A `latest` linked to a step directory beside it (a form checkpoint readers accept) is fine.
  const fs::path ok = out_ / "latest_link" / "checkpoints";
  fs::create_directories(ok / "step_00000002");
  fs::create_directory_symlink("step_00000002", ok / "latest");
  EXPECT_TRUE(RunDirectory::open_local(experiment("latest_link")).locked());
}

TEST_F(RunDirTest, ASymlinkedRunDirectoryIsUsedAndItsRealPathIsAWarning) {
  // A run directory linked to a bigger disk is the user's choice: it works, and says where.
  const fs::path real = root_ / "big_disk" / "run";
  fs::create_directories(real);
  fs::create_directory_symlink(real, out_ / "linked");
  std::vector<std::string> warnings;
  parallax::core::log::set_sink([&](parallax::core::log::Level level, std::string_view line) {
    if (level == parallax::core::log::Level::kWarn) warnings.emplace_back(line);
  });
  {
    const RunDirectory dir = RunDirectory::open_local(experiment("linked"));
    parallax::core::log::set_sink(nullptr);
    EXPECT_TRUE(dir.locked());
    EXPECT_TRUE(fs::is_regular_file(real / parallax::train::kRunLockFile));
  }
  parallax::core::log::set_sink(nullptr);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("run directory '" + (out_ / "linked").string() +
                             "' is a symbolic link: the run writes to '" +
                             fs::canonical(real).string() + "'"),
            std::string::npos)
      << warnings[0];
}

}  // namespace
