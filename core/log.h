// Process-wide logger: fmt formatting, levels, a rank prefix, rank-0-only by default.
//
// Level comes from PARALLAX_LOG_LEVEL (trace|debug|info|warn|error|off, default info) and can be
// overridden with set_level(). Messages at info and below are printed by rank 0 only unless
// PARALLAX_LOG_ALL_RANKS=1 or set_all_ranks(true); warnings and errors are printed by every rank,
// since a problem on rank 5 is exactly what a user must see. Thread-safe: lines never interleave.
// The logger and the process world are the only global mutable state in Parallax.
#pragma once

#include <fmt/format.h>

#include <functional>
#include <string>
#include <string_view>

namespace parallax::core::log {

enum class Level : int { kTrace = 0, kDebug, kInfo, kWarn, kError, kOff };

// Parses "trace|debug|info|warn|warning|error|off" (case-insensitive); throws ConfigError.
Level parse_level(std::string_view name);
std::string_view level_name(Level level);

// Tells the logger which rank it runs on (called by the world bootstrap).
void set_rank(int rank, int world_size);
void set_level(Level level);
Level level();
void set_all_ranks(bool all);

// Redirects output (tests); nullptr restores stderr. The sink receives the formatted line.
void set_sink(std::function<void(Level, std::string_view)> sink);

bool enabled(Level level);
void write(Level level, std::string_view message);

template <class... A>
void trace(fmt::format_string<A...> f, A&&... a) {
  if (enabled(Level::kTrace)) write(Level::kTrace, fmt::format(f, std::forward<A>(a)...));
}
template <class... A>
void debug(fmt::format_string<A...> f, A&&... a) {
  if (enabled(Level::kDebug)) write(Level::kDebug, fmt::format(f, std::forward<A>(a)...));
}
template <class... A>
void info(fmt::format_string<A...> f, A&&... a) {
  if (enabled(Level::kInfo)) write(Level::kInfo, fmt::format(f, std::forward<A>(a)...));
}
template <class... A>
void warn(fmt::format_string<A...> f, A&&... a) {
  if (enabled(Level::kWarn)) write(Level::kWarn, fmt::format(f, std::forward<A>(a)...));
}
template <class... A>
void error(fmt::format_string<A...> f, A&&... a) {
  if (enabled(Level::kError)) write(Level::kError, fmt::format(f, std::forward<A>(a)...));
}

}  // namespace parallax::core::log
