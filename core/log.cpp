#include "core/log.h"

#include "core/error.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <mutex>

namespace parallax::core::log {
namespace {

struct State {
  std::mutex mu;
  std::atomic<int> level{static_cast<int>(Level::kInfo)};
  std::atomic<int> rank{0};
  std::atomic<int> world{1};
  std::atomic<bool> all_ranks{false};
  std::function<void(Level, std::string_view)> sink;

  State() {
    if (const char* env = std::getenv("PARALLAX_LOG_LEVEL"); env && *env) {
      try {
        level = static_cast<int>(parse_level(env));
      } catch (const Error&) {
        std::fprintf(stderr,
                     "parallax: warning: ignoring PARALLAX_LOG_LEVEL='%s' (use "
                     "trace|debug|info|warn|error|off)\n",
                     env);
      }
    }
    if (const char* env = std::getenv("PARALLAX_LOG_ALL_RANKS"); env && env[0] == '1')
      all_ranks = true;
  }
};

State& state() {
  static State s;
  return s;
}

}  // namespace

Level parse_level(std::string_view name) {
  std::string n(name);
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return std::tolower(c); });
  if (n == "trace") return Level::kTrace;
  if (n == "debug") return Level::kDebug;
  if (n == "info") return Level::kInfo;
  if (n == "warn" || n == "warning") return Level::kWarn;
  if (n == "error") return Level::kError;
  if (n == "off" || n == "none") return Level::kOff;
  throw_error<ConfigError>("unknown log level '{}' (use trace|debug|info|warn|error|off)", name);
}

std::string_view level_name(Level level) {
  switch (level) {
    case Level::kTrace:
      return "TRACE";
    case Level::kDebug:
      return "DEBUG";
    case Level::kInfo:
      return "INFO";
    case Level::kWarn:
      return "WARN";
    case Level::kError:
      return "ERROR";
    case Level::kOff:
      return "OFF";
  }
  return "?";
}

void set_rank(int rank, int world_size) {
  state().rank = rank;
  state().world = world_size;
}
void set_level(Level level) {
  state().level = static_cast<int>(level);
}
Level level() {
  return static_cast<Level>(state().level.load());
}
void set_all_ranks(bool all) {
  state().all_ranks = all;
}

void set_sink(std::function<void(Level, std::string_view)> sink) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().sink = std::move(sink);
}

bool enabled(Level lvl) {
  auto& s = state();
  if (static_cast<int>(lvl) < s.level.load() || lvl == Level::kOff) return false;
  if (lvl >= Level::kWarn) return true;
  return s.rank.load() == 0 || s.all_ranks.load();
}

void write(Level lvl, std::string_view message) {
  auto& s = state();
  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  std::tm tm{};
  localtime_r(&t, &tm);
  char ts[16];
  std::strftime(ts, sizeof(ts), "%H:%M:%S", &tm);
  std::string line;
  if (s.world.load() > 1) {
    line = fmt::format("[parallax {} r{}/{} {}] {}\n", ts, s.rank.load(), s.world.load(),
                       level_name(lvl), message);
  } else {
    line = fmt::format("[parallax {} {}] {}\n", ts, level_name(lvl), message);
  }
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.sink) {
    s.sink(lvl, line);
  } else {
    std::fwrite(line.data(), 1, line.size(), stderr);
    std::fflush(stderr);
  }
}

}  // namespace parallax::core::log
