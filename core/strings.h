// Small string utilities shared by the config system, the CLI and error messages.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace parallax::core {

// Levenshtein distance between a and b.
std::size_t edit_distance(std::string_view a, std::string_view b);

// The candidate closest to `word`, or "" when none is close enough to be a plausible typo
// (distance <= max(2, |word| / 3)). Also matches when one is a prefix/suffix of the other.
std::string closest_match(std::string_view word, const std::vector<std::string>& candidates);

// " (did you mean 'x'?)" or "" when there is no plausible match.
std::string did_you_mean(std::string_view word, const std::vector<std::string>& candidates);

std::vector<std::string> split(std::string_view s, char sep);
std::string join(const std::vector<std::string>& parts, std::string_view sep);
std::string trim(std::string_view s);
bool starts_with(std::string_view s, std::string_view prefix);

// The JSON writer: the pieces of every JSON document Parallax writes (metrics, checkpoint metadata,
// export and QAT reports, the planner's --json, flight records), so that each value is written
// one way. JSON has no NaN or infinity: the number writers give null for them.
//
// `s` as a JSON string literal: quoted, with quotes, backslashes and control characters escaped.
std::string json_quote(std::string_view s);
// The shortest form that reads back as exactly `v`, always with a '.' or an exponent (so a reader
// takes it as a double): 1.0, 0.1, 1e+20; null when not finite.
std::string json_number(double v);
// `v` with `decimals` digits after the point (a report's rounded value); null when not finite.
std::string json_fixed(double v, int decimals);
// ["a", "b"] (each through json_quote) and [1, 2].
std::string json_strings(const std::vector<std::string>& v);
std::string json_ints(const std::vector<int64_t>& v);

// `s` made fit for a one-line error message: control characters escaped (\n, \t, \x01) and, when
// longer than `max_bytes`, the middle cut out and replaced by the total length, e.g.
// "aaaa...(1048576 bytes)...zzzz" (the cut never splits a UTF-8 sequence). Every value, key or
// expression a user gave that an error message echoes goes through this, so a 1 MB value cannot
// flood the console.
std::string clip(std::string_view s, std::size_t max_bytes = 80);

// Why `name` cannot be used as one folder name inside another folder ("is empty", "is '..'",
// "contains '/'", "starts with '~'", "contains a control character", "is 300 bytes long; ..."),
// or "" when it can. For run names and similar user-given path components.
std::string path_component_problem(std::string_view name);

// 1536 -> "1.5 KiB"; for bandwidth and memory reports.
std::string human_bytes(double bytes);
// 3725.0 -> "1h02m05s"; for ETAs.
std::string human_duration(double seconds);

}  // namespace parallax::core
