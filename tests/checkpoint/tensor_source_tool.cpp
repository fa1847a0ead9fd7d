// Helper program of tensor_source_test.py:
//   tensor_source_tool dump <source> <out_dir>   every tensor's raw bytes to <out_dir>/<i>.bin and
//   a
//                                                manifest.json (format, skipped, metadata, tensors)
//   tensor_source_tool copy <source> <out.safetensors>   every tensor through write_safetensors
// Errors print "<ErrorType>: <message>" and exit 3 (CheckpointError), 4 (IoError) or 5.
#include "checkpoint/tensor_source.h"
#include "checkpoint/torch_file.h"
#include "core/error.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <iostream>

using namespace parallax;
using namespace parallax::checkpoint;

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: tensor_source_tool dump|copy <source> <out>\n";
    return 2;
  }
  const std::string verb = argv[1], in = argv[2], out = argv[3];
  try {
    auto src = open_tensor_source(in);
    if (verb == "dump") {
      nlohmann::json m;
      m["format"] = src->format();
      m["metadata"] = src->metadata();
      const auto* torch = dynamic_cast<const torch_file::TorchFileSource*>(src.get());
      m["skipped"] = torch ? torch->skipped() : 0;
      m["tensors"] = nlohmann::json::array();
      int i = 0;
      for (const SourceTensor& t : src->tensors()) {
        const at::Tensor r = src->read(t.name).contiguous();
        if (r.scalar_type() != t.dtype || r.sizes().vec() != t.shape) {
          std::cerr << "read() disagrees with tensors() for " << t.name << "\n";
          return 6;
        }
        const std::string file = out + "/" + std::to_string(i++) + ".bin";
        std::ofstream(file, std::ios::binary)
            .write(static_cast<const char*>(r.const_data_ptr()),
                   static_cast<std::streamsize>(r.nbytes()));
        m["tensors"].push_back({{"name", t.name},
                                {"dtype", c10::toString(t.dtype)},
                                {"shape", t.shape},
                                {"file", file}});
      }
      std::ofstream(out + "/manifest.json") << m.dump(1);
    } else if (verb == "copy") {
      std::vector<std::pair<std::string, at::Tensor>> tensors;
      for (const SourceTensor& t : src->tensors()) tensors.emplace_back(t.name, src->read(t.name));
      write_safetensors(out, tensors, src->metadata());
    } else {
      std::cerr << "unknown verb " << verb << "\n";
      return 2;
    }
  } catch (const CheckpointError& e) {
    std::cout << "CheckpointError: " << e.what() << "\n";
    return 3;
  } catch (const IoError& e) {
    std::cout << "IoError: " << e.what() << "\n";
    return 4;
  } catch (const std::exception& e) {
    std::cout << "OtherError: " << e.what() << "\n";
    return 5;
  }
  return 0;
}
