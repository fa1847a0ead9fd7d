// The hooks a model calls around the forward of each of its units (models/model.h: Unit,
// Model::units(), set_unit_hooks()). Defined in units/, below both models/ and parallel/, so that
// a parallel engine (ZeRO-3 gathers and frees, pipeline cuts) implements what a model calls without
// either including the other.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace parallax::units {

// One unit: a contiguous piece of the forward that owns a disjoint set of parameters (models/
// model.h: Model::units(); parallel engines receive the list as plain data).
struct Unit {
  std::string name;  // e.g. "encoder.vit.embed", "encoder.vit.block3", "heads"
  // Full names as in Model::named_parameters(), in registration order.
  std::vector<std::string> param_names;
};

// Called by the model around each unit's forward, in unit order (ZeRO-3 gathers a unit's
// parameters in before_unit and frees them in after_unit; a pipeline engine cuts between units).
//
// Contract the models keep (tests/models/units_test.cpp checks it for every model): between
// before_unit(i) and after_unit(i) the forward reads the parameters of unit i and of no other
// unit; outside every such window it reads no parameter at all (loss() included). A unit's
// backward reads only its own parameters, so an engine that gathers them again when the gradient
// of the unit's outputs arrives (a hook on `outputs`) has everything the backward needs, including
// the recomputation of a recomputed block (units/parallel_model.h: Recompute), which runs inside
// its unit's backward. A forward that throws inside a unit does not call after_unit for it.
class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  virtual void before_unit(int index) = 0;
  // `outputs`: the tensors the unit returned (the activations that flow to the next unit), so an
  // engine can attach autograd hooks to them (re-gather before the unit's backward).
  virtual void after_unit(int index, const std::vector<at::Tensor>& outputs) = 0;
};

}  // namespace parallax::units
