#include "host_memory.h"

#include "host_transport.h"
#ifdef SWAP_OPTIMIZER_WITH_CUDA
#include "cuda/cuda_transport.h"
#endif

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <unistd.h>

namespace swap_optimizer::runtime {
namespace {

std::atomic<bool> pin_failure_simulated{false};

void* allocate_pageable(int64_t bytes) {
  void* pointer = nullptr;
  // Page-aligned, like pinned memory, and exactly `bytes` long.
  if (posix_memalign(&pointer, 4096, static_cast<size_t>(std::max<int64_t>(bytes, 1))) != 0) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, "SwapOptimizer: could not allocate ", bytes,
                     " bytes of host memory for the optimizer state");
  }
  return pointer;
}

template <typename Enqueue>
double median_seconds(Transport& transport, int repeats, Enqueue enqueue) {
  std::vector<double> seconds;
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    enqueue();
    transport.drain();
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::nth_element(seconds.begin(), seconds.begin() + repeats / 2, seconds.end());
  return seconds[repeats / 2];
}

}  // namespace

at::Tensor allocate_host_slab(int64_t bytes, bool try_pin, bool* pinned) {
  void* pointer = nullptr;
  *pinned = false;
#ifdef SWAP_OPTIMIZER_WITH_CUDA
  if (try_pin && bytes > 0 && !pin_failure_simulated.load()) {
    pointer = allocate_pinned(bytes);
    *pinned = pointer != nullptr;
  }
#endif
  if (!*pinned) pointer = allocate_pageable(bytes);
  std::memset(pointer, 0, static_cast<size_t>(bytes));
  const bool is_pinned = *pinned;
  auto release = [is_pinned](void* p) {
#ifdef SWAP_OPTIMIZER_WITH_CUDA
    if (is_pinned) return free_pinned(p);
#endif
    std::free(p);
  };
  return at::from_blob(pointer, {bytes}, release, at::TensorOptions().dtype(at::kByte));
}

void simulate_pin_failure(bool enabled) { pin_failure_simulated.store(enabled); }

c10::Device resolve_device(const c10::Device& device) {
  if (device.is_cpu()) return device;
#ifdef SWAP_OPTIMIZER_WITH_CUDA
  if (device.is_cuda()) return c10::Device(c10::kCUDA, resolve_cuda_index(device.index()));
#endif
  TORCH_CHECK_VALUE(false, "SwapOptimizer: params are on ", device, " but this build of swap_optimizer ",
                    device.is_cuda() ? "has no CUDA support; reinstall it with a CUDA build of torch and nvcc "
                                       "available (pip install --no-build-isolation .)"
                                     : "supports only CPU and CUDA tensors");
}

std::unique_ptr<Transport> make_transport(const c10::Device& requested, int slots, bool separate_copy_queues) {
  const c10::Device device = resolve_device(requested);
#ifdef SWAP_OPTIMIZER_WITH_CUDA
  if (device.is_cuda()) return make_cuda_transport(device.index(), slots, separate_copy_queues);
#endif
  return std::make_unique<HostTransport>(slots, separate_copy_queues);
}

int64_t free_device_bytes(const c10::Device& requested) {
  const c10::Device device = resolve_device(requested);
#ifdef SWAP_OPTIMIZER_WITH_CUDA
  if (device.is_cuda()) return cuda_free_bytes(device.index());
#endif
  return static_cast<int64_t>(sysconf(_SC_AVPHYS_PAGES)) * sysconf(_SC_PAGESIZE);
}

CopyBandwidth measure_copy_bandwidth(const c10::Device& requested, int64_t bytes, int repeats) {
  TORCH_CHECK_VALUE(bytes > 0 && repeats > 0, "measure_copy_bandwidth: need bytes > 0 and repeats > 0");
  const c10::Device device = resolve_device(requested);
  const c10::DeviceGuard guard(device);  // a no-op for CPU
  bool pinned = false;
  const at::Tensor host_in = allocate_host_slab(bytes, device.is_cuda(), &pinned);
  const at::Tensor host_out = allocate_host_slab(bytes, device.is_cuda(), &pinned);
  const auto options = at::TensorOptions().dtype(at::kByte).device(device);
  const at::Tensor device_in = at::empty({bytes}, options), device_out = at::empty({bytes}, options);
  device_out.zero_();
  const std::unique_ptr<Transport> transport = make_transport(device, 1, /*separate_copy_queues=*/true);
  // Copies start after the zeroing above (on the compute stream).
  transport->begin_step();
  transport->record(Queue::kCompute, kStepBeginMarker);
  transport->wait(Queue::kHostToDevice, kStepBeginMarker);
  transport->wait(Queue::kDeviceToHost, kStepBeginMarker);
  auto in = [&] { transport->copy_to_device({device_in.data_ptr(), bytes, host_in.data_ptr(), bytes, bytes, 1}); };
  auto out = [&] { transport->copy_to_host({host_out.data_ptr(), bytes, device_out.data_ptr(), bytes, bytes, 1}); };
  in();  // warm up both directions
  out();
  transport->drain();
  const double to_device = median_seconds(*transport, repeats, in);
  const double to_host = median_seconds(*transport, repeats, out);
  const double both = median_seconds(*transport, repeats, [&] { in(); out(); });
  return {bytes / to_device, bytes / to_host, 2.0 * bytes / both};
}

}  // namespace swap_optimizer::runtime
