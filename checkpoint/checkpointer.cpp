// The public face of saving: options checked once, then each save handed to the commit protocol
// (commit.h) on the training thread (sync) or, after a snapshot, on the background writer
// (async_save.h). The rank file, the shard index, the bounded store and pruning have files of
// their own (rank_file.h, shard_index.h, bounded_store.h, prune.h).
#include "checkpoint/checkpointer.h"

#include "checkpoint/async_save.h"
#include "checkpoint/commit.h"
#include "comm/world.h"
#include "core/error.h"
#include "core/log.h"
#include "core/strings.h"
#include "core/timer.h"

#include <exception>

namespace parallax::checkpoint {
namespace {

// The options as the protocol runs them: a default layout means dp = world; throws on values the
// protocol cannot run with.
CheckpointerOptions checked_options(CheckpointerOptions o, const CommitGroup& g) {
  PARALLAX_CHECK(g.world >= 1 && g.rank >= 0 && g.rank < g.world, CheckpointError,
                 "checkpoint group: rank {} of world {} is invalid", g.rank, g.world);
  if (o.layout.world() == 1 && g.world > 1) o.layout.dp = g.world;
  PARALLAX_CHECK(o.layout.world() == g.world, LayoutError,
                 "checkpoint layout {} has {} ranks but the world has {}", o.layout.to_string(),
                 o.layout.world(), g.world);
  PARALLAX_CHECK(o.block_bytes >= 4096, CheckpointError, "checkpoint block_bytes {} is below 4096",
                 o.block_bytes);
  PARALLAX_CHECK(o.timeout_s > 0, CheckpointError, "checkpoint timeout {} s is not positive",
                 o.timeout_s);
  if (g.world > 1) {
    PARALLAX_CHECK(g.store, CheckpointError,
                   "rank {}: checkpoints on {} ranks need the World's out-of-band store, which is "
                   "not available "
                   "(see the warning at start-up)",
                   g.rank, g.world);
  }
  return o;
}

}  // namespace

CommitGroup CommitGroup::from_world() {
  CommitGroup g;
  if (!comm::World::exists()) return g;
  auto& w = comm::World::current();
  g.rank = w.rank();
  g.world = w.size();
  g.store = w.store();
  return g;
}

struct Checkpointer::Impl {
  Impl(std::string dir, CheckpointerOptions opts, CommitGroup group)
      : protocol(std::move(dir), checked_options(std::move(opts), group), group) {}

  // Records the stats of a background save that committed.
  void collected(const std::optional<SaveStats>& st) {
    if (!st) return;
    last = *st;
    core::log::info("checkpoint: saved step {} to '{}' in the background ({} in {:.2f} s)",
                    st->step, st->path, core::human_bytes(static_cast<double>(st->bytes)),
                    st->total_s);
  }

  CommitProtocol protocol;
  AsyncSaveWorker worker;
  int64_t seq = 0;
  std::optional<SaveStats> last;
};

Checkpointer::Checkpointer(std::string checkpoints_dir, CheckpointerOptions options,
                           CommitGroup group)
    : impl_(std::make_unique<Impl>(std::move(checkpoints_dir), std::move(options),
                                   std::move(group))) {}

Checkpointer::~Checkpointer() {
  try {
    impl_->worker.join();
  } catch (const std::exception& e) {
    core::log::error("checkpoint: the last background save failed and nobody asked: {}", e.what());
  } catch (...) {
  }
}

void Checkpointer::save(int64_t step, const SaveState& state) {
  Impl& I = *impl_;
  wait();
  PARALLAX_CHECK(step >= 0, CheckpointError, "checkpoint step {} is negative", step);
  core::Stopwatch blocking;
  const CommitGroup& group = I.protocol.group();
  SaveJob job;
  job.step = step;
  job.seq = I.seq++;
  job.entries = select_owned(state, group.rank, group.world);
  job.extra = state.extra();
  if (!I.protocol.options().async) {
    SaveStats st = I.protocol.run(job);
    st.blocking_s = blocking.elapsed_s();
    I.last = st;
    core::log::info("checkpoint: saved step {} to '{}' ({} in {:.2f} s)", step, st.path,
                    core::human_bytes(static_cast<double>(st.bytes)), st.total_s);
    return;
  }
  job = I.worker.snapshot(std::move(job));
  const double blocked = blocking.elapsed_s();
  I.worker.start(std::move(job), [&I, blocked](SaveJob& j) {
    SaveStats st = I.protocol.run(j);
    st.blocking_s = blocked;
    st.total_s += blocked;  // run() times the write; total_s counts from save(), snapshot included
    return st;
  });
}

void Checkpointer::poll() {
  if (impl_->worker.finished()) impl_->collected(impl_->worker.join());
}

void Checkpointer::wait() {
  impl_->collected(impl_->worker.join());
}

bool Checkpointer::busy() const {
  return impl_->worker.running() && !impl_->worker.finished();
}
std::optional<SaveStats> Checkpointer::last_save() const {
  return impl_->last;
}
const std::string& Checkpointer::dir() const {
  return impl_->protocol.dir();
}
const CheckpointerOptions& Checkpointer::options() const {
  return impl_->protocol.options();
}

}  // namespace parallax::checkpoint
