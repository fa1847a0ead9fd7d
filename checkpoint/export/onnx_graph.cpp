#include "checkpoint/export/onnx_graph.h"

#include "checkpoint/files.h"
#include "core/error.h"

#include <onnx/checker.h>
#include <onnx/defs/schema.h>
#include <onnx/shape_inference/implementation.h>

#include <ATen/ATen.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <exception>

namespace parallax::checkpoint::exporter {

namespace pb = ::onnx;

int32_t onnx_elem_type(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return pb::TensorProto::FLOAT;
    case at::kHalf:
      return pb::TensorProto::FLOAT16;
    case at::kBFloat16:
      return pb::TensorProto::BFLOAT16;
    case at::kDouble:
      return pb::TensorProto::DOUBLE;
    case at::kByte:
      return pb::TensorProto::UINT8;
    case at::kChar:
      return pb::TensorProto::INT8;
    case at::kInt:
      return pb::TensorProto::INT32;
    case at::kLong:
      return pb::TensorProto::INT64;
    case at::kBool:
      return pb::TensorProto::BOOL;
    default:
      throw_error<Error>("ONNX export: no ONNX element type for {}", c10::toString(dtype));
  }
}

namespace {

constexpr int64_t kAlignment = 4096;  // external data offsets: page-aligned, so ORT can map them

// `t`'s bytes in C order (x86-64 is little-endian, as ONNX's raw_data is).
std::string raw_bytes(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), static_cast<size_t>(c.nbytes()));
}

void fill_tensor(pb::TensorProto* p, const std::string& name, const at::Tensor& t) {
  if (!name.empty()) p->set_name(name);
  p->set_data_type(onnx_elem_type(t.scalar_type()));
  for (int64_t d : t.sizes()) p->add_dims(d);
}

void set_attr(pb::AttributeProto* a, const models::onnx::Attr& attr) {
  a->set_name(attr.name);
  std::visit(
      [&](const auto& v) {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, int64_t>) {
          a->set_type(pb::AttributeProto::INT);
          a->set_i(v);
        } else if constexpr (std::is_same_v<T, double>) {
          a->set_type(pb::AttributeProto::FLOAT);
          a->set_f(static_cast<float>(v));
        } else if constexpr (std::is_same_v<T, std::string>) {
          a->set_type(pb::AttributeProto::STRING);
          a->set_s(v);
        } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
          a->set_type(pb::AttributeProto::INTS);
          for (int64_t x : v) a->add_ints(x);
        } else if constexpr (std::is_same_v<T, std::vector<double>>) {
          a->set_type(pb::AttributeProto::FLOATS);
          for (double x : v) a->add_floats(static_cast<float>(x));
        } else {
          a->set_type(pb::AttributeProto::TENSOR);
          fill_tensor(a->mutable_t(), "", v);
          a->mutable_t()->set_raw_data(raw_bytes(v));
        }
      },
      attr.value);
}

std::string describe_shape(const pb::TypeProto& type) {
  if (!type.has_tensor_type() || !type.tensor_type().has_shape()) return "unknown rank";
  std::string s = "[";
  const auto& shape = type.tensor_type().shape();
  for (int i = 0; i < shape.dim_size(); ++i) {
    if (i) s += ", ";
    const auto& d = shape.dim(i);
    s += d.has_dim_value() ? std::to_string(d.dim_value())
                           : (d.has_dim_param() ? d.dim_param() : "?");
  }
  return s + "]";
}

std::string format_dims(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i)
    s += (i ? ", " : "") + (dims[i] < 0 ? std::string("B") : std::to_string(dims[i]));
  return s + "]";
}

}  // namespace

OnnxGraph::OnnxGraph(const OnnxGraphOptions& options) : opts_(options) {
  model_.set_ir_version(pb::IR_VERSION);
  model_.set_producer_name("parallax");
  model_.set_producer_version("0.1.0");
  auto* op = model_.add_opset_import();
  op->set_domain("");
  op->set_version(opts_.opset);
  graph_ = model_.mutable_graph();
  graph_->set_name("parallax");
  if (!opts_.data_file.empty()) {
    data_.open(opts_.data_file, std::ios::binary | std::ios::trunc);
    PARALLAX_CHECK(data_.is_open(), IoError,
                   "ONNX export: cannot create external data file '{}': {}", opts_.data_file,
                   std::strerror(errno));
  }
}

void OnnxGraph::set_shape(pb::TypeProto_Tensor* type, const std::vector<int64_t>& dims) const {
  auto* shape = type->mutable_shape();
  shape->clear_dim();
  for (int64_t d : dims) {
    auto* dim = shape->add_dim();
    if (d == models::onnx::kBatch) {
      if (opts_.batch > 0) {
        dim->set_dim_value(opts_.batch);
      } else {
        dim->set_dim_param("batch");
      }
    } else {
      dim->set_dim_value(d);
    }
  }
}

void OnnxGraph::add_input(const std::string& name, at::ScalarType dtype,
                          const std::vector<int64_t>& dims) {
  auto* in = graph_->add_input();
  in->set_name(name);
  auto* t = in->mutable_type()->mutable_tensor_type();
  t->set_elem_type(onnx_elem_type(dtype));
  set_shape(t, dims);
}

void OnnxGraph::add_output(const std::string& name, at::ScalarType dtype,
                           const std::vector<int64_t>& dims) {
  auto* out = graph_->add_output();
  out->set_name(name);
  out->mutable_type()->mutable_tensor_type()->set_elem_type(onnx_elem_type(dtype));
  outputs_.push_back({name, dims});  // the shape is set after inference (infer_and_check_shapes)
}

