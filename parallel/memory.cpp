#include "parallel/memory.h"

#include <set>

namespace parallax::parallel {

int64_t storage_bytes(const std::vector<at::Tensor>& tensors) {
  std::set<const void*> seen;
  int64_t bytes = 0;
  for (const auto& t : tensors) {
    if (!t.defined()) continue;
    const auto& st = t.storage();
    if (seen.insert(st.data()).second) bytes += static_cast<int64_t>(st.nbytes());
  }
  return bytes;
}

}  // namespace parallax::parallel
