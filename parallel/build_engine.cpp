#include "parallel/build_engine.h"

#include "core/error.h"
#include "parallel/ddp/ddp_engine.h"
#include "parallel/zero/zero.h"

namespace parallax::parallel {

std::unique_ptr<Engine> build_engine(const Plan& plan, std::shared_ptr<torch::nn::Module> module,
                                     std::vector<optim::ParamGroup> groups,
                                     const OptimizerFactory& make, comm::CommPtr dp,
                                     const ddp::DdpOptions& ddp, std::vector<units::Unit> units,
                                     TensorParallelInfo tp,
                                     std::shared_ptr<const units::DeferredInit> deferred) {
  PARALLAX_CHECK(!deferred || plan.zero_stage == 3, Error,
                 "build_engine: deferred initialisation needs ZeRO-3 (zero stage {})",
                 plan.zero_stage);
  if (plan.zero_stage == 0) {
    return std::make_unique<ddp::DdpEngine>(std::move(module), std::move(groups), make,
                                            std::move(dp), ddp, std::move(tp));
  }
  return std::make_unique<zero::ZeroEngine>(
      std::move(module), std::move(groups), make, std::move(dp), ddp, plan.zero_stage,
      std::move(units), plan.zero_prefetch, false, std::move(tp), std::move(deferred));
}

}  // namespace parallax::parallel
