#include "comm/topology.h"

#include "core/error.h"

namespace parallax::comm {

std::string RankLayout::to_string() const {
  return fmt::format("dp={} x tp={} x pp={}", dp, tp, pp);
}

RankLayout resolve_layout(int world_size, int dp, int tp, int pp, int gpus_per_node) {
  PARALLAX_CHECK(world_size >= 1, LayoutError, "parallel layout: world size {} must be at least 1",
                 world_size);
  PARALLAX_CHECK(tp >= 1 && pp >= 1 && dp >= 0, LayoutError,
                 "parallel layout: tp={} and pp={} must be at least 1 and dp={} at least 0", tp, pp,
                 dp);
  RankLayout l{dp, tp, pp};
  if (dp == 0) {
    PARALLAX_CHECK(world_size % (tp * pp) == 0, LayoutError,
                   "parallel layout: dp=0 (auto) needs the world size {} to be divisible by tp * "
                   "pp = {} * {} = {}",
                   world_size, tp, pp, tp * pp);
    l.dp = world_size / (tp * pp);
  }
  PARALLAX_CHECK(
      l.world() == world_size, LayoutError,
      "parallel layout: dp * tp * pp = {} * {} * {} = {} does not equal the world size {}", l.dp,
      l.tp, l.pp, l.world(), world_size);
  if (gpus_per_node > 0) {
    PARALLAX_CHECK(tp <= gpus_per_node, LayoutError,
                   "parallel layout: tp={} is larger than the {} GPUs per node (a TP group must "
                   "stay inside one node)",
                   tp, gpus_per_node);
    PARALLAX_CHECK(gpus_per_node % tp == 0, LayoutError,
                   "parallel layout: tp={} does not divide the {} GPUs per node, so some TP groups "
                   "would span two nodes",
                   tp, gpus_per_node);
  }
  return l;
}

int rank_of(const RankLayout& l, const Coord& c) {
  return c.pp * (l.dp * l.tp) + c.dp * l.tp + c.tp;
}

Coord coord_of(const RankLayout& l, int r) {
  PARALLAX_CHECK(r >= 0 && r < l.world(), LayoutError,
                 "rank {} is outside the layout {} of {} ranks", r, l.to_string(), l.world());
  Coord c;
  c.tp = r % l.tp;
  c.dp = (r / l.tp) % l.dp;
  c.pp = r / (l.tp * l.dp);
  return c;
}

std::vector<int> group_ranks(const RankLayout& l, const std::string& name, int r) {
  const Coord me = coord_of(l, r);
  std::vector<int> out;
  if (name == "tp") {
    for (int i = 0; i < l.tp; ++i) out.push_back(rank_of(l, {me.dp, i, me.pp}));
  } else if (name == "dp") {
    for (int i = 0; i < l.dp; ++i) out.push_back(rank_of(l, {i, me.tp, me.pp}));
  } else if (name == "pp") {
    for (int i = 0; i < l.pp; ++i) out.push_back(rank_of(l, {me.dp, me.tp, i}));
  } else if (name == "world") {
    for (int i = 0; i < l.world(); ++i) out.push_back(i);
  } else {
    throw_error<CommError>("unknown group '{}' (use tp|dp|pp|world)", name);
  }
  return out;
}

Topology::Topology(CommPtr world, RankLayout layout) : world_(std::move(world)), layout_(layout) {
  PARALLAX_CHECK(world_ != nullptr, CommError, "Topology: null world communicator");
  PARALLAX_CHECK(layout_.world() == world_->size(), LayoutError,
                 "parallel layout {} has {} ranks but the world communicator has {}",
                 layout_.to_string(), layout_.world(), world_->size());
  const int r = world_->rank();
  coord_ = coord_of(layout_, r);
  const Coord& c = coord_;
  const RankLayout& l = layout_;
  groups_["world"] = world_;
  owner_["world"] = "world";
  // A group whose ranks are those of a group made before it (dp = world when tp = pp = 1, every
  // 1-rank group) shares that communicator instead of splitting a
  // new one: each NCCL communicator holds its connection buffers (connected at creation, see
  // CommOptions::nccl_blocking), so duplicates would cost device memory for nothing. Whether two
  // groups coincide depends only on the layout, so every rank makes the same splits.
  const auto make = [&](const std::string& name, int color, int key) {
    const std::vector<int> members = group_ranks(l, name, r);
    for (const char* prev : {"world", "tp", "dp", "pp"}) {
      auto it = groups_.find(prev);
      if (it != groups_.end() && it->second->world_ranks() == members) {
        groups_[name] = it->second;
        owner_[name] = owner_[prev];
        return;
      }
    }
    groups_[name] = world_->split(color, key, name);
    owner_[name] = name;
  };
  make("tp", c.pp * l.dp + c.dp, c.tp);
  make("dp", c.pp * l.tp + c.tp, c.dp);
  make("pp", c.dp * l.tp + c.tp, c.pp);
}

const std::string& Topology::communicator_of(const std::string& name) const {
  auto it = owner_.find(name);
  PARALLAX_CHECK(it != owner_.end(), CommError, "unknown group '{}' (known: tp, dp, pp, world)",
                 name);
  return it->second;
}

const CommPtr& Topology::group(const std::string& name) const {
  auto it = groups_.find(name);
  PARALLAX_CHECK(it != groups_.end(), CommError, "unknown group '{}' (known: tp, dp, pp, world)",
                 name);
  return it->second;
}

}  // namespace parallax::comm
