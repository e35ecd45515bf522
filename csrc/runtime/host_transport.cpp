#include "host_transport.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

namespace swap_optimizer::runtime {

WorkerQueue::WorkerQueue() : worker_([this] { run(); }) {}

WorkerQueue::~WorkerQueue() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  task_ready_.notify_all();
  worker_.join();
}

uint64_t WorkerQueue::submit(std::function<void()> task) {
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    tasks_.push_back(std::move(task));
    ticket = ++submitted_;
  }
  task_ready_.notify_one();
  return ticket;
}

bool WorkerQueue::run_here_if_idle(const std::function<void()>& task) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!tasks_.empty() || completed_ != submitted_) return false;
  task();  // under the lock: no task submitted meanwhile starts before it ends
  ++submitted_;
  ++completed_;  // (no waiter can wait for this ticket yet: it is new)
  return true;
}

uint64_t WorkerQueue::submitted() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return submitted_;
}

void WorkerQueue::wait_for(uint64_t ticket) {
  std::unique_lock<std::mutex> lock(mutex_);
  task_done_.wait(lock, [&] { return completed_ >= ticket; });
}

void WorkerQueue::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    task_ready_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
    if (tasks_.empty()) return;  // stopping, and everything submitted has run
    std::function<void()> task = std::move(tasks_.front());
    tasks_.pop_front();
    lock.unlock();
    task();
    lock.lock();
    ++completed_;
    task_done_.notify_all();
  }
}

HostTransport::HostTransport(int slots, bool separate_copy_queues)
    : to_device_(std::make_unique<WorkerQueue>()),
      to_host_owned_(separate_copy_queues ? std::make_unique<WorkerQueue>() : nullptr),
      to_host_(separate_copy_queues ? to_host_owned_.get() : to_device_.get()),
      markers_(marker_count(slots)) {}

HostTransport::~HostTransport() { drain(); }

void HostTransport::set_copy_delay(int64_t max_microseconds, uint64_t seed) {
  drain();  // no task in flight reads the old hook
  to_device_random_.seed(seed);
  to_host_random_.seed(seed ^ 0x9e3779b97f4a7c15ULL);
  copy_here_bytes_ = max_microseconds > 0 ? 0 : kCopyHereBytes;
  if (max_microseconds <= 0) {
    delay_.reset();
    return;
  }
  delay_ = std::make_shared<std::function<void(std::mt19937_64&)>>([max_microseconds](std::mt19937_64& random) {
    std::uniform_int_distribution<int64_t> pick(0, max_microseconds);
    std::this_thread::sleep_for(std::chrono::microseconds(pick(random)));
  });
}

void HostTransport::set_compute_delay(int64_t max_microseconds, uint64_t seed) {
  max_compute_delay_us_ = std::max<int64_t>(max_microseconds, 0);
  compute_random_.seed(seed ^ 0x2545f4914f6cdd1dULL);
}

void HostTransport::delay_compute() {
  if (max_compute_delay_us_ == 0) return;
  std::uniform_int_distribution<int64_t> pick(0, max_compute_delay_us_);
  std::this_thread::sleep_for(std::chrono::microseconds(pick(compute_random_)));
}

WorkerQueue* HostTransport::worker(Queue queue) {
  switch (queue) {
    case Queue::kHostToDevice: return to_device_.get();
    case Queue::kDeviceToHost: return to_host_;
    case Queue::kCompute:
    case Queue::kCaller: break;
  }
  return nullptr;
}

namespace {
void copy_rows(const StridedCopy& copy) {
  for (int64_t row = 0; row < copy.rows; ++row) {
    std::memcpy(static_cast<char*>(copy.dst) + row * copy.dst_pitch,
                static_cast<const char*>(copy.src) + row * copy.src_pitch, static_cast<size_t>(copy.width));
  }
}
}  // namespace

void HostTransport::submit_copy(WorkerQueue* queue, const StridedCopy& copy) {
  if (copy.width * copy.rows <= copy_here_bytes_ && queue->run_here_if_idle([&copy] { copy_rows(copy); })) {
    return;
  }
  std::mt19937_64* random = queue == to_device_.get() ? &to_device_random_ : &to_host_random_;
  queue->submit([delay = delay_, random, copy] {
    if (delay) (*delay)(*random);
    copy_rows(copy);
  });
}

void HostTransport::copy_to_device(const StridedCopy& copy) { submit_copy(to_device_.get(), copy); }

void HostTransport::copy_to_host(const StridedCopy& copy) { submit_copy(to_host_, copy); }

void HostTransport::record(Queue queue, int marker) {
  WorkerQueue* target = worker(queue);
  markers_[marker] = Point{target, target ? target->submitted() : 0};
}

void HostTransport::wait(Queue queue, int marker) {
  const Point point = markers_[marker];
  if (point.queue == nullptr) return;  // compute work has already run
  WorkerQueue* target = worker(queue);
  if (target == nullptr) {
    point.queue->wait_for(point.ticket);  // compute runs on this thread: block it
  } else if (target != point.queue) {
    target->submit([point] { point.queue->wait_for(point.ticket); });
  }
  // Same queue: FIFO order already puts the marked work first.
}

void HostTransport::host_wait(int marker) {
  const Point point = markers_[marker];
  if (point.queue != nullptr) point.queue->wait_for(point.ticket);
}

void HostTransport::drain() noexcept {
  to_device_->wait_for(to_device_->submitted());
  to_host_->wait_for(to_host_->submitted());
}

void HostTransport::open_ready(int64_t /*positions*/) {
  const std::lock_guard<std::mutex> lock(ready_mutex_);
  ready_ = 0;
  released_ = false;
}

void HostTransport::mark_ready(int64_t position) {
  {
    const std::lock_guard<std::mutex> lock(ready_mutex_);
    ready_ = std::max(ready_, position + 1);
  }
  ready_changed_.notify_all();
}

bool HostTransport::wait_ready(int64_t position) {
  std::unique_lock<std::mutex> lock(ready_mutex_);
  ready_changed_.wait(lock, [&] { return released_ || ready_ > position; });
  return ready_ <= position;  // released before reaching it: the step stopped short
}

bool HostTransport::ready_now(int64_t position) {
  const std::lock_guard<std::mutex> lock(ready_mutex_);
  return released_ || ready_ > position;
}

void HostTransport::release_ready() noexcept {
  {
    const std::lock_guard<std::mutex> lock(ready_mutex_);
    released_ = true;
  }
  ready_changed_.notify_all();
}

namespace {
double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

void HostTransport::enable_stamps(int count) {
  drain();  // no stamp in flight writes the old table
  stamps_.assign(static_cast<size_t>(count), std::numeric_limits<double>::quiet_NaN());
}

void HostTransport::stamp(Queue queue, int index) {
  if (index < 0 || index >= static_cast<int>(stamps_.size())) return;
  double* slot = &stamps_[static_cast<size_t>(index)];
  WorkerQueue* target = worker(queue);
  if (target == nullptr) {
    *slot = now_seconds();
  } else {
    target->submit([slot] { *slot = now_seconds(); });
  }
}

std::vector<double> HostTransport::stamp_seconds() {
  drain();
  std::vector<double> seconds(stamps_.size(), std::numeric_limits<double>::quiet_NaN());
  if (stamps_.empty() || std::isnan(stamps_[0])) return seconds;
  for (size_t i = 0; i < stamps_.size(); ++i) seconds[i] = stamps_[i] - stamps_[0];
  return seconds;
}

}  // namespace swap_optimizer::runtime
