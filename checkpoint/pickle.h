// Internal: a restricted reader of the pickle in a torch.save zip file (its data.pkl), for tensors
// and plain containers only. Two passes over the opcode stream (protocols 0 to 5):
//  1. check_globals, before anything is built: every GLOBAL / STACK_GLOBAL / INST must name an
//     allowed global (the tensor rebuild functions, storage and dtype markers, OrderedDict), and
//     EXT1/2/4 (globals from the copyreg registry, which cannot be checked) are refused;
//  2. load builds a tree of plain values (dicts, lists, tuples, strings, numbers, None) whose
//     tensor leaves are references to storages (zip records "data/<key>"), not data.
// Nothing is ever called or imported: an allowed global is a tag the loader interprets.
//
// LibTorch's own torch::jit::Unpickler (behind torch::pickle_load) is not used because it cannot
// read what torch.save writes for a state_dict: it turns collections.OrderedDict into None (and
// then fails on its items) and cannot BUILD the state_dict's _metadata.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace parallax::checkpoint::pickle {

// A tensor of the pickle: a strided view of a storage record. offset, sizes and strides count
// elements of `dtype`; nothing is checked against the storage here (torch_file.cpp does).
struct TensorRef {
  std::string storage_key;    // the zip record is "data/<storage_key>"
  int64_t storage_bytes = 0;  // the storage's size as the pickle states it
  at::ScalarType dtype = at::kFloat;
  int64_t offset = 0;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
};

struct Value;
using ValuePtr = std::shared_ptr<Value>;

struct Value {
  enum class Kind {
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kBytes,
    kTuple,
    kList,
    kDict,
    kTensor,
    kGlobal,
    kStorage,
    kDtype
  };
  Kind kind = Kind::kNone;
  int64_t i = 0;                                       // kBool, kInt
  double f = 0;                                        // kFloat
  std::string s;                                       // kString, kBytes; kGlobal: "module.name"
  std::vector<ValuePtr> items;                         // kTuple, kList
  std::vector<std::pair<ValuePtr, ValuePtr>> entries;  // kDict, in insertion order
  std::unordered_map<std::string, size_t> key_index;   // kDict: entry of a str / int key
  TensorRef tensor;                                    // kTensor; kStorage uses its storage fields
  at::ScalarType dtype = at::ScalarType::Undefined;    // kDtype; kGlobal of a typed storage class
};

// The allowed globals ("module.name"); the loader gives each its meaning.
bool is_allowed_global(const std::string& qualified);

// Pass 1. Throws CheckpointError "'<file>': the pickle asks for 'os.system', which is not a tensor
// or a plain container; nothing was loaded" (or names the opcode it cannot check).
void check_globals(std::string_view pickle, const std::string& file);

// Pass 2 (after check_globals). Throws CheckpointError naming `file` for a malformed pickle or an
// opcode outside the subset torch.save uses.
ValuePtr load(std::string_view pickle, const std::string& file);

}  // namespace parallax::checkpoint::pickle
