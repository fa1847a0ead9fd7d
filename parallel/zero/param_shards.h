// ZeRO-3's sharded parameters: each unit's parameters live as 1/N shards between uses, and are
// all-gathered just before the unit's forward and again before its backward, then freed
// (parallel/zero/zero.h builds them; the model calls the hooks through Model::set_unit_hooks).
//
// Layout. A flat parameter is one unit's parameters of one (dtype, optimizer group), or of one
// dtype for its frozen ones, laid end to end in a `full` buffer padded to a multiple of the dp size
// N; rank r keeps elements [r S, (r + 1) S) in its persistent `shard` (S = padded / N). The
// module's parameters are, while gathered, views of `full` (Tensor::set_data, which keeps their
// autograd identity and gradient hooks) and, while freed, empty tensors of their dtype, so a read
// outside a unit's window fails with a shape error rather than reading freed memory. Freeing
// releases the memory of `full`'s storage but keeps the storage object, and a gather re-allocates
// it in place: the views that autograd saved in the forward (a weight's transpose, say) see the
// re-gathered values in the backward, as in FSDP.
//
// When. before_unit(i) gathers unit i (waiting for its prefetch) and, with prefetch on, issues the
// gather of unit i + 1; after_unit(i) frees unit i (the last unit stays for the backward, which
// starts with it) and hooks the unit's outputs: when the gradient of an output arrives, unit i's
// backward is next, so it is gathered again (and unit i - 1 prefetched). In the backward a
// trainable flat parameter is freed as soon as its gradient bucket is complete (every autograd
// node that reads a trainable parameter also feeds that parameter's gradient); a frozen one once
// its unit's trainable buckets are complete and the backward has reached an earlier unit (every
// node that reads it feeds the unit's input gradient or a trainable gradient). What is still
// gathered at the end of the backward is freed then.
//
// Streams. On GPUs the gathers run on a communicator of their own (a split of the dp group), so
// they never queue behind the gradient reduce-scatters on the dp communicator's stream; the
// compute stream waits for a gather only where the unit needs it.
//
// Agreement. Every gather is preceded by a tiny all-gather of (unit, how many times this rank has
// gathered it this step): a unit run a different number of times on different ranks (a
// data-dependent branch) is an error naming the unit and the ranks, never a silent exchange of
// different units' shards. CPU backends check each gather before issuing it; on GPUs the tags are
// checked at the end of each backward (one host read per step), before any optimizer step.
//
// With N = 1 nothing is sharded: the shard is the full buffer, and the hooks do nothing, unless
// `always_gather` asks for the whole machinery anyway (tests of the gather path on one GPU).
//
// Thread-safety: the hooks run on the training thread (forward) and autograd's (backward); one
// mutex guards the state. Errors: parallax::Error (disagreeing ranks), CommError/TimeoutError.
#pragma once

#include "comm/communicator.h"
#include "units/unit_hooks.h"

#include <ATen/core/Tensor.h>

#include <mutex>
#include <string>
#include <vector>

namespace parallax::parallel::zero {

class ParamShards : public units::UnitHooks {
 public:
  // Splits a communicator off `dp` for the gathers (collective over dp when N > 1).
  ParamShards(comm::CommPtr dp, std::vector<units::Unit> units, bool prefetch,
              bool always_gather = false);
  ~ParamShards() override;

  // Registers a flat parameter of unit `unit`: `params` (the module's) are views of `full` at
  // `offsets`; `bucket` is its gradient bucket (-1: frozen). Copies this rank's shard out of
  // `full`, then frees `full` (N > 1).
  void add(int unit, int bucket, std::vector<std::string> names, std::vector<at::Tensor> params,
           std::vector<int64_t> offsets, at::Tensor full);
  // Ends setup (every unit is freed by then).
  void finish_setup();

  struct Flat {
    int unit = 0;
    int bucket = -1;
    std::vector<std::string> names;
    std::vector<at::Tensor> params, views;  // the module's parameters; views of `full`
    std::vector<int64_t> offsets;
    at::Tensor full, shard, placeholder;
    int64_t full_bytes = 0;
    bool gathered = true, done = false;
    comm::WorkPtr work;
  };
  const std::vector<Flat>& flats() const { return flats_; }
  // This rank's shard of flat parameter `f`: elements [rank S, (rank + 1) S) of its full buffer.
  const at::Tensor& shard(std::size_t f) const { return flats_.at(f).shard; }
  int64_t shard_begin(std::size_t f) const;
  // Whether parameters live as shards between units (N > 1, or always_gather).
  bool sharded() const { return active_; }

  void before_unit(int index) override;
  void after_unit(int index, const std::vector<at::Tensor>& outputs) override;

  // The step's gather counters restart (the engine calls it before each step's first forward).
  void begin_step();
  // Gradient bucket `bucket` was issued: its flat parameter is no longer needed (reducer's hook).
  void bucket_launched(std::size_t bucket);
  // After each backward: frees what is still gathered and checks deferred tags.
  void end_backward();

  // Collective: gathers every unit and keeps them whole until release_all() (evaluation, export).
  void gather_all();
  void release_all();
  // Between gather_all() and release_all(): copies this rank's part of every full buffer into its
  // shard, keeping what was written into the gathered parameters (the same values on every rank).
  // No collective.
  void commit_all();

  // Bytes of the parameters this rank holds now: shards plus gathered full buffers.
  int64_t held_bytes() const;

 private:
  void issue(int unit);  // gathers of the unit's flats that are neither gathered nor in flight
  void wait(int unit);   // waits for them (the compute stream, on GPUs)
  void gather(int unit) {
    issue(unit);
    wait(unit);
  }
  void free_flat(Flat& f);
  void free_frozen_if_done(int unit);
  void pre_backward(int unit);
  // Throws naming the units and ranks when a row of gathered (unit, ordinal) tags disagrees.
  void check_tags(const at::Tensor& tags);
  void check_deferred_tags();  // GPUs: the tags gathered since the last check

  comm::CommPtr dp_, gather_;
  std::vector<units::Unit> units_;
  bool prefetch_;
  int n_ = 1;
  bool active_ = false;  // N > 1 or always_gather: gather and free
  std::vector<Flat> flats_;
  std::vector<std::vector<std::size_t>> unit_flats_;
  std::vector<int> trainable_, launched_;  // per unit: trainable flats, and those done
  std::vector<char> passed_;               // per unit: the backward has reached an earlier unit
  std::vector<int> gathers_;               // per unit: gathers this step
  std::vector<long> flat_of_bucket_;
  std::vector<at::Tensor> tags_;          // GPUs: this backward's gathered tags, checked at its end
  std::vector<comm::WorkPtr> tag_works_;  // their collectives, joined before the check
  bool summoned_ = false;
  std::mutex mu_;
};

}  // namespace parallax::parallel::zero
