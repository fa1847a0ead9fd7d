#include "parallel/pipeline/split_backward.h"

#include "core/error.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <deque>
#include <unordered_map>
#include <unordered_set>

namespace parallax::parallel::pipeline {

namespace {

using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;
using NodePtr = decltype(Edge{}.function);  // std::shared_ptr or c10::intrusive_ptr by version

// The gradients that reached each boundary node in B.
struct Captured {
  std::vector<variable_list> grads;
};

class CaptureHook final : public torch::autograd::FunctionPreHook {
 public:
  CaptureHook(std::shared_ptr<Captured> store, std::size_t index)
      : store_(std::move(store)), index_(index) {}
  variable_list operator()(const variable_list& grads) override {
    store_->grads[index_] = grads;
    return grads;
  }

 private:
  std::shared_ptr<Captured> store_;
  std::size_t index_;
};

// The autograd graph below some roots, with its reverse edges.
struct Graph {
  std::unordered_map<Node*, std::vector<Node*>> parents;
  std::unordered_map<Node*, NodePtr> owner;  // every node of the graph, held

  explicit Graph(const std::vector<Edge>& root_edges) {
    std::deque<Node*> queue;
    for (const Edge& e : root_edges) {
      if (e.function && owner.emplace(e.function.get(), e.function).second)
        queue.push_back(e.function.get());
    }
    while (!queue.empty()) {
      Node* n = queue.front();
      queue.pop_front();
      for (const Edge& e : n->next_edges()) {
        if (!e.is_valid()) continue;
        Node* c = e.function.get();
        parents[c].push_back(n);
        if (owner.emplace(c, e.function).second) queue.push_back(c);
      }
    }
  }

  // The nodes of the graph with a path to one of `from` (those included).
  std::unordered_set<Node*> reverse_closure(const std::vector<Node*>& from) const {
    std::unordered_set<Node*> out;
    std::deque<Node*> q;
    for (Node* n : from)
      if (owner.count(n) && out.insert(n).second) q.push_back(n);
    while (!q.empty()) {
      Node* n = q.front();
      q.pop_front();
      const auto it = parents.find(n);
      if (it == parents.end()) continue;
      for (Node* p : it->second)
        if (out.insert(p).second) q.push_back(p);
    }
    return out;
  }
};

}  // namespace

struct SplitBackward::State {
  std::vector<NodePtr> boundary;              // U
  std::vector<std::vector<std::size_t>> cut;  // per node of U: its next edges into E
  std::vector<const torch::autograd::FunctionPreHook*> hooks;
  std::shared_ptr<Captured> captured = std::make_shared<Captured>();
  std::vector<Edge> free_roots;  // roots no input's gradient flows through, that reach a parameter
  variable_list free_root_grads;
  std::vector<Edge> param_edges;
  bool done = false;

