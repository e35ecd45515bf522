#include "cuda_transport.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <unordered_map>
#include <thread>
#include <vector>

namespace swap_optimizer::runtime {
namespace {

// The update stream of deferred steps on `device`: made once per process and
// never destroyed. Not one of torch's pool streams, which a user's side stream
// may share; not one per runtime, because the caching allocator keeps the
// blocks freed on it (the arenas of deferred steps) for this stream, and a
// runtime made later (add_param_group rebuilds it) reuses them.
c10::cuda::CUDAStream update_stream(c10::DeviceIndex device) {
  static std::mutex mutex;
  static std::unordered_map<c10::DeviceIndex, cudaStream_t> streams;
  const std::lock_guard<std::mutex> lock(mutex);
  const c10::cuda::CUDAGuard guard(device);
  cudaStream_t& stream = streams[device];
  if (stream == nullptr) C10_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return c10::cuda::getStreamFromExternal(stream, device);
}

// Test hooks: `stream` sleeps `microseconds` on the host before its next work
// (a host function: the host that enqueues does not wait).
void enqueue_sleep(cudaStream_t stream, int64_t microseconds) {
  auto delay = std::make_unique<int64_t>(microseconds);
  C10_CUDA_CHECK(cudaLaunchHostFunc(stream, [](void* us) {
    const std::unique_ptr<int64_t> owned(static_cast<int64_t*>(us));
    std::this_thread::sleep_for(std::chrono::microseconds(*owned));
  }, delay.get()));
  delay.release();  // the host function owns it now
}

class CudaTransport final : public Transport {
 public:
  CudaTransport(c10::DeviceIndex device, int slots, bool separate_copy_streams) : device_(device) {
    const c10::cuda::CUDAGuard guard(device_);
    try {
      C10_CUDA_CHECK(cudaStreamCreateWithFlags(&to_device_, cudaStreamNonBlocking));
      if (separate_copy_streams) {
        C10_CUDA_CHECK(cudaStreamCreateWithFlags(&to_host_, cudaStreamNonBlocking));
      } else {
        to_host_ = to_device_;
      }
      int max_pitch = 0;
      C10_CUDA_CHECK(cudaDeviceGetAttribute(&max_pitch, cudaDevAttrMaxPitch, device_));
      max_pitch_ = max_pitch;
      events_.assign(marker_count(slots), nullptr);
      for (cudaEvent_t& event : events_) {
        C10_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
      }
      C10_CUDA_CHECK(cudaEventCreateWithFlags(&caller_event_, cudaEventDisableTiming));
    } catch (...) {
      release();
      throw;
    }
  }

  ~CudaTransport() override {
    const c10::cuda::CUDAGuard guard(device_);
    drain();
    release();
  }

  void begin_step() override {
    compute_ = c10::cuda::getCurrentCUDAStream(device_).stream();  // null for the default stream
    started_ = true;
  }

  void set_copy_delay(int64_t max_microseconds, uint64_t seed) override {
    drain();
    max_delay_us_ = max_microseconds;
    random_.seed(seed);
  }

  void set_compute_delay(int64_t max_microseconds, uint64_t seed) override {
    drain();
    max_compute_delay_us_ = max_microseconds;
    compute_random_.seed(seed ^ 0x2545f4914f6cdd1dULL);
  }

  void delay_compute() override {
    if (max_compute_delay_us_ <= 0) return;
    enqueue_sleep(stream(Queue::kCompute),
                  std::uniform_int_distribution<int64_t>(0, max_compute_delay_us_)(compute_random_));
  }

  void copy_to_device(const StridedCopy& copy) override { enqueue(copy, cudaMemcpyHostToDevice, to_device_); }

  void copy_to_host(const StridedCopy& copy) override { enqueue(copy, cudaMemcpyDeviceToHost, to_host_); }

  void record(Queue queue, int marker) override {
    C10_CUDA_CHECK(cudaEventRecord(events_[marker], stream(queue)));
  }

  void wait(Queue queue, int marker) override {
    C10_CUDA_CHECK(cudaStreamWaitEvent(stream(queue), events_[marker], 0));
  }

  void host_wait(int marker) override { C10_CUDA_CHECK(cudaEventSynchronize(events_[marker])); }

  void enter_update_queue() override {
    if (!update_) update_ = update_stream(device_);
    caller_ = c10::cuda::getCurrentCUDAStream(device_);
    step_queue_ = caller_;
    step_queue_waited_through_ = -1;
    C10_CUDA_CHECK(cudaEventRecord(caller_event_, caller_->stream()));
    C10_CUDA_CHECK(cudaStreamWaitEvent(update_->stream(), caller_event_, 0));
    c10::cuda::setCurrentCUDAStream(*update_);
  }

