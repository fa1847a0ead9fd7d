#include "comm/deadline_call.h"

#include "core/strings.h"

#include <c10/util/Exception.h>

namespace parallax::comm {

std::string one_line_what(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  std::string s = c10_error ? c10_error->what_without_backtrace() : e.what();
  if (const size_t at = s.find("Exception raised from"); at != std::string::npos) s.resize(at);
  if (const size_t nl = s.find('\n'); nl != std::string::npos) s.resize(nl);
  return core::clip(core::trim(s), 300);
}

}  // namespace parallax::comm
