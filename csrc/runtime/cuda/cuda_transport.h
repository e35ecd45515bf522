// The CUDA backend of the pipeline: two copy streams (or one, chained, for two
// arenas) and the events, created once per runtime; pinned host slabs.
#pragma once

#include "../pipeline.h"

#include <c10/core/Device.h>

#include <cstdint>
#include <memory>

namespace swap_optimizer::runtime {

std::unique_ptr<Transport> make_cuda_transport(c10::DeviceIndex device, int slots,
                                               bool separate_copy_streams);

// Page-locked host memory of exactly `bytes`, or nullptr (with the CUDA error
// cleared) when the driver refuses it.
void* allocate_pinned(int64_t bytes);
void free_pinned(void* pointer) noexcept;

// `device` itself, or the current CUDA device for -1 (an unindexed "cuda");
// fails with the device count for an index this machine does not have.
c10::DeviceIndex resolve_cuda_index(c10::DeviceIndex device);

// The driver's free memory on `device` plus what the caching allocator has
// reserved there but not handed out.
int64_t cuda_free_bytes(c10::DeviceIndex device);

}  // namespace swap_optimizer::runtime
