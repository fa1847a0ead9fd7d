// optim.param_groups through the engines (optim/param_groups.h, parallel/zero/zero.h): one SGD step
// (momentum 0, weight decay 0) on the bev tiny model with the backbone at lr_mult 0.1 and one ViT
// block frozen moves every parameter by exactly its group's lr times its gradient, and leaves the
// frozen ones bitwise unchanged; on one rank (the plain engine) and under ZeRO-2 over two ranks
// (mpirun), against a single-process reference computed in the same process.
//
// Exactness:
//  - every rank trains on the same batch, so the gradient ZeRO-2 reduce-scatters is the average of
//    n identical fp32 values: (g + g) / 2 = g exactly (a sum of two equal floats is exact, and so
//    is a division by 2), the same g that the reference's plain backward produces from the same
//    weights and batch (one intra-op thread: the same summation order in every process);
//  - at::_fused_sgd_ with momentum 0 and weight decay 0 computes p + (-lr_f) * g in fp32, lr_f the
//    float of the double lr * lr_mult that Optimizer::step passes; the reference
//    p.add(g, -(lr * lr_mult)) rounds the same product and the same sum once each (checked bitwise
//    on this machine: tests/optim ParamGroupsTest.StepUsesEachGroupsLrMult compares the two kernels
//    on random data). A ZeRO rank applies it to its piece of each parameter, element by element.
#include "optim/param_groups.h"
#include "comm/factory.h"
#include "comm/world.h"
#include "core/glob.h"
#include "models/model.h"
#include "models/perception_model.h"
#include "optim/optimizer.h"
#include "parallel/build_engine.h"
#include "tests/common/no_tf32.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <map>

using namespace parallax;
namespace par = parallax::parallel;

namespace {

std::shared_ptr<models::Model> bev_tiny(uint64_t seed) {
  at::manual_seed(seed);
  models::ModelConfig c;
  c.name = "bev";
  c.size = "tiny";
  auto m = models::build_model(c, models::benchmark_scene("tiny"));
  m->train();
  return m;
}

optim::ParamGroupRule rule(const std::string& match, double lr_mult, bool frozen) {
  optim::ParamGroupRule r;
  r.match = match;
  r.lr_mult = lr_mult;
  r.frozen = frozen;
  return r;
}

}  // namespace

TEST(ParamGroupsEngineTest, SgdStepMovesEachParameterByItsGroupsLr) {
  parallax::testing::NoTf32 no_tf32;
  at::set_num_threads(1);
  comm::CommOptions o;
  o.timeout_s = 120;
  comm::CommPtr world = comm::make_world_communicator("mpi", o);
  const int n = world->size();

  // First rule wins: block1 is frozen although "encoder.*" matches it too.
  const optim::GroupSettings settings = optim::group_settings(
      0.0, {rule("encoder.vit.block1.*", 1.0, true), rule("encoder.*", 0.1, false)}, 1.0, {});
  const double lr = 0.5;

  // The batch every rank trains on, and the reference: a plain backward in this process.
  auto ref = bev_tiny(11);
  at::manual_seed(12);
  const core::TensorDict batch = ref->example_batch(2);
  ref->loss(batch, ref->forward(batch)).total.backward();

  auto model = bev_tiny(11);
  std::map<std::string, at::Tensor> before;
  int64_t frozen = 0;
  for (auto& it : model->named_parameters()) {
    before[it.key()] = it.value().detach().clone();
    if (optim::assign_param(it.key(), it.value().dim(), settings).frozen) {
      it.value().requires_grad_(false);  // as the trainer does before any engine (run_param_groups)
      ++frozen;
    }
  }
  ASSERT_GT(frozen, 0);
  optim::NamedParams named;
  for (const auto& it : model->named_parameters()) named.emplace_back(it.key(), it.value());
  par::Plan plan;
  plan.layout.dp = n;
  plan.zero_stage = n > 1 ? 2 : 0;
  par::ddp::DdpOptions ddp;
  ddp.mode = par::ddp::BucketMode::kFlat;
  ddp.first_bucket_mb = 0.05;  // several buckets, cutting parameters across the shards
  ddp.bucket_mb = 0.1;
  auto engine = par::build_engine(
      plan, model, optim::make_param_groups(named, settings),
      [](std::vector<optim::ParamGroup> g) {
        return std::make_unique<optim::Sgd>(std::move(g), 0.0, false, /*fused=*/true);
      },
      world, ddp, model->units());
  model->set_unit_hooks(engine->unit_hooks());
  engine->forward_backward(
      1, [&](int) { return model->loss(batch, model->forward(batch)).total; }, false);
  engine->update(lr);
  model->set_unit_hooks(nullptr);

  const auto ref_params = ref->named_parameters();
  int64_t moved_backbone = 0, checked = 0;
  for (const auto& it : model->named_parameters()) {
    const std::string& name = it.key();
    const at::Tensor now = it.value().detach();
    const at::Tensor& p0 = before.at(name);
    const optim::ParamAssignment a = optim::assign_param(name, now.dim(), settings);
    if (a.frozen) {
      EXPECT_TRUE(at::equal(now, p0)) << name << " is frozen but moved";
      continue;
    }
    const at::Tensor g = ref_params[name].grad();
    if (!g.defined()) {  // no gradient in this forward (unused): SGD leaves it
      EXPECT_TRUE(at::equal(now, p0)) << name;
      continue;
    }
    const double mult = core::glob_match("encoder.*", name) ? 0.1 : 1.0;
    ASSERT_EQ(a.lr_mult, mult) << name;
    const at::Tensor expected = p0.add(g, -(lr * mult));
    EXPECT_TRUE(at::equal(now, expected))
        << name << ": max |diff| " << (now - expected).abs().max().item<double>() << " on rank "
        << world->rank() << " of " << n;
    ++checked;
    if (mult != 1.0 && !at::equal(expected, p0.add(g, -lr))) ++moved_backbone;
  }
  EXPECT_GT(checked, 10);
  // The backbone's lr_mult made a difference the comparison can see.
  EXPECT_GT(moved_backbone, 0);
}
