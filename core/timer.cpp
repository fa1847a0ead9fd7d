#include "core/timer.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace parallax::core {

DeviceTimer::DeviceTimer(c10::Device device) : device_(device) {
  if (device_.type() != c10::DeviceType::CPU) {
    start_event_ = std::make_unique<c10::Event>(device_.type(), c10::EventFlag::BACKEND_DEFAULT);
    stop_event_ = std::make_unique<c10::Event>(device_.type(), c10::EventFlag::BACKEND_DEFAULT);
  }
}

DeviceTimer::~DeviceTimer() = default;

void DeviceTimer::start() {
  if (start_event_) {
    const auto* impl = c10::impl::getDeviceGuardImpl(device_.type());
    start_event_->record(impl->getStream(device_));
  } else {
    wall_.reset();
  }
}

void DeviceTimer::stop() {
  if (stop_event_) {
    const auto* impl = c10::impl::getDeviceGuardImpl(device_.type());
    stop_event_->record(impl->getStream(device_));
  } else {
    wall_ms_ = wall_.elapsed_ms();
  }
}

double DeviceTimer::elapsed_ms() {
  if (!stop_event_) return wall_ms_;
  stop_event_->synchronize();
  return start_event_->elapsedTime(*stop_event_);
}

bool DeviceTimer::ready() const {
  return !stop_event_ || stop_event_->query();
}

}  // namespace parallax::core
