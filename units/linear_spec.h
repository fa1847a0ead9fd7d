// The linear layers of attention and MLP blocks come from a factory: the model zoo states each
// layer as a spec (its shape, its role in Megatron's vocabulary, its fused-part layout), and the
// factory builds it: models/layers.h's dense_linear by default, parallel/tensor's column- and
// row-parallel layers under tensor parallelism (parallel_linear_factory). So the layers name no
// parallel layer, and tensor parallelism swaps its layers in without forking any model code.
//
// In units/, not models/, for the reason units/unit_hooks.h is: both sides name it, and
// parallel/ may not include models/ (ARCHITECTURE §1). models::LinearSpec and
// parallel::tensor::LinearSpec are using-declarations of these. units/tp_layers.h is how a model
// gets the tensor-parallel factory without naming parallel/tensor.
#pragma once

#include <torch/nn/modules/container/any.h>

#include <cstdint>
#include <functional>
#include <string>

namespace parallax::units {

// Role of a linear layer inside a transformer block, in Megatron's vocabulary: column-parallel
// layers split along outputs (qkv, fc1), row-parallel layers along inputs (proj, fc2). A dense
// factory ignores it.
enum class LinearRole { kColumn, kRow };

struct LinearSpec {
  int64_t in_features = 0;
  int64_t out_features = 0;
  bool bias = true;
  LinearRole role = LinearRole::kColumn;
  std::string name;   // the layer's name in its block ("qkv", "fc1"), for messages
  int64_t parts = 1;  // fused parts along the output (qkv: 3 = q, k, v), each split on its own
  // Column: all-gather the output so every rank holds all out_features (the consumer is
  // replicated, e.g. a classification head). Row: the input arrives whole and is split here.
  bool gather_output = false;
  bool input_is_parallel = true;
  // Under sequence parallelism: the layer sits in the sharded region (a column layer's input, a
  // row layer's output is a row shard of the tokens). false: the layer's input and output are
  // replicated as without sequence parallelism (a classification head after the region).
  bool in_sequence_region = true;
};

// Builds one linear layer. The returned module maps [..., in_features] to [..., out_features']
// where out_features' may be a shard of out_features (column parallel); blocks derive head counts
// from the actual output width.
using LinearFactory = std::function<torch::nn::AnyModule(const LinearSpec&)>;

}  // namespace parallax::units
