// Internal: torch.save files (the zip format of PyTorch >= 1.6). The zip is read with LibTorch's
// caffe2::serialize::PyTorchStreamReader; data.pkl goes through the restricted pickle reader
// (pickle.h: globals checked first, nothing imported or called); storages are zip records, each
// read when a tensor of it is read. The legacy (non-zip) format is refused.
#pragma once

#include "checkpoint/tensor_source.h"

#include <cstdint>
#include <memory>
#include <string>

namespace parallax::checkpoint::torch_file {

// The pickled object is flattened: dicts nest with '.', lists and tuples use their index; tensor
// leaves are the source's tensors (a bare top-level tensor is named ""); other leaves (ints,
// floats, strings, None, such as an 'epoch') are skipped and counted. A file holding no tensor, a
// key that is not a string or an integer, two tensors flattening to one name, or a tensor whose
// view reaches past its storage record is refused at open.
class TorchFileSource : public TensorSource {
 public:
  // Leaves that were not tensors.
  virtual int64_t skipped() const = 0;
};

std::unique_ptr<TorchFileSource> open(const std::string& path);

// True if the file starts with the zip magic and holds a data.pkl record (a torch.save zip).
bool is_torch_zip(const std::string& path);

}  // namespace parallax::checkpoint::torch_file
