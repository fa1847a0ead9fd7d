// The planner's entry points (train/planner.h): the candidates of N GPUs enumerated and ranked,
// the prediction of one, and the configured layout's exact engine memory. What one candidate
// costs is train/planner_predict.h's.
#include "train/planner_predict.h"

#include "parallel/pipeline/partition.h"

namespace parallax::train::planner {

using namespace detail;

std::string Candidate::overrides() const {
  std::string s = fmt::format("parallel.dp={} parallel.tp={} parallel.pp={} parallel.zero.stage={}",
                              dp, tp, pp, zero);
  if (tp > 1)
    s += fmt::format(" parallel.sequence_parallel={}", sequence_parallel ? "true" : "false");
  if (pp > 1) s += fmt::format(" parallel.pp_schedule={}", schedule);
  if (virtual_stages > 1) s += fmt::format(" parallel.pp_virtual_stages={}", virtual_stages);
  s += fmt::format(" data.batch_size={} train.grad_accum={} train.activation_checkpointing={}",
                   micro_batch, micro_batches, checkpointing);
  return s;
}

Candidate configured_layout(const RunConfig& cfg, int world) {
  const auto& p = cfg.parallel;
  Candidate l;
  l.tp = p.tp;
  l.pp = p.pp;
  l.dp = p.dp > 0 ? p.dp : std::max(1, world / (p.tp * p.pp));
  l.zero = p.zero.stage;
  l.sequence_parallel = p.sequence_parallel;
  l.micro_batch = cfg.data.batch_size;
  l.micro_batches = cfg.train.grad_accum;
  l.schedule = p.pp > 1 ? p.pp_schedule : "";
  l.virtual_stages = p.pp_virtual_stages;
  l.checkpointing = cfg.train.activation_checkpointing;
  return l;
}

namespace {

// Why no layout of (dp, tp, pp) can run, whatever its ZeRO stage, sequence parallelism, schedule,
// micro-batches and checkpointing ("" when some may): the topology (a tp group across nodes),
// a model that cannot be built at this tp with or without SP, or fewer units than pipeline
// stages. The reasons are the ones predict_with() would give each of its layouts.
std::string pair_rejection(Inventory& inv, const RunConfig& cfg, const Hardware& hw, int dp, int tp,
                           int pp) {
  try {
    (void)comm::resolve_layout(dp * tp * pp, dp, tp, pp, hw.cuda ? hw.gpus_per_node() : 0);
  } catch (const Error& e) {
    return e.what();
  }
  const Built& plain = inv.at_tp(tp, false);
  const Built* b = &plain;
  if (!plain.error.empty()) {
    if (tp == 1) return plain.error;
    b = &inv.at_tp(tp, true);
    if (!b->error.empty()) return plain.error;
  }
  if (pp > 1 && active_extension(cfg) == nullptr && b->chain != 0 &&
      static_cast<int>(b->pp_costs.size()) < pp) {
    return fmt::format(
        "keys 'parallel.pp' and 'parallel.pp_virtual_stages': {} pipeline stages but the model "
        "has only {} units to spread over them",
        pp, b->pp_costs.size());
  }
  return "";
}

// Ascending; O(sqrt n).
std::vector<int> divisors(int n) {
  std::vector<int> lo, hi;
  for (int i = 1; static_cast<int64_t>(i) * i <= n; ++i) {
    if (n % i != 0) continue;
    lo.push_back(i);
    if (i != n / i) hi.push_back(n / i);
  }
  lo.insert(lo.end(), hi.rbegin(), hi.rend());
  return lo;
}

}  // namespace

namespace {

// FP8 needs GPUs (the trainer's own refusal, before anything is built).
void check_precision(const RunConfig& cfg, const Hardware& hw) {
  PARALLAX_CHECK(hw.cuda || !optim::PrecisionPolicy::from(cfg.precision, c10::kCPU).fp8(),
                 ConfigError,
                 "key 'precision.mode': fp8 needs NVIDIA GPUs with FP8 tensor cores, not CPU "
                 "ranks; plan with --device h100 or h200, or use precision.mode=bf16");
}

}  // namespace

Row predict(const RunConfig& cfg, const Candidate& layout, const Hardware& hw) {
  check_supported(cfg);
  check_precision(cfg, hw);
  Inventory inv(cfg);
  return predict_with(inv, cfg, layout, hw);
}

std::vector<parallel::EngineMemory> engine_memory(const RunConfig& cfg, int world, bool cuda) {
  check_supported(cfg);
  const Candidate l = configured_layout(cfg, world);
  PARALLAX_CHECK(l.dp * l.tp * l.pp == world, ConfigError,
                 "planner: dp {} x tp {} x pp {} is not the world of {} ranks", l.dp, l.tp, l.pp,
                 world);
  Inventory inv(cfg);
  const Built& b = inv.at_tp(l.tp, l.sequence_parallel);
  PARALLAX_CHECK(b.error.empty(), ConfigError, "{}", b.error);
  const Stages st = make_stages(b, l, cfg, cuda, inv.schedules());
  std::vector<parallel::EngineMemory> out(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) {
    const int dp_rank = (r / l.tp) % l.dp, pp_rank = r / (l.tp * l.dp);
    out[static_cast<std::size_t>(r)] = engine_bytes(b, st, l, dp_rank, pp_rank, cfg);
  }
  return out;
}

double activation_bytes(const RunConfig& cfg, int tp, bool sequence_parallel, int64_t micro_batch,
                        bool cuda) {
  Candidate l;
  l.tp = tp;
  l.sequence_parallel = sequence_parallel;
  l.micro_batch = micro_batch;
  Inventory inv(cfg);
  const Built& b = inv.at_tp(tp, sequence_parallel);
  PARALLAX_CHECK(b.error.empty(), ConfigError, "{}", b.error);
  const Stages st = make_stages(b, l, cfg, cuda, inv.schedules());
  return activations(b, st, l, 0, cfg, cuda).peak;
}

std::vector<Row> plan(const RunConfig& cfg, const Request& req) {
  check_supported(cfg);
  const Hardware& hw = req.hw;
  check_precision(cfg, hw);
  const int n = hw.gpus;
  PARALLAX_CHECK(n >= 1 && hw.nodes >= 1 && n % hw.nodes == 0, UsageError,
                 "plan: --gpus {} must be a positive multiple of --nodes {}", n, hw.nodes);
  PARALLAX_CHECK(n <= kMaxGpus, UsageError,
                 "plan: --gpus {} is more than {} (the largest clusters built have ~100k GPUs)", n,
                 kMaxGpus);
  PARALLAX_CHECK(req.global_batch >= 0 && req.global_batch <= kMaxGlobalBatch, UsageError,
                 "plan: --global-batch {} must be in 1..{}", req.global_batch, kMaxGlobalBatch);
  const Candidate cfg_layout = configured_layout(cfg, n);
  int64_t global = req.global_batch;
  if (global <= 0) {
    // In double first: data.batch_size x train.grad_accum x dp overflows int64 for int keys.
    const int dp = std::max(1, n / (cfg.parallel.tp * cfg.parallel.pp));
    const double g = static_cast<double>(cfg.data.batch_size) * cfg.train.grad_accum * dp;
    PARALLAX_CHECK(g <= static_cast<double>(kMaxGlobalBatch), ConfigError,
                   "keys 'data.batch_size' and 'train.grad_accum': the global batch {} x {} x {} "
                   "data-parallel ranks = {:.0f} samples is more than {} (a layout's micro-batch "
                   "size and count are 32-bit keys); pass a smaller --global-batch",
                   cfg.data.batch_size, cfg.train.grad_accum, dp, g, kMaxGlobalBatch);
    global = static_cast<int64_t>(g);
  }
  Inventory inv(cfg);
  // A model that cannot be built even without tensor parallelism (a LoRA rank above its layers,
  // a target that matches nothing) is the config's error, not every layout's reason.
  if (const Built& plain = inv.at_tp(1, false); !plain.error.empty())
    throw_error<ConfigError>("{}", plain.error);
  std::vector<Row> rows;
  const std::vector<std::string> ckpts =
      req.all_checkpointing ? std::vector<std::string>{"none", "selective", "full"}
                            : std::vector<std::string>{cfg.train.activation_checkpointing};
  for (int tp : divisors(n)) {
    for (int pp : divisors(n / tp)) {
      inv.schedules().clear();
      const int dp = n / (tp * pp);
      if (global % dp != 0) {
        Row r;
        r.layout.dp = dp;
        r.layout.tp = tp;
        r.layout.pp = pp;
        r.reason = fmt::format("global batch {} is not divisible by dp {}", global, dp);
        rows.push_back(r);
        continue;
      }
      // A (dp, tp, pp) that no choice of the other knobs can run is one row, not one per ZeRO
      // stage, schedule, micro-batch and checkpointing: otherwise the rows grow with the divisor
      // pairs of --gpus times ~10^3 (--gpus 110880: 10^6 rows, 2 GB, 11 s; issue 35).
      if (std::string why = pair_rejection(inv, cfg, hw, dp, tp, pp); !why.empty()) {
        Row r;
        r.layout.dp = dp;
        r.layout.tp = tp;
        r.layout.pp = pp;
        r.reason = std::move(why);
        rows.push_back(std::move(r));
        continue;
      }
      const int64_t per_dp = global / dp;
      std::vector<int64_t> micro;
      for (int64_t mb = 1; mb <= per_dp; mb *= 2)
        if (per_dp % mb == 0) micro.push_back(mb);
      if (std::find(micro.begin(), micro.end(), per_dp) == micro.end()) micro.push_back(per_dp);
      std::vector<std::pair<std::string, int>> schedules{{"", 1}};
      if (pp > 1) schedules = {{"1f1b", 1}, {"gpipe", 1}, {"interleaved", 2}, {"zb", 1}};
      for (int zero : {0, 1, 2, 3}) {
        if (dp == 1 && zero > 0) continue;  // ZeRO over one rank is DDP's memory
        for (bool sp : tp > 1 ? std::vector<bool>{false, true} : std::vector<bool>{false}) {
          for (const auto& [sched, v] : schedules) {
            for (int64_t mb : micro) {
              const int m = static_cast<int>(per_dp / mb);
              // With pp = 1 more micro-batches only cost time: keep the largest that fits (the
              // ranking keeps the best); with pp they fill the pipeline.
              for (const auto& ck : ckpts) {
                Candidate l;
                l.dp = dp;
                l.tp = tp;
                l.pp = pp;
                l.zero = zero;
                l.sequence_parallel = sp;
                l.micro_batch = mb;
                l.micro_batches = m;
                l.schedule = sched;
                l.virtual_stages = v;
                l.checkpointing = ck;
                Row r = predict_with(inv, cfg, l, hw);
                r.configured = l.dp == cfg_layout.dp && l.tp == cfg_layout.tp &&
                               l.pp == cfg_layout.pp && l.zero == cfg_layout.zero &&
                               l.micro_batch == cfg_layout.micro_batch &&
                               l.micro_batches == cfg_layout.micro_batches &&
                               l.checkpointing == cfg_layout.checkpointing &&
                               (pp == 1 || l.schedule == cfg_layout.schedule) &&
                               (tp == 1 || sp == cfg_layout.sequence_parallel);
                rows.push_back(std::move(r));
              }
            }
          }
        }
      }
    }
  }
  std::stable_sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) {
    if (a.fits != b.fits) return a.fits;
    if (a.fits) return a.time.samples_per_s > b.time.samples_per_s;
    return a.reason.empty() < b.reason.empty();
  });
  return rows;
}

}  // namespace parallax::train::planner