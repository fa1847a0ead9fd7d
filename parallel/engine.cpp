#include "parallel/engine.h"

#include "core/error.h"

#include <functional>
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

void Engine::forward_backward(int micro_steps, const std::function<at::Tensor(int)>& micro,
                              bool sync_buffers) {
  at::Tensor loss;
  forward_backward_split(
      micro_steps, {[&](int i) { loss = micro(i); },
                    [&](int) {
                      at::Tensor l = std::move(loss);
                      l.backward();
                    }},
      sync_buffers);
}

void Engine::forward_backward_stages(int, const StageFns&, bool) {
  throw_error<Error>("engine '{}': not a pipeline engine (parallel.pp = 1)", describe());
}

}  // namespace parallax::parallel
