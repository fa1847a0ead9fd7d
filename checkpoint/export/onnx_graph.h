// The models' GraphBuilder (models/onnx/emitter.h) written with libonnx: an ::onnx::ModelProto
// (IR version of the libonnx build, one opset import of the default domain), ONNX's own strict
// shape inference and checker, and the file, with initializers inline or in one external data file.
//
// Initializers hold raw little-endian bytes. With external data, every initializer of at least
// `external_min_bytes` is appended to the data file as it arrives (4 KiB-aligned offsets, so ONNX
// Runtime can map it) and only its location, offset and length stay in the model: a 3b model never
// holds its weights twice in memory, and the model file stays under protobuf's 2 GiB limit.
//
// Graph outputs are declared without a shape; check() runs shape inference from the inputs alone
// and then requires every output's inferred shape to match the declared one (rank, every non-batch
// dimension; the batch dimension when it is fixed), so "shape inference gives every output its full
// shape" is checked, not asserted. Not thread-safe.
#pragma once

#include "models/onnx/emitter.h"

#include <onnx/onnx_pb.h>

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

namespace parallax::checkpoint::exporter {

// The opset the emitters write (their operator signatures are opset 17's).
inline constexpr int kOnnxOpset = 17;

struct OnnxGraphOptions {
  int opset = kOnnxOpset;
  int64_t batch = 0;                  // 0: symbolic "batch"; else the fixed batch size
  std::string data_file;              // external data file to write ("" = every initializer inline)
  std::string data_location;          // its name as recorded in the model (relative to the model)
  int64_t external_min_bytes = 1024;  // smaller initializers stay inline
};

class OnnxGraph final : public models::onnx::GraphBuilder {
 public:
  // Throws IoError if the external data file cannot be created.
  explicit OnnxGraph(const OnnxGraphOptions& options);

  void add_input(const std::string& name, at::ScalarType dtype,
                 const std::vector<int64_t>& dims) override;
  void add_output(const std::string& name, at::ScalarType dtype,
                  const std::vector<int64_t>& dims) override;
  void add_node(const std::string& op_type, const std::string& node_name,
                const std::vector<std::string>& inputs, const std::vector<std::string>& outputs,
                const std::vector<models::onnx::Attr>& attrs) override;
  void add_initializer(const std::string& name, const at::Tensor& value) override;
  void add_metadata(const std::string& key, const std::string& value) override;

  // Strict shape inference (type checks, data propagation), then each output's inferred shape
  // against its declaration, which then becomes the output's shape (symbolic "batch" or fixed).
  // Throws Error naming the node or output.
  void infer_and_check_shapes();
  // Writes the model to `path` (after finishing the data file) and runs ONNX's checker on the file
  // (which also resolves external data). Throws IoError / Error.
  void write(const std::string& path);

  const ::onnx::ModelProto& model() const { return model_; }
  std::vector<std::string> input_names() const;
  std::vector<std::string> output_names() const;
  int64_t initializer_bytes() const { return initializer_bytes_; }
  int64_t external_bytes() const { return external_bytes_; }

 private:
  struct Declared {
    std::string name;
    std::vector<int64_t> dims;
  };
  void set_shape(::onnx::TypeProto_Tensor* type, const std::vector<int64_t>& dims) const;

  OnnxGraphOptions opts_;
  ::onnx::ModelProto model_;
  ::onnx::GraphProto* graph_;
  std::vector<Declared> outputs_;
  std::ofstream data_;
  int64_t data_size_ = 0;
  int64_t initializer_bytes_ = 0, external_bytes_ = 0;
};

// The ONNX element type of `dtype`; throws Error for types ONNX export does not write.
int32_t onnx_elem_type(at::ScalarType dtype);

}  // namespace parallax::checkpoint::exporter
