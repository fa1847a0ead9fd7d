// A pool of worker threads that computes jobs 0..total-1 and hands the results to one consumer
// strictly in job order: `take(0)`, `take(1)`, ... A bounded window keeps memory flat: workers
// never run more than 2 x threads jobs ahead of the consumer. A job's exception is rethrown by
// the `take` of that job. Used by `parallax datagen` and `parallax convert` (the scenes are made
// in parallel and written in order, so the files do not depend on the thread count).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

namespace parallax::data {

template <typename T>
class OrderedPool {
 public:
  using Make = std::function<T(int64_t)>;

  OrderedPool(int64_t total, int threads, Make make)
      : total_(total), window_(2 * static_cast<int64_t>(threads)), make_(std::move(make)) {
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { work(); });
  }
  ~OrderedPool() {
    {
      std::lock_guard<std::mutex> lock(m_);
      stop_ = true;
    }
    cv_space_.notify_all();
    for (auto& t : workers_) t.join();
  }
  OrderedPool(const OrderedPool&) = delete;
  OrderedPool& operator=(const OrderedPool&) = delete;

  // The result of job `j` (called with j = 0, 1, 2, ...); rethrows the job's exception.
  T take(int64_t j) {
    std::unique_lock<std::mutex> lock(m_);
    cv_ready_.wait(lock, [&] { return done_.count(j) > 0; });
    Result r = std::move(done_.at(j));
    done_.erase(j);
    consumed_ = j + 1;
    lock.unlock();
    cv_space_.notify_all();
    if (r.error) std::rethrow_exception(r.error);
    return std::move(r.value);
  }

 private:
  struct Result {
    T value;
    std::exception_ptr error;
  };

  void work() {
    for (;;) {
      int64_t j = 0;
      {
        std::unique_lock<std::mutex> lock(m_);
        cv_space_.wait(lock,
                       [&] { return stop_ || next_ >= total_ || next_ < consumed_ + window_; });
        if (stop_ || next_ >= total_) return;
        j = next_++;
      }
      Result r;
      try {
        r.value = make_(j);
      } catch (...) {
        r.error = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> lock(m_);
        done_.emplace(j, std::move(r));
      }
      cv_ready_.notify_all();
    }
  }

  const int64_t total_, window_;
  Make make_;
  std::mutex m_;
  std::condition_variable cv_ready_, cv_space_;
  std::map<int64_t, Result> done_;
  int64_t next_ = 0, consumed_ = 0;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace parallax::data
