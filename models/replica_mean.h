// The mean of a small float tensor over the data-parallel replicas, on the tensor's device and
// without a host sync: what a loss uses for normalisers that count things in the batch. The
// trainer installs one on the model around each training step (Model::set_replica_mean); empty
// means this replica alone.
#pragma once

#include "units/parallel_model.h"

namespace parallax::models {

using ReplicaMean = units::ReplicaMean;

}  // namespace parallax::models
