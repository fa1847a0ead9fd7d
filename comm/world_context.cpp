// WorldContext (world_context.h): the live communicators of the World, their flight-recorder
// dump, the progress of poll-driven ops, and the graveyard of abandoned ops' buffers.
#include "comm/world_context.h"

#include "comm/comm_base.h"
#include "core/log.h"

#include <fmt/ranges.h>

#include <algorithm>

namespace parallax::comm::detail {

void WorldContext::set_report_dir(std::string dir) {
  std::lock_guard<std::mutex> lock(mu_);
  report_dir_ = std::move(dir);
}

std::string WorldContext::report_dir() {
  std::lock_guard<std::mutex> lock(mu_);
  return report_dir_;
}

void WorldContext::register_comm(CommBase* comm) {
  std::lock_guard<std::mutex> lock(mu_);
  comms_.push_back(comm);
}

void WorldContext::unregister_comm(CommBase* comm) {
  std::lock_guard<std::mutex> lock(mu_);
  comms_.erase(std::remove(comms_.begin(), comms_.end(), comm), comms_.end());
}

std::string WorldContext::flight_json(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out = fmt::format(
      "{{\n\"rank\": {}, \"world_size\": {}, \"time\": {:.6f},\n\"reason\": {},\n"
      "\"communicators\": [",
      rank, size, wall_seconds(), core::json_quote(reason));
  for (size_t i = 0; i < comms_.size(); ++i) {
    CommBase* c = comms_[i];
    out += fmt::format(
        "{}\n {{\"name\": \"{}\", \"uid\": \"{}\", \"backend\": \"{}\", \"rank\": {}, \"size\": "
        "{}, "
        "\"world_ranks\": [{}], \"aborted\": {},\n  \"entries\": {}}}",
        i ? "," : "", c->name(), c->uid(), c->backend(), c->rank(), c->size(),
        fmt::join(c->world_ranks(), ", "), c->aborted() ? "true" : "false",
        to_json(c->flight_entries()));
  }
  out += "\n]\n}\n";
  return out;
}

void WorldContext::release_all() {
  std::vector<CommBase*> comms;
  {
    std::lock_guard<std::mutex> lock(mu_);
    comms = comms_;
  }
  if (!comms.empty()) {
    core::log::debug("world shutdown: releasing {} communicator(s) still alive", comms.size());
  }
  for (CommBase* c : comms) c->release_backend();
}

void WorldContext::add_progressable(const std::shared_ptr<Progressable>& p) {
  std::lock_guard<std::mutex> lock(progress_mu_);
  progress_.push_back(p);
}

void WorldContext::progress_all() {
  std::vector<std::shared_ptr<Progressable>> live;
  {
    std::lock_guard<std::mutex> lock(progress_mu_);
    if (progress_.empty()) return;
    live.reserve(progress_.size());
    for (auto& w : progress_) {
      if (auto p = w.lock()) live.push_back(std::move(p));
    }
  }
  std::vector<Progressable*> finished;
  for (auto& p : live) {
    if (p->progress_noexcept()) finished.push_back(p.get());
  }
  std::lock_guard<std::mutex> lock(progress_mu_);
  progress_.erase(std::remove_if(progress_.begin(), progress_.end(),
                                 [&](const std::weak_ptr<Progressable>& w) {
                                   auto p = w.lock();
                                   return !p || std::find(finished.begin(), finished.end(),
                                                          p.get()) != finished.end();
                                 }),
                  progress_.end());
}

void WorldContext::bury(std::shared_ptr<void> keep_alive) {
  if (!keep_alive) return;
  std::lock_guard<std::mutex> lock(mu_);
  graveyard_.push_back(std::move(keep_alive));
}

std::string WorldContext::next_world_uid(const std::string& backend) {
  std::lock_guard<std::mutex> lock(mu_);
  int n = world_counts_[backend]++;
  return fmt::format("world.{}.{}", backend, n);
}

}  // namespace parallax::comm::detail
