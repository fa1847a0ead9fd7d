// zb's split backward (ZB-H1, Qi et al. 2024): the input-gradient pass B of a pipeline stage
// and its deferred weight-gradient pass W, each walking its part of the autograd graph once.
//
// B computes the gradients of the stage's inputs. Before it runs, the graph is cut in two: E, the
// nodes through which some input's gradient flows (what B executes), and the rest. The boundary
// U, each node of E with an edge into a part of the rest that reaches a trained parameter (a
// Linear's matmul node: one edge to the activation path, one to its weight), keeps the gradient
// that reached it in B (a pre-hook on the node). W then runs one engine pass from U with those
// gradients (and from the roots that no input's gradient flows through, with their gradients),
// with U's edges back into E cut: each node of U computes only its parameter-side outputs
// (autograd runs only the outputs a pass needs) and everything below it that only parameters
// need runs once. So B + W do the work of one whole backward, where W as a second
// autograd::grad from the roots re-ran the activation path (PyTorch's pipelining does the same
// split: stage_backward_input / stage_backward_weight).
//
// W accumulates into the parameters' .grad through their AccumulateGrad nodes, once per
// parameter, so a data-parallel engine's hooks see it as one backward.
//
// Thread-safety: one training thread; the graph must not be used elsewhere between B and W.
// Errors: parallax::Error for a W without its B, or a second W.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

namespace parallax::parallel::pipeline {

class SplitBackward {
 public:
  // B: the gradients of `inputs` (one per input; undefined where an input does not require grad
  // or does not reach the roots) given `roots` and their gradients (`root_grads` empty: a scalar
  // loss, gradient 1). `params`: the parameters W will accumulate into. The graph is kept for W.
  SplitBackward(const std::vector<at::Tensor>& roots, const std::vector<at::Tensor>& root_grads,
                const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& params);
  ~SplitBackward();
  SplitBackward(const SplitBackward&) = delete;
  SplitBackward& operator=(const SplitBackward&) = delete;

  const std::vector<at::Tensor>& input_grads() const { return input_grads_; }
  // W: accumulates the parameters' gradients and frees the graph.
  void weight_pass();
  // Nodes of the graph that B executed, and the boundary nodes W starts from (for tests).
  std::size_t input_path_nodes() const { return input_path_nodes_; }
  std::size_t boundary_nodes() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
  std::vector<at::Tensor> input_grads_;
  std::size_t input_path_nodes_ = 0;
};

}  // namespace parallax::parallel::pipeline