  void leave_update_queue() noexcept override {
    if (caller_) c10::cuda::setCurrentCUDAStream(*caller_);
    caller_.reset();
  }

  // Events, one per position, made the first time a step has that many.
  void open_ready(int64_t positions) override {
    while (static_cast<int64_t>(ready_.size()) < positions) {
      cudaEvent_t event = nullptr;
      C10_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
      ready_.push_back(event);
    }
  }

  void mark_ready(int64_t position) override {
    C10_CUDA_CHECK(cudaEventRecord(ready_.at(position), compute_));
  }

  bool wait_ready(int64_t position) override {
    const cudaStream_t caller = stream(Queue::kCaller);
    C10_CUDA_CHECK(cudaStreamWaitEvent(caller, ready_.at(position), 0));
    if (step_queue_ && caller == step_queue_->stream()) {
      step_queue_waited_through_ = std::max(step_queue_waited_through_, position);
    }
    return false;
  }

  void release_ready() noexcept override {}

  bool ready_now(int64_t position) override {
    const cudaError_t status = cudaEventQuery(ready_.at(position));
    if (status == cudaErrorNotReady) {
      (void)cudaGetLastError();  // not an error: cleared, as c10's CUDAEvent::query does
      return false;
    }
    C10_CUDA_CHECK(status);
    return true;
  }

  // Readiness events complete in order (one update stream): waiting for p covers every position before it.
  void order_release(int64_t position) override {
    if (!step_queue_ || position <= step_queue_waited_through_) return;
    C10_CUDA_CHECK(cudaStreamWaitEvent(step_queue_->stream(), ready_.at(position), 0));
    step_queue_waited_through_ = position;
  }

  void enable_stamps(int count) override {
    drain();
    destroy_stamps();
    stamped_.assign(static_cast<size_t>(count), false);
    for (int i = 0; i < count; ++i) {
      cudaEvent_t event = nullptr;
      C10_CUDA_CHECK(cudaEventCreate(&event));  // with timing
      stamps_.push_back(event);
    }
  }

  void stamp(Queue queue, int index) override {
    if (index < 0 || index >= static_cast<int>(stamps_.size())) return;
    C10_CUDA_CHECK(cudaEventRecord(stamps_[index], stream(queue)));
    stamped_[index] = true;
  }

  std::vector<double> stamp_seconds() override {
    std::vector<double> seconds(stamps_.size(), std::numeric_limits<double>::quiet_NaN());
    if (stamps_.empty() || !stamped_[0]) return seconds;
    C10_CUDA_CHECK(cudaEventSynchronize(stamps_[0]));
    for (size_t i = 0; i < stamps_.size(); ++i) {
      if (!stamped_[i]) continue;
      float ms = 0.f;
      C10_CUDA_CHECK(cudaEventSynchronize(stamps_[i]));
      C10_CUDA_CHECK(cudaEventElapsedTime(&ms, stamps_[0], stamps_[i]));
      seconds[i] = ms / 1e3;
    }
    return seconds;
  }

  void drain() noexcept override {
    C10_CUDA_IGNORE_ERROR(cudaStreamSynchronize(to_device_));
    if (to_host_ != to_device_) C10_CUDA_IGNORE_ERROR(cudaStreamSynchronize(to_host_));
    if (started_) C10_CUDA_IGNORE_ERROR(cudaStreamSynchronize(compute_));
    if (update_) C10_CUDA_IGNORE_ERROR(cudaStreamSynchronize(update_->stream()));
  }

 private:
  // One call for a plain or strided copy; a row at a time only where a pitch
  // is beyond what cudaMemcpy2DAsync accepts (memPitch, about 2 GiB).
  void enqueue(const StridedCopy& copy, cudaMemcpyKind kind, cudaStream_t stream) {
    if (max_delay_us_ > 0) {  // test hook: the stream sleeps first, as the host backend's workers do
      enqueue_sleep(stream, std::uniform_int_distribution<int64_t>(0, max_delay_us_)(random_));
    }
    if (copy.rows == 1) {
      C10_CUDA_CHECK(cudaMemcpyAsync(copy.dst, copy.src, copy.width, kind, stream));
    } else if (copy.dst_pitch <= max_pitch_ && copy.src_pitch <= max_pitch_) {
      C10_CUDA_CHECK(cudaMemcpy2DAsync(copy.dst, copy.dst_pitch, copy.src, copy.src_pitch, copy.width, copy.rows,
                                       kind, stream));
    } else {
      for (int64_t row = 0; row < copy.rows; ++row) {
        C10_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(copy.dst) + row * copy.dst_pitch,
                                       static_cast<const char*>(copy.src) + row * copy.src_pitch, copy.width, kind,
                                       stream));
      }
    }
  }

