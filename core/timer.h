// Timers. Stopwatch measures host wall time. DeviceTimer measures work queued on a device's
// current stream with timing events (CUDA) and falls back to wall time on the CPU, where ops run
// synchronously. Neither is thread-safe; use one per thread.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Event.h>

#include <chrono>
#include <memory>

namespace parallax::core {

class Stopwatch {
 public:
  Stopwatch() { reset(); }
  void reset() { start_ = std::chrono::steady_clock::now(); }
  double elapsed_ms() const {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_)
        .count();
  }
  double elapsed_s() const { return elapsed_ms() / 1000.0; }

 private:
  std::chrono::steady_clock::time_point start_;
};

class DeviceTimer {
 public:
  explicit DeviceTimer(c10::Device device);
  ~DeviceTimer();
  DeviceTimer(const DeviceTimer&) = delete;
  DeviceTimer& operator=(const DeviceTimer&) = delete;

  // Records the start/stop marks on the device's current stream (no host synchronisation).
  void start();
  void stop();
  // Milliseconds between start() and stop(); waits for the stop mark to complete on the device.
  double elapsed_ms();
  // Whether the stop mark has completed (elapsed_ms() would not block). Always true on the CPU.
  bool ready() const;
  bool on_device() const { return stop_event_ != nullptr; }

 private:
  c10::Device device_;
  std::unique_ptr<c10::Event> start_event_, stop_event_;
  Stopwatch wall_;
  double wall_ms_ = 0;
};

}  // namespace parallax::core
