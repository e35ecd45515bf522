// The host backend's transport: the compute queue is the calling thread, and
// each copy queue is a worker thread that runs memcpys in order, so the CPU
// tests drive the same pipeline code as CUDA. Plain C++ (no torch).
#pragma once

#include "pipeline.h"

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

namespace swap_optimizer::runtime {

// A FIFO of tasks run by one worker thread. Tickets count submitted tasks:
// wait_for(t) returns once the first t tasks have finished.
class WorkerQueue {
 public:
  WorkerQueue();
  ~WorkerQueue();
  WorkerQueue(const WorkerQueue&) = delete;
  WorkerQueue& operator=(const WorkerQueue&) = delete;

  uint64_t submit(std::function<void()> task);
  // Runs `task` on the calling thread, in queue order, when nothing is queued
  // or running: true if it ran (it then counts as a submitted, finished task).
  bool run_here_if_idle(const std::function<void()>& task);
  uint64_t submitted() const;
  void wait_for(uint64_t ticket);

 private:
  void run();

  mutable std::mutex mutex_;
  std::condition_variable task_ready_;
  std::condition_variable task_done_;
  std::deque<std::function<void()>> tasks_;
  uint64_t submitted_ = 0;
  uint64_t completed_ = 0;
  bool stopping_ = false;
  std::thread worker_;
};

class HostTransport final : public Transport {
 public:
  // separate_copy_queues: copies in and out on two workers (both directions at
  // once) rather than one chained worker.
  HostTransport(int slots, bool separate_copy_queues);
  ~HostTransport() override;

  // (a test's copy delay stands for a slow link beside the update: while one
  // is set every copy goes to the workers, see set_copy_here_bytes)
  void set_copy_delay(int64_t max_microseconds, uint64_t seed) override;
  // The largest copy the caller makes itself where its queue is idle (the
  // stress test mixes such copies with delayed ones).
  void set_copy_here_bytes(int64_t bytes) { copy_here_bytes_ = bytes; }
  void set_compute_delay(int64_t max_microseconds, uint64_t seed) override;
  void delay_compute() override;  // sleeps on the thread running the update

  void begin_step() override {}
  void copy_to_device(const StridedCopy& copy) override;
  void copy_to_host(const StridedCopy& copy) override;
  void record(Queue queue, int marker) override;
  void wait(Queue queue, int marker) override;
  void host_wait(int marker) override;
  void drain() noexcept override;

  void enter_update_queue() override {}
  void leave_update_queue() noexcept override {}
  void open_ready(int64_t positions) override;
  void mark_ready(int64_t position) override;
  bool wait_ready(int64_t position) override;
  void release_ready() noexcept override;
  bool ready_now(int64_t position) override;
  void order_release(int64_t /*position*/) override {}

  void enable_stamps(int count) override;
  void stamp(Queue queue, int index) override;
  std::vector<double> stamp_seconds() override;

 private:
  struct Point {
    WorkerQueue* queue = nullptr;  // null: recorded on the compute queue, already reached
    uint64_t ticket = 0;
  };
  WorkerQueue* worker(Queue queue);
  void submit_copy(WorkerQueue* queue, const StridedCopy& copy);

  // A copy up to this size is made by the caller itself where its queue is
  // idle: handing it to the worker costs a wake and a wait for its end, two
  // thread switches that take longer than the memcpy, and with small batches
  // those switches bounded the step. Larger copies overlap the update.
  static constexpr int64_t kCopyHereBytes = 256 << 10;
  int64_t copy_here_bytes_ = kCopyHereBytes;

  std::unique_ptr<WorkerQueue> to_device_;
  std::unique_ptr<WorkerQueue> to_host_owned_;  // null when one worker does both directions
  WorkerQueue* to_host_;
  std::vector<Point> markers_;
  std::shared_ptr<std::function<void(std::mt19937_64&)>> delay_;
  std::mt19937_64 to_device_random_, to_host_random_;  // each touched by its own worker only
  int64_t max_compute_delay_us_ = 0;
  std::mt19937_64 compute_random_;  // touched by the thread running the pipeline only

  // A deferred step's progress: positions [0, ready_) are updated; released
  // once the step has ended (or failed), which wakes every waiter.
  std::mutex ready_mutex_;
  std::condition_variable ready_changed_;
  int64_t ready_ = 0;
  bool released_ = true;

  std::vector<double> stamps_;  // steady-clock seconds, NaN until stamped
};

}  // namespace swap_optimizer::runtime
