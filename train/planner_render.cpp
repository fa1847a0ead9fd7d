// The planner's output: the ranked table and the JSON document.
#include "train/planner_inventory.h"

namespace parallax::train::planner {

using namespace detail;

std::string render_table(const std::vector<Row>& rows, const Hardware& hw, int max_rows) {
  std::ostringstream o;
  o << fmt::format(
      "{} x {} ({:.0f} GiB each, {} node(s)); {:.3g} TFLOP/s peak x {:.2f} efficiency; "
      "{:.0f} GB/s in a node, {:.0f} GB/s across ({})\n",
      hw.gpus, hw.name, hw.gpu_mem_gib, hw.nodes, hw.peak_tflops, hw.efficiency, hw.intra_node_gbps,
      hw.inter_node_gbps, hw.source);
  o << fmt::format("{:>3} {:<34} {:>8} {:>7} {:>7} {:>7} {:>7} {:>7} {:>9} {:>9} {:>7} {:>7}\n",
                   "#", "layout (dp tp pp zero sp mb x m sched ckpt)", "mem GiB", "params", "grads",
                   "optim", "activ", "other", "step ms", "samples/s", "bubble", "comm");
  int shown = 0;
  for (const auto& r : rows) {
    if (!r.fits) continue;
    if (max_rows > 0 && shown >= max_rows) break;
    const Candidate& l = r.layout;
    const std::string lay = fmt::format(
        "{} {} {} z{} {} {}x{} {} {}", l.dp, l.tp, l.pp, l.zero, l.sequence_parallel ? "sp" : "-",
        l.micro_batch, l.micro_batches,
        l.pp > 1 ? (l.virtual_stages > 1 ? fmt::format("{}v{}", l.schedule, l.virtual_stages)
                                         : l.schedule)
                 : "-",
        l.checkpointing);
    const RankMemory& p = r.peak;
    o << fmt::format(
        "{:>3} {:<34} {:>8.2f} {:>7.2f} {:>7.2f} {:>7.2f} {:>7.2f} {:>7.2f} {:>9.1f} {:>9.1f} "
        "{:>7.3f} {:>7.1f}{}\n",
        ++shown, lay, p.total() / kGiB, p.params / kGiB, p.grads / kGiB, p.optimizer / kGiB,
        p.activations / kGiB, (p.autocast_copies + p.transient + p.comm_buffers + p.context) / kGiB,
        r.time.step_ms, r.time.samples_per_s,
        r.time.compute_ms > 0 ? r.time.bubble_ms / r.time.compute_ms : 0,
        r.time.tp_comm_ms + r.time.pp_comm_ms + r.time.dp_exposed_ms,
        r.configured ? "  <- the config's layout" : "");
  }
  if (shown == 0) o << "    no layout fits\n";
  // The rejected ones, one line per distinct reason (the first layout it hit).
  std::map<std::string, std::pair<int, std::string>> reasons;
  for (const auto& r : rows) {
    if (r.fits) continue;
    std::string key = r.reason.substr(0, r.reason.find(" on rank"));
    if (key.rfind("needs ", 0) == 0) key = "does not fit in memory";
    auto& e = reasons[key];
    if (e.first++ == 0)
      e.second = fmt::format("dp {} tp {} pp {} zero {}: {}", r.layout.dp, r.layout.tp, r.layout.pp,
                             r.layout.zero, r.reason);
  }
  if (!reasons.empty()) o << "rejected:\n";
  for (const auto& [key, e] : reasons)
    o << fmt::format("  {:>4} layouts, e.g. {}\n", e.first, e.second);
  return o.str();
}

namespace {
std::string mem_json(const RankMemory& m) {
  using core::json_fixed;
  return fmt::format(
      "{{\"rank\": {}, \"params\": {}, \"grads\": {}, \"optimizer\": {}, \"activations\": {}, "
      "\"autocast_copies\": {}, \"transient\": {}, \"comm_buffers\": {}, \"context\": {}, "
      "\"allocated\": {}, \"total\": {}}}",
      m.rank, m.params, m.grads, m.optimizer, json_fixed(m.activations, 0),
      json_fixed(m.autocast_copies, 0), json_fixed(m.transient, 0), json_fixed(m.comm_buffers, 0),
      json_fixed(m.context, 0), json_fixed(m.allocated(), 0), json_fixed(m.total(), 0));
}
}  // namespace

std::string render_json(const std::vector<Row>& rows, const Hardware& hw) {
  const auto ms = [](double v) { return core::json_fixed(v, 3); };
  std::ostringstream o;
  o << fmt::format(
      "{{\"hardware\": {{\"name\": {}, \"gpus\": {}, \"nodes\": {}, \"gpu_mem_gib\": {}, "
      "\"peak_tflops\": {}, \"efficiency\": {}, \"intra_node_gbps\": {}, \"inter_node_gbps\": {}, "
      "\"source\": {}}},\n \"layouts\": [\n",
      core::json_quote(hw.name), hw.gpus, hw.nodes, core::json_number(hw.gpu_mem_gib),
      core::json_number(hw.peak_tflops), core::json_number(hw.efficiency),
      core::json_number(hw.intra_node_gbps), core::json_number(hw.inter_node_gbps),
      core::json_quote(hw.source));
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    const Candidate& l = r.layout;
    std::string ranks;
    for (const auto& m : r.ranks) ranks += (ranks.empty() ? "" : ", ") + mem_json(m);
    o << fmt::format(
        "  {{\"dp\": {}, \"tp\": {}, \"pp\": {}, \"zero\": {}, \"sequence_parallel\": {}, "
        "\"micro_batch\": {}, \"micro_batches\": {}, \"schedule\": {}, \"virtual_stages\": {}, "
        "\"checkpointing\": {}, \"fits\": {}, \"configured\": {}, \"reason\": {}, "
        "\"overrides\": {}, \"peak\": {}, \"ranks\": [{}], \"time\": {{\"compute_ms\": {}, "
        "\"bubble_ms\": {}, \"tp_comm_ms\": {}, \"pp_comm_ms\": {}, \"dp_comm_ms\": {}, "
        "\"dp_exposed_ms\": {}, \"optimizer_ms\": {}, \"step_ms\": {}, \"samples_per_s\": "
        "{}}}}}{}\n",
        l.dp, l.tp, l.pp, l.zero, l.sequence_parallel ? "true" : "false", l.micro_batch,
        l.micro_batches, core::json_quote(l.schedule), l.virtual_stages,
        core::json_quote(l.checkpointing), r.fits ? "true" : "false",
        r.configured ? "true" : "false", core::json_quote(r.reason),
        core::json_quote(l.overrides()), r.ranks.empty() ? "null" : mem_json(r.peak), ranks,
        ms(r.time.compute_ms), ms(r.time.bubble_ms), ms(r.time.tp_comm_ms), ms(r.time.pp_comm_ms),
        ms(r.time.dp_comm_ms), ms(r.time.dp_exposed_ms), ms(r.time.optimizer_ms),
        ms(r.time.step_ms), ms(r.time.samples_per_s), i + 1 < rows.size() ? "," : "");
  }
  o << " ]}\n";
  return o.str();
}

}  // namespace parallax::train::planner
