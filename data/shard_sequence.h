// A scene group's optional sequence fields (docs/data.md, "Sequences"), for shard.cpp: the
// attributes `sequence`, `frame`, `prev_index` and `timestamp_us` (int64) and the dataset
// `instance_ids` (int64 [K]). Callers hold the HDF5 lock. Every failure is a DataError naming the
// shard, the scene and the field.
#pragma once

#include "data/hdf5_util.h"
#include "data/schema.h"
#include "data/shard.h"

#include <string>

namespace parallax::data {

// Writes what `s` has of them (nothing for an independent scene). `ctx` names shard and scene.
void write_sequence_fields(hid_t group, const SceneRecord& s, const std::string& ctx);

// The attributes of scene `index`, checked: `sequence` and `frame` together and >= 0,
// `prev_index` -1 or an earlier scene of the split (0 <= prev_index < index).
SequenceInfo read_sequence_info(hid_t group, int64_t index, const std::string& where);

// Those attributes and `instance_ids` into `rec` (whose boxes are read), checked: instance_ids
// an integer [K] with K the boxes' rows.
void read_sequence_fields(hid_t group, SceneRecord& rec, const std::string& where);

}  // namespace parallax::data