void OnnxGraph::add_node(const std::string& op_type, const std::string& node_name,
                         const std::vector<std::string>& inputs,
                         const std::vector<std::string>& outputs,
                         const std::vector<models::onnx::Attr>& attrs) {
  auto* n = graph_->add_node();
  n->set_op_type(op_type);
  n->set_name(node_name);
  for (const auto& i : inputs) n->add_input(i);
  for (const auto& o : outputs) n->add_output(o);
  for (const auto& a : attrs) set_attr(n->add_attribute(), a);
}

void OnnxGraph::add_initializer(const std::string& name, const at::Tensor& value) {
  auto* init = graph_->add_initializer();
  fill_tensor(init, name, value);
  const int64_t bytes = static_cast<int64_t>(value.nbytes());
  initializer_bytes_ += bytes;
  if (!data_.is_open() || bytes < opts_.external_min_bytes) {
    init->set_raw_data(raw_bytes(value));
    return;
  }
  const int64_t offset = (data_size_ + kAlignment - 1) / kAlignment * kAlignment;
  if (offset > data_size_)
    data_.write(std::string(static_cast<size_t>(offset - data_size_), '\0').data(),
                offset - data_size_);
  const at::Tensor c = value.contiguous();
  data_.write(static_cast<const char*>(c.data_ptr()), bytes);
  PARALLAX_CHECK(data_.good(), IoError,
                 "ONNX export: cannot write tensor '{}' to external data file '{}': {}", name,
                 opts_.data_file, std::strerror(errno));
  data_size_ = offset + bytes;
  external_bytes_ += bytes;
  init->set_data_location(pb::TensorProto::EXTERNAL);
  auto entry = [&](const char* key, const std::string& v) {
    auto* e = init->add_external_data();
    e->set_key(key);
    e->set_value(v);
  };
  entry("location", opts_.data_location);
  entry("offset", std::to_string(offset));
  entry("length", std::to_string(bytes));
}

void OnnxGraph::add_metadata(const std::string& key, const std::string& value) {
  for (auto& p : *model_.mutable_metadata_props()) {
    if (p.key() == key) {
      p.set_value(value);
      return;
    }
  }
  auto* p = model_.add_metadata_props();
  p->set_key(key);
  p->set_value(value);
}

std::vector<std::string> OnnxGraph::input_names() const {
  std::vector<std::string> out;
  for (const auto& i : graph_->input()) out.push_back(i.name());
  return out;
}

std::vector<std::string> OnnxGraph::output_names() const {
  std::vector<std::string> out;
  for (const auto& o : outputs_) out.push_back(o.name);
  return out;
}

void OnnxGraph::infer_and_check_shapes() {
  // check_type: input types must match the schemas; error_mode 1: any node's inference error
  // throws; data propagation: shapes computed from Shape/Slice/Concat are followed.
  const pb::ShapeInferenceOptions options(/*check_type=*/true, /*error_mode=*/1,
                                          /*data_prop=*/true);
  try {
    pb::shape_inference::InferShapes(model_, pb::OpSchemaRegistry::Instance(), options);
  } catch (const std::exception& e) {
    throw_error<Error>("ONNX export: shape inference failed: {}", e.what());
  }
  for (int i = 0; i < graph_->output_size(); ++i) {
    auto* out = graph_->mutable_output(i);
    const Declared& want = outputs_.at(static_cast<size_t>(i));
    const pb::TypeProto& got = out->type();
    bool ok = got.has_tensor_type() && got.tensor_type().has_shape() &&
              got.tensor_type().shape().dim_size() == static_cast<int>(want.dims.size());
    for (size_t d = 0; ok && d < want.dims.size(); ++d) {
      const auto& dim = got.tensor_type().shape().dim(static_cast<int>(d));
      if (want.dims[d] != models::onnx::kBatch) {
        ok = dim.has_dim_value() && dim.dim_value() == want.dims[d];
      } else if (opts_.batch > 0) {
        ok = dim.has_dim_value() && dim.dim_value() == opts_.batch;
      } else {
        ok = !dim.has_dim_value();  // a dynamic batch must not have been baked into the graph
      }
    }
    PARALLAX_CHECK(
        ok, Error,
        "ONNX export: shape inference gives output '{}' the shape {}, expected {} (batch {})",
        want.name, describe_shape(got), format_dims(want.dims),
        opts_.batch > 0 ? std::to_string(opts_.batch) : std::string("dynamic"));
    set_shape(out->mutable_type()->mutable_tensor_type(), want.dims);
  }
}

void OnnxGraph::write(const std::string& path) {
  if (data_.is_open()) {
    data_.flush();
    PARALLAX_CHECK(data_.good(), IoError, "ONNX export: cannot write external data file '{}': {}",
                   opts_.data_file, std::strerror(errno));
    data_.close();
    files::fsync_path(opts_.data_file, false);
  }
  const size_t size = model_.ByteSizeLong();
  PARALLAX_CHECK(size <= static_cast<size_t>(INT_MAX), Error,
                 "ONNX export: the model is {} bytes, over protobuf's 2 GiB limit; export its "
                 "weights as external data",
                 size);
  {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    PARALLAX_CHECK(f.is_open(), IoError, "ONNX export: cannot create '{}': {}", path,
                   std::strerror(errno));
    const bool ok = model_.SerializeToOstream(&f);
    f.flush();
    PARALLAX_CHECK(ok && f.good(), IoError, "ONNX export: cannot write '{}': {}", path,
                   std::strerror(errno));
  }
  files::fsync_path(path, false);
  try {
    pb::checker::check_model(path);  // the file as written, external data resolved next to it
  } catch (const std::exception& e) {
    throw_error<Error>("ONNX export: the ONNX checker rejects '{}': {}", path, e.what());
  }
}

}  // namespace parallax::checkpoint::exporter
