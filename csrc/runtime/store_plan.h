// Where every optimizer state lives: the partition of params into batches and
// the byte layout of each batch's host region, staging arena and resident part.
// Plain C++ (no torch), so it can be tested on its own.
#pragma once

#include <array>
#include <cstdint>
#include <utility>
#include <vector>

namespace swap_optimizer::runtime {

// Regions start on this boundary in host slabs, arenas and the resident store:
// enough for the kernels' 16-byte vector accesses and for DMA-friendly copies.
constexpr int64_t kRegionAlignment = 256;
constexpr int64_t kNoOffset = -1;
constexpr int64_t kStepBytes = 4;  // one float32 step count per param, as torch.optim keeps

enum StateKey : int { kExpAvg = 0, kExpAvgSq = 1, kMaxExpAvgSq = 2, kMaster = 3, kStateKeyCount = 4 };
using KeyFlags = std::array<bool, kStateKeyCount>;
using KeyOffsets = std::array<int64_t, kStateKeyCount>;

struct SlotSpec {
  int64_t numel;
  int64_t state_element_size;  // bytes per element of exp_avg, exp_avg_sq, max_exp_avg_sq
  bool amsgrad;                // keeps max_exp_avg_sq
  bool master;                 // keeps an fp32 master copy
  bool swappable;              // false: all its states stay in the resident store
};

struct SlotPlacement {
  int64_t batch;           // index into StorePlan::batches
  int64_t index_in_batch;  // row of its step count in the batch's step table
  KeyOffsets arena_offset; // byte offset of each state in the batch's arena; kNoOffset if not kept
  KeyFlags swapped;        // true: the state travels with the host region; false: resident
};

// One batch of the pipeline. Its arena holds, in order: the step table
// [0, steps_bytes), the swapped states (the host region is exactly the first
// host_bytes bytes, copied in one piece each way), then from resident_begin the
// states that stay on the device, kept at resident_offset in the resident store.
// The resident batch (params too small or not swappable) uses the resident
// store itself as its arena, so only its step table travels.
struct BatchPlan {
  std::vector<int64_t> slots;
  int64_t steps_bytes = 0;
  int64_t host_bytes = 0;
  int64_t resident_begin = 0;
  int64_t arena_bytes = 0;
  int64_t resident_offset = 0;
  bool resident = false;
};

struct StorePlan {
  std::vector<SlotPlacement> slots;
  std::vector<BatchPlan> batches;  // the resident batch, if any, comes first
  int64_t rotating_batches = 0;    // batches that go through staging arenas
  int64_t staging_arena_bytes = 0; // the largest arena of a rotating batch
  int64_t resident_store_bytes = 0;
  int64_t host_bytes = 0;
};

constexpr int64_t align_up(int64_t value, int64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

// Splits costs (in order) into min(parts, costs.size()) contiguous ranges
// [begin, end) whose largest sum is as small as possible.
std::vector<std::pair<int64_t, int64_t>> partition_balanced(const std::vector<int64_t>& costs,
                                                            int64_t parts);

// `swap_keys` says which states of swappable slots go to the host store; the
// others stay in the resident store. swap_times >= 1.
StorePlan plan_store(const std::vector<SlotSpec>& slots, const KeyFlags& swap_keys,
                     int64_t swap_times);

}  // namespace swap_optimizer::runtime