  void remove_hooks() {
    for (std::size_t k = 0; k < boundary.size(); ++k) {
      auto& pre = boundary[k]->pre_hooks();
      pre.erase(std::remove_if(pre.begin(), pre.end(),
                               [&](const auto& h) { return h.get() == hooks[k]; }),
                pre.end());
    }
    hooks.clear();
  }
};

SplitBackward::SplitBackward(const std::vector<at::Tensor>& roots,
                             const std::vector<at::Tensor>& root_grads,
                             const std::vector<at::Tensor>& inputs,
                             const std::vector<at::Tensor>& params)
    : state_(std::make_unique<State>()) {
  PARALLAX_CHECK(root_grads.empty() || root_grads.size() == roots.size(), Error,
                 "split backward: {} gradients for {} roots", root_grads.size(), roots.size());
  std::vector<at::Tensor> root_tensors, grads;
  std::vector<Edge> root_edges;
  for (std::size_t k = 0; k < roots.size(); ++k) {
    if (!roots[k].defined() || !roots[k].requires_grad()) continue;
    root_tensors.push_back(roots[k]);
    grads.push_back(root_grads.empty() ? at::ones_like(roots[k]) : root_grads[k]);
    root_edges.push_back(torch::autograd::impl::gradient_edge(roots[k]));
  }
  input_grads_.assign(inputs.size(), at::Tensor());
  if (root_edges.empty()) {
    state_->done = true;
    return;
  }
  const Graph graph(root_edges);
  // E: what B runs (every node with a path to an input's accumulator).
  std::vector<at::Tensor> wanted;
  std::vector<std::size_t> wanted_index;
  std::vector<Node*> input_nodes;
  for (std::size_t k = 0; k < inputs.size(); ++k) {
    const at::Tensor& x = inputs[k];
    if (!x.defined() || !x.requires_grad()) continue;
    PARALLAX_CHECK(x.is_leaf(), Error,
                   "split backward: input {} is not a leaf of the graph (a stage's inputs are "
                   "the tensors it received)",
                   k);
    const auto acc = torch::autograd::impl::grad_accumulator(x);
    if (!acc || !graph.owner.count(acc.get())) continue;  // the roots do not depend on it
    wanted.push_back(x);
    wanted_index.push_back(k);
    input_nodes.push_back(acc.get());
  }
  const std::unordered_set<Node*> E = graph.reverse_closure(input_nodes);
  input_path_nodes_ = E.size();
  // The parameter side: every node with a path to a parameter's accumulator.
  std::vector<Node*> param_nodes;
  for (const at::Tensor& p : params) {
    if (!p.defined() || !p.requires_grad()) continue;
    const auto acc = torch::autograd::impl::grad_accumulator(p);
    if (!acc || !graph.owner.count(acc.get())) continue;  // unused by this graph
    param_nodes.push_back(acc.get());
    state_->param_edges.push_back(torch::autograd::impl::gradient_edge(p));
  }
  const std::unordered_set<Node*> R = graph.reverse_closure(param_nodes);
  // U, and the edges W must not follow (back into E).
  for (Node* n : E) {
    if (!R.count(n)) continue;
    bool exits = false;
    std::vector<std::size_t> cut;
    const auto& next = n->next_edges();
    for (std::size_t i = 0; i < next.size(); ++i) {
      if (!next[i].is_valid()) continue;
      Node* c = next[i].function.get();
      if (E.count(c)) {
        cut.push_back(i);
      } else if (R.count(c)) {
        exits = true;
      }
    }
    if (!exits) continue;
    state_->boundary.push_back(graph.owner.at(n));
    state_->cut.push_back(std::move(cut));
  }
  for (std::size_t k = 0; k < root_edges.size(); ++k) {
    Node* n = root_edges[k].function.get();
    if (!E.count(n) && R.count(n)) {
      state_->free_roots.push_back(root_edges[k]);
      state_->free_root_grads.push_back(grads[k]);
    }
  }
  // B, keeping what reaches U.
  state_->captured->grads.resize(state_->boundary.size());
  for (std::size_t k = 0; k < state_->boundary.size(); ++k) {
    auto hook = std::make_unique<CaptureHook>(state_->captured, k);
    state_->hooks.push_back(hook.get());
    state_->boundary[k]->add_pre_hook(std::move(hook));
  }
  if (!wanted.empty()) {
    const variable_list g =
        torch::autograd::grad(root_tensors, wanted, grads, /*retain_graph=*/true,
                              /*create_graph=*/false, /*allow_unused=*/true);
    for (std::size_t k = 0; k < wanted.size(); ++k) input_grads_[wanted_index[k]] = g[k];
  }
  state_->remove_hooks();
}

SplitBackward::~SplitBackward() {
  if (state_ && !state_->hooks.empty()) state_->remove_hooks();
}

std::size_t SplitBackward::boundary_nodes() const {
  return state_ ? state_->boundary.size() : 0;
}

void SplitBackward::weight_pass() {
  PARALLAX_CHECK(state_ != nullptr, Error, "split backward: a second weight pass");
  std::unique_ptr<State> st = std::move(state_);
  if (st->done || st->param_edges.empty()) return;
  std::vector<Edge> roots = st->free_roots;
  variable_list grads = st->free_root_grads;
  for (std::size_t k = 0; k < st->boundary.size(); ++k) {
    const NodePtr& u = st->boundary[k];
    // Plain assignment: set_next_edge() would re-derive the topological order, which autograd
    // forbids once a node has parents (cutting an edge keeps that order valid).
    for (std::size_t i : st->cut[k]) u->next_edges()[i] = Edge();
    const variable_list& g = st->captured->grads[k];
    for (std::size_t j = 0; j < g.size(); ++j) {
      if (!g[j].defined()) continue;
      roots.emplace_back(u, static_cast<uint32_t>(j));
      grads.push_back(g[j]);
    }
  }
  st->captured->grads.clear();
  if (roots.empty()) return;
  torch::autograd::Engine::get_default_engine().execute(roots, grads, /*keep_graph=*/false,
                                                        /*create_graph=*/false,
                                                        /*accumulate_grad=*/true, st->param_edges);
}

}  // namespace parallax::parallel::pipeline
