#include "parallel/pipeline/partition.h"

#include "core/error.h"

#include <algorithm>
#include <limits>

namespace parallax::parallel::pipeline {

std::vector<int> partition(const std::vector<double>& costs, int stages,
                           const std::vector<int>& explicit_counts,
                           const std::vector<double>& activation_bytes,
                           const std::vector<int>& in_flight) {
  const int n = static_cast<int>(costs.size());
  PARALLAX_CHECK(n >= stages, ConfigError,
                 "keys 'parallel.pp' and 'parallel.pp_virtual_stages': {} pipeline stages but the "
                 "model has only {} units to spread over them",
                 stages, n);
  std::vector<int> bounds{0};
  if (!explicit_counts.empty()) {
    PARALLAX_CHECK(static_cast<int>(explicit_counts.size()) == stages, ConfigError,
                   "key 'parallel.pp_layout': {} entries for {} stages (pp x pp_virtual_stages)",
                   explicit_counts.size(), stages);
    for (std::size_t s = 0; s < explicit_counts.size(); ++s) {
      PARALLAX_CHECK(explicit_counts[s] >= 1, ConfigError,
                     "key 'parallel.pp_layout': stage {} has {} units (at least 1)", s,
                     explicit_counts[s]);
      bounds.push_back(bounds.back() + explicit_counts[s]);
    }
    PARALLAX_CHECK(bounds.back() == n, ConfigError,
                   "key 'parallel.pp_layout': the stages hold {} units, the model has {}",
                   bounds.back(), n);
    return bounds;
  }
  // Contiguous split minimising the largest stage cost (dynamic programming over prefixes).
  std::vector<double> prefix(static_cast<std::size_t>(n) + 1, 0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + std::max(costs[i], 0.0);
  const double inf = std::numeric_limits<double>::infinity();
  // best[s][i]: the smallest max cost of splitting units [0, i) into s stages; cut[s][i] its last
  // cut.
  std::vector<std::vector<double>> best(stages + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<int>> cut(stages + 1, std::vector<int>(n + 1, 0));
  best[0][0] = 0;
  for (int s = 1; s <= stages; ++s) {
    for (int i = s; i <= n; ++i) {
      for (int j = s - 1; j < i; ++j) {
        const double c = std::max(best[s - 1][j], prefix[i] - prefix[j]);
        if (c < best[s][i]) {
          best[s][i] = c;
          cut[s][i] = j;
        }
      }
    }
  }
  if (activation_bytes.size() == costs.size() && static_cast<int>(in_flight.size()) == stages) {
    // Second criterion: every stage within the optimum's largest cost (up to rounding), the
    // largest in_flight x activation bytes as small as it can be.
    const double cap = best[stages][n] * (1 + 1e-9);
    std::vector<double> act(static_cast<std::size_t>(n) + 1, 0);
    for (int i = 0; i < n; ++i) act[i + 1] = act[i] + std::max(activation_bytes[i], 0.0);
    std::vector<std::vector<double>> mem(stages + 1, std::vector<double>(n + 1, inf));
    mem[0][0] = 0;
    for (int s = 1; s <= stages; ++s) {
      for (int i = s; i <= n; ++i) {
        for (int j = s - 1; j < i; ++j) {
          if (mem[s - 1][j] == inf || prefix[i] - prefix[j] > cap) continue;
          const double c = std::max(mem[s - 1][j], in_flight[s - 1] * (act[i] - act[j]));
          if (c < mem[s][i]) {
            mem[s][i] = c;
            cut[s][i] = j;
          }
        }
      }
    }
  }
  std::vector<int> rev{n};
  for (int s = stages, i = n; s > 0; --s) {
    i = cut[s][i];
    rev.push_back(i);
  }
  return {rev.rbegin(), rev.rend()};
}

}  // namespace parallax::parallel::pipeline
