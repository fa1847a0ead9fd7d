#include "parallel/memory_rules.h"

#include "parallel/ddp/grad_buckets.h"
#include "parallel/zero/bucket_key.h"

#include <algorithm>
#include <map>
#include <set>

namespace parallax::parallel {

EngineMemory ddp_memory_rule(const std::vector<ParamInfo>& params, const MemoryQuery& q) {
  constexpr int64_t kF32 = 4;
  int64_t all = 0, trainable = 0;
  for (const ParamInfo& p : params) {
    all += p.numel;
    if (p.trainable) trainable += p.numel;
  }
  EngineMemory m;
  m.params = all * kF32;
  m.grads = trainable * kF32;
  m.optimizer = static_cast<int64_t>(q.optimizer_bytes_per_element) * trainable;
  return m;
}

EngineMemory zero_memory_rule(int stage, const std::vector<ParamInfo>& params,
                              const MemoryQuery& q) {
  constexpr int64_t kF32 = 4;
  const int64_t n = q.dp;
  EngineMemory m;
  // Frozen parameters (a LoRA base): whole, or under stage 3 over several ranks 1/N of each
  // unit's (padded).
  std::vector<const ParamInfo*> mine;
  std::map<int, int64_t> frozen_per_unit;
  for (const ParamInfo& p : params) {
    if (p.trainable) {
      mine.push_back(&p);
    } else if (stage == 3 && n > 1) {
      frozen_per_unit[p.unit] += p.numel;
    } else {
      m.params += p.numel * kF32;
    }
  }
  for (const auto& [u, numel] : frozen_per_unit) m.params += (numel + n - 1) / n * kF32;
  // The buckets ZeroEngine's constructor builds: DDP's assignment under this engine's keys and caps
  // (stage 3: no cap, one bucket per (unit, dtype, group)).
  std::vector<int64_t> sizes;
  std::vector<at::ScalarType> dtypes;
  std::vector<int> keys;
  for (const ParamInfo* p : mine) {
    sizes.push_back(p->numel * kF32);
    dtypes.push_back(at::kFloat);
    keys.push_back(zero::bucket_key(p->group, stage == 3 ? p->unit : -1, q.groups + 1, q.units,
                                    p->tp_sharded));
  }
  const double mb = 1024.0 * 1024.0;
  const int64_t first_cap = static_cast<int64_t>((stage == 3 ? 1e9 : q.ddp.first_bucket_mb) * mb);
  const int64_t cap = static_cast<int64_t>((stage == 3 ? 1e9 : q.ddp.bucket_mb) * mb);
  const bool reduce_each_micro = stage >= 2 && n > 1;
  int64_t mine_elems = 0;
  for (const auto& members : ddp::assign_buckets(sizes, dtypes, keys, first_cap, cap)) {
    int64_t numel = 0;
    std::vector<int64_t> offsets;
    for (int64_t i : members) {
      offsets.push_back(numel);
      numel += mine[static_cast<std::size_t>(i)]->numel;
    }
    // Padded to a multiple of N; this rank owns elements [r S, (r + 1) S).
    const int64_t padded = (numel + n - 1) / n * n, shard = padded / n;
    const int64_t lo = q.dp_rank * shard, hi = lo + shard;
    for (std::size_t k = 0; k < members.size(); ++k) {
      const int64_t off = offsets[k], len = mine[static_cast<std::size_t>(members[k])]->numel;
      const int64_t b = std::max(off, lo), e = std::min(off + len, hi);
      if (len > 0 && b < e) mine_elems += e - b;
    }
    // Parameters: the flat buffer (stages 1, 2), this rank's shard of it (stage 3; the gathered
    // buffer is freed between units).
    m.params += (stage == 3 && n > 1 ? shard : padded) * kF32;
    // Gradients: stage 1 (and any stage over one rank) the flat buffer, whose reduce-scatter shard
    // is a second buffer over several ranks; stages 2 and 3 only the shard, plus its accumulator
    // with several micro-steps.
    if (!reduce_each_micro) {
      m.grads += padded * kF32 + (n > 1 ? shard * kF32 : 0);
    } else {
      m.grads += shard * kF32 * (q.micro_batches > 1 ? 2 : 1);
    }
  }
  // The optimizer state of this rank's pieces.
  m.optimizer = static_cast<int64_t>(q.optimizer_bytes_per_element) * mine_elems;
  return m;
}

EngineMemory predicted_memory(int zero_stage, const std::vector<ParamInfo>& params,
                              const MemoryQuery& q) {
  return zero_stage == 0 ? ddp_memory_rule(params, q) : zero_memory_rule(zero_stage, params, q);
}

}  // namespace parallax::parallel
