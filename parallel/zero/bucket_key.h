// ZeRO's bucketing rule, the one thing the engine (zero.h) and its memory rule
// (parallel/memory_rules.h: zero_memory_rule) must agree on to the byte: which parameters may share
// a gradient bucket and in which order the buckets come. Kept apart so the memory rule reads it
// without depending on the engine.
#pragma once

namespace parallax::parallel::zero {

// The bucket key of a parameter of optimizer group `group` (-1: none) and, under stage 3, of unit
// `unit` of `n_units` (-1: not keyed by unit): buckets never mix groups (their weight decay
// differs), units (stage 3 gathers and frees a unit's flat parameter) or tp-sharded with
// tp-replicated parameters. Keys ascend in reverse unit order, so buckets come out (and are
// launched) last unit first, the order of the backward. `n_groups`: the group count + 1.
inline int bucket_key(int group, int unit, int n_groups, int n_units, bool tp_sharded) {
  const int tp_bit = tp_sharded ? 1 : 0;
  if (unit < 0) return 2 * group + tp_bit;
  return 2 * ((n_units - 1 - unit) * n_groups + group + 1) + tp_bit;
}

}  // namespace parallax::parallel::zero
