// Host memory and transports for a device: exact-size host slabs (pinned for
// CUDA when possible) and the transport that copies between them and the device.
#pragma once

#include "pipeline.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <memory>

namespace swap_optimizer::runtime {

// A zeroed uint8 CPU tensor of exactly `bytes`, page-locked when `try_pin` and
// the driver allows it (*pinned says which). Its views keep it alive.
at::Tensor allocate_host_slab(int64_t bytes, bool try_pin, bool* pinned);

// Test hook: while set, every attempt to pin host memory fails as if the driver
// had refused it.
void simulate_pin_failure(bool enabled);

// `device` with its index: an unindexed CUDA device (torch's "cuda", -1 here)
// is the current one, which CUDA's own calls need named. Every entry below
// resolves its device first.
c10::Device resolve_device(const c10::Device& device);

// The transport for `device`: CUDA streams and events, or the host backend's
// worker threads for CPU. Fails with a clear error for a CUDA device in a
// build without CUDA.
std::unique_ptr<Transport> make_transport(const c10::Device& device, int slots, bool separate_copy_queues);

// Bytes that allocations on `device` can still get: the driver's free memory
// plus what PyTorch's caching allocator holds unused (CUDA), or the host's
// available memory (CPU).
int64_t free_device_bytes(const c10::Device& device);

struct CopyBandwidth {
  double host_to_device;  // bytes per second
  double device_to_host;
  double both_directions; // both at once, bytes moved per second in total
};

// Measures the transport's copies of `bytes` between a host slab (pinned where
// the runtime pins) and device memory, median of `repeats` runs.
CopyBandwidth measure_copy_bandwidth(const c10::Device& device, int64_t bytes, int repeats);

}  // namespace swap_optimizer::runtime
