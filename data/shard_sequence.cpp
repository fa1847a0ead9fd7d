#include "data/shard_sequence.h"

#include "core/error.h"

#include <fmt/format.h>

namespace parallax::data {
namespace {

constexpr const char* kSequence = "sequence";
constexpr const char* kFrame = "frame";
constexpr const char* kPrevIndex = "prev_index";
constexpr const char* kTimestamp = "timestamp_us";
constexpr const char* kInstanceIds = "instance_ids";

}  // namespace

void write_sequence_fields(hid_t group, const SceneRecord& s, const std::string& ctx) {
  if (s.instance_ids.defined()) {
    if (s.instance_ids.dim() != 1 || s.instance_ids.size(0) != s.boxes.size(0)) {
      throw_error<DataError>("{}: instance_ids [{}] for {} boxes (one id per box)", ctx,
                             fmt::join(s.instance_ids.sizes(), ", "), s.boxes.size(0));
    }
    h5::write_tensor(group, kInstanceIds, s.instance_ids.to(at::kLong).contiguous(), {0, {}, true},
                     ctx);
  }
  if (s.timestamp_us >= 0) h5::write_int_attribute(group, kTimestamp, s.timestamp_us, ctx);
  if (s.sequence < 0) return;
  h5::write_int_attribute(group, kSequence, s.sequence, ctx);
  h5::write_int_attribute(group, kFrame, s.frame, ctx);
  h5::write_int_attribute(group, kPrevIndex, s.prev_index, ctx);
}

SequenceInfo read_sequence_info(hid_t group, int64_t index, const std::string& w) {
  SequenceInfo info;
  const auto seq = h5::read_int_attribute(group, kSequence, w);
  const auto frame = h5::read_int_attribute(group, kFrame, w);
  const auto prev = h5::read_int_attribute(group, kPrevIndex, w);
  if (const auto t = h5::read_int_attribute(group, kTimestamp, w)) info.timestamp_us = *t;
  if (!seq && !frame && !prev) return info;
  if (!seq || !frame || !prev) {
    throw_error<DataError>(
        "{}: attributes '{}', '{}' and '{}' come together (a frame of a sequence) or not at all", w,
        kSequence, kFrame, kPrevIndex);
  }
  if (*seq < 0 || *frame < 0) {
    throw_error<DataError>("{}: attribute '{}' is {} and '{}' {} (ids are >= 0)", w, kSequence,
                           *seq, kFrame, *frame);
  }
  // An earlier scene of the same split: what a reader walking back can open, and never a loop.
  if (*prev != -1 && (*prev < 0 || *prev >= index)) {
    throw_error<DataError>(
        "{}: attribute '{}' is {}, not an earlier scene of the split (-1 at a sequence start, "
        "else 0..{})",
        w, kPrevIndex, *prev, index - 1);
  }
  info.sequence = *seq;
  info.frame = *frame;
  info.prev_index = *prev;
  return info;
}

void read_sequence_fields(hid_t group, SceneRecord& rec, const std::string& w) {
  const SequenceInfo info = read_sequence_info(group, rec.index, w);
  rec.sequence = info.sequence;
  rec.frame = info.frame;
  rec.prev_index = info.prev_index;
  rec.timestamp_us = info.timestamp_us;
  if (!h5::link_exists(group, kInstanceIds)) return;
  const std::string ctx = fmt::format("{}: dataset '{}'", w, kInstanceIds);
  h5::Id ds(H5Dopen2(group, kInstanceIds, H5P_DEFAULT), ctx + ": cannot open");
  const h5::DatasetShape shape = h5::dataset_shape(ds, ctx);
  if (shape.type_class != H5T_INTEGER || shape.dims.size() != 1 ||
      shape.dims[0] != rec.boxes.size(0)) {
    throw_error<DataError>("{} is {}, expected int64 [{}] (one id per box)", ctx, shape.describe(),
                           rec.boxes.size(0));
  }
  rec.instance_ids = h5::read_tensor(ds, shape, at::kLong, ctx + ": cannot read (corrupt shard?)");
}

}  // namespace parallax::data
