#include "parallel/state.h"

#include "comm/topology.h"

#include <algorithm>
#include <set>
#include <string>

namespace parallax::parallel {

namespace {

// The tp layout of the tensor a piece belongs to: the parameter's own ("<param>") or that of its
// optimizer state ("<param>.<state>"); null for whole, replicated tensors.
const tensor::ParamLayout* split_layout(const std::map<std::string, tensor::ParamLayout>& layouts,
                                        const StatePiece& piece) {
  if (piece.tensor.dim() == 0) return nullptr;  // per-parameter scalars are the same everywhere
  auto it = layouts.find(piece.name);
  if (it == layouts.end()) {
    const auto dot = piece.name.rfind('.');
    if (dot != std::string::npos) it = layouts.find(piece.name.substr(0, dot));
  }
  return it == layouts.end() ? nullptr : &it->second;
}

// The boxes of the whole (single-process) tensor that `p`, a piece of a tp-split tensor, holds,
// each with a view of the piece's tensor: a whole local tensor gives one box per fused part
// (tensor::split_boxes); a flat range of it (ZeRO) first gives the boxes of the range in the local
// tensor (flat_range_boxes), each then cut at the part boundaries (the split dimension of a fused
// layer is 0, and a contiguous box of several rows spans whole trailing dimensions, so every cut
// stays contiguous) and moved to where that part's rows sit in the whole tensor.
std::vector<tensor::SplitBox> split_piece_boxes(const StatePiece& p, const tensor::ParamLayout& l) {
  if (p.flat_begin < 0) return tensor::split_boxes(p.tensor, l);
  const std::vector<int64_t>& local = p.global_shape;  // an engine's pieces are of the local tensor
  const auto d = static_cast<std::size_t>(l.dim);
  const int64_t per_part = local.at(d) / l.parts;
  std::vector<tensor::SplitBox> out;
  int64_t at = 0;
  for (const Box& b : flat_range_boxes(local, p.flat_begin, p.flat_begin + p.tensor.numel())) {
    const at::Tensor run = p.tensor.narrow(0, at, b.numel());
    at += b.numel();
    int64_t row = 0;  // along d, within the box
    while (row < b.lengths[d]) {
      const int64_t first = b.offsets[d] + row, k = first / per_part;
      const int64_t rows = std::min(b.lengths[d] - row, (k + 1) * per_part - first);
      std::vector<int64_t> lengths = b.lengths, offsets = b.offsets;
      lengths[d] = rows;
      offsets[d] = (k * l.size + l.rank) * per_part + (first - k * per_part);
      const int64_t inner = b.numel() / b.lengths[d];  // elements per unit of dimension d
      out.push_back({run.narrow(0, row * inner, rows * inner).view(lengths), offsets});
      row += rows;
    }
  }
  return out;
}

}  // namespace

std::vector<StatePiece> module_pieces(const torch::nn::Module& module,
                                      const std::vector<int>& replicas) {
  std::vector<StatePiece> pieces;
  auto whole = [&](const std::string& name, const at::Tensor& t) {
    if (!t.defined()) return;
    pieces.push_back({name, t.detach(), t.sizes().vec(),
                      std::vector<int64_t>(static_cast<std::size_t>(t.dim()), 0), replicas});
  };
  for (const auto& it : module.named_parameters()) whole(it.key(), it.value());
  for (const auto& it : module.named_buffers()) whole(it.key(), it.value());
  return pieces;
}

std::vector<StatePiece> global_pieces(std::vector<StatePiece> pieces,
                                      const TensorParallelInfo& tp) {
  if (!tp.active()) return pieces;
  std::vector<StatePiece> out;
  for (auto& p : pieces) {
    const tensor::ParamLayout* l = split_layout(tp.layouts, p);
    if (l == nullptr) {
      std::set<int> reps;
      for (int r : p.replicas)
        for (int q : comm::group_ranks(tp.layout, "tp", r)) reps.insert(q);
      if (p.replicas.empty()) {
        for (int q : tp.tp->world_ranks()) reps.insert(q);
      }
      p.replicas.assign(reps.begin(), reps.end());
      out.push_back(std::move(p));
      continue;
    }
    const std::vector<int64_t> whole =
        tensor::global_shape(p.flat_begin < 0 ? p.tensor.sizes().vec() : p.global_shape, *l);
    for (auto& box : split_piece_boxes(p, *l))
      out.push_back({p.name, box.local, whole, box.offsets, p.replicas});
  }
  return out;
}

}  // namespace parallax::parallel
