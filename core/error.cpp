#include "core/error.h"

namespace parallax {

Error& Error::add_context(std::string frame) {
  context_.push_back(std::move(frame));
  full_ = message_ + " (";
  for (std::size_t i = 0; i < context_.size(); ++i) {
    if (i) full_ += "; ";
    full_ += context_[i];
  }
  full_ += ")";
  return *this;
}

}  // namespace parallax