  cudaStream_t stream(Queue queue) const {
    switch (queue) {
      case Queue::kHostToDevice: return to_device_;
      case Queue::kDeviceToHost: return to_host_;
      case Queue::kCaller: return c10::cuda::getCurrentCUDAStream(device_).stream();
      case Queue::kCompute: break;
    }
    return compute_;
  }

  void destroy_stamps() noexcept {
    for (cudaEvent_t event : stamps_) C10_CUDA_IGNORE_ERROR(cudaEventDestroy(event));
    stamps_.clear();
  }

  // Destroys what was made, in any state it got to.
  void release() noexcept {
    for (cudaEvent_t event : events_) {
      if (event != nullptr) C10_CUDA_IGNORE_ERROR(cudaEventDestroy(event));
    }
    events_.clear();
    for (cudaEvent_t event : ready_) C10_CUDA_IGNORE_ERROR(cudaEventDestroy(event));
    ready_.clear();
    destroy_stamps();
    if (caller_event_ != nullptr) C10_CUDA_IGNORE_ERROR(cudaEventDestroy(caller_event_));
    caller_event_ = nullptr;
    if (to_host_ != nullptr && to_host_ != to_device_) C10_CUDA_IGNORE_ERROR(cudaStreamDestroy(to_host_));
    if (to_device_ != nullptr) C10_CUDA_IGNORE_ERROR(cudaStreamDestroy(to_device_));
    to_host_ = to_device_ = nullptr;
  }

  c10::DeviceIndex device_;
  int64_t max_pitch_ = 0;
  int64_t max_delay_us_ = 0;
  std::mt19937_64 random_;
  int64_t max_compute_delay_us_ = 0;
  std::mt19937_64 compute_random_;
  bool started_ = false;
  cudaStream_t to_device_ = nullptr;
  cudaStream_t to_host_ = nullptr;
  cudaStream_t compute_ = nullptr;
  std::vector<cudaEvent_t> events_;
  // Deferred steps: the update stream (update_stream()), the
  // caller's stream while a step is enqueued, the event the update stream
  // waits on, and one readiness event per pipeline position.
  std::optional<c10::cuda::CUDAStream> update_;
  std::optional<c10::cuda::CUDAStream> caller_;
  // The caller's stream of the last deferred step (whose grads and snapshots
  // it holds until order_release), and the last position it waited for.
  std::optional<c10::cuda::CUDAStream> step_queue_;
  int64_t step_queue_waited_through_ = -1;
  cudaEvent_t caller_event_ = nullptr;
  std::vector<cudaEvent_t> ready_;
  std::vector<cudaEvent_t> stamps_;  // timeline (bench only), with timing
  std::vector<bool> stamped_;
};

}  // namespace

std::unique_ptr<Transport> make_cuda_transport(c10::DeviceIndex device, int slots,
                                               bool separate_copy_streams) {
  return std::make_unique<CudaTransport>(device, slots, separate_copy_streams);
}

void* allocate_pinned(int64_t bytes) {
  void* pointer = nullptr;
  if (cudaHostAlloc(&pointer, static_cast<size_t>(bytes), cudaHostAllocDefault) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the error: the caller falls back to pageable memory
    return nullptr;
  }
  return pointer;
}

void free_pinned(void* pointer) noexcept { C10_CUDA_IGNORE_ERROR(cudaFreeHost(pointer)); }

c10::DeviceIndex resolve_cuda_index(c10::DeviceIndex device) {
  if (device < 0) return c10::cuda::current_device();
  const c10::DeviceIndex count = c10::cuda::device_count();
  TORCH_CHECK_VALUE(device < count, "SwapOptimizer: cuda:", static_cast<int>(device), " does not exist: this machine has ",
                    static_cast<int>(count), " CUDA device(s); pass one of those, or 'cuda' for the current one");
  return device;
}

int64_t cuda_free_bytes(c10::DeviceIndex device) {
  const c10::cuda::CUDAGuard guard(device);
  size_t free = 0, total = 0;
  C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device);
  constexpr size_t kAll = static_cast<size_t>(c10::CachingDeviceAllocator::StatType::AGGREGATE);
  const int64_t cached = stats.reserved_bytes[kAll].current - stats.allocated_bytes[kAll].current;
  return static_cast<int64_t>(free) + cached;
}

}  // namespace swap_optimizer::runtime
