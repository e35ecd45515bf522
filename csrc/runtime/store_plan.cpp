#include "store_plan.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>

namespace swap_optimizer::runtime {
namespace {

// Number of ranges greedy filling needs when no range may exceed `capacity`.
int64_t greedy_part_count(const std::vector<int64_t>& costs, int64_t capacity) {
  int64_t count = 1, sum = 0;
  for (int64_t cost : costs) {
    if (sum + cost > capacity) {
      ++count;
      sum = 0;
    }
    sum += cost;
  }
  return count;
}

bool key_kept(const SlotSpec& slot, int key) {
  switch (key) {
    case kMaxExpAvgSq: return slot.amsgrad;
    case kMaster: return slot.master;
    default: return true;
  }
}

int64_t key_bytes(const SlotSpec& slot, int key) {
  return slot.numel * (key == kMaster ? 4 : slot.state_element_size);
}

// Lays out `keys_swapped == swapped` states of each slot of a batch from `cursor`.
int64_t place_states(const std::vector<SlotSpec>& specs, const std::vector<int64_t>& batch_slots,
                     const KeyFlags& swap_keys, bool swapped, int64_t cursor,
                     std::vector<SlotPlacement>& placements) {
  for (int64_t slot : batch_slots) {
    const SlotSpec& spec = specs[slot];
    for (int key = 0; key < kStateKeyCount; ++key) {
      if (!key_kept(spec, key)) continue;
      const bool key_swapped = spec.swappable && swap_keys[key];
      if (key_swapped != swapped) continue;
      cursor = align_up(cursor, kRegionAlignment);
      placements[slot].arena_offset[key] = cursor;
      placements[slot].swapped[key] = key_swapped;
      cursor += key_bytes(spec, key);
    }
  }
  return cursor;
}

}  // namespace

std::vector<std::pair<int64_t, int64_t>> partition_balanced(const std::vector<int64_t>& costs,
                                                            int64_t parts) {
  const int64_t n = static_cast<int64_t>(costs.size());
  std::vector<std::pair<int64_t, int64_t>> ranges;
  if (n == 0) return ranges;
  parts = std::clamp<int64_t>(parts, 1, n);
  // The smallest capacity with which greedy filling needs at most `parts` ranges
  // is the optimal largest range sum (costs are contiguous and non-negative).
  int64_t low = *std::max_element(costs.begin(), costs.end());
  int64_t high = std::accumulate(costs.begin(), costs.end(), int64_t{0});
  while (low < high) {
    const int64_t mid = low + (high - low) / 2;
    if (greedy_part_count(costs, mid) <= parts) high = mid; else low = mid + 1;
  }
  // Fill greedily at that capacity, and close ranges early once every remaining
  // item must open its own range to reach exactly `parts` ranges.
  int64_t begin = 0, sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t ranges_after_current = parts - static_cast<int64_t>(ranges.size()) - 1;
    if (i > begin && (sum + costs[i] > low || n - i == ranges_after_current)) {
      ranges.emplace_back(begin, i);
      begin = i;
      sum = 0;
    }
    sum += costs[i];
  }
  ranges.emplace_back(begin, n);
  return ranges;
}

StorePlan plan_store(const std::vector<SlotSpec>& specs, const KeyFlags& swap_keys,
                     int64_t swap_times) {
  if (swap_times < 1) throw std::invalid_argument("plan_store: swap_times must be >= 1");
  StorePlan plan;
  const int64_t slot_count = static_cast<int64_t>(specs.size());
  plan.slots.assign(slot_count, SlotPlacement{-1, -1, {kNoOffset, kNoOffset, kNoOffset, kNoOffset},
                                              {false, false, false, false}});

  std::vector<int64_t> resident_slots, swappable_slots, costs;
  for (int64_t i = 0; i < slot_count; ++i) {
    const SlotSpec& spec = specs[i];
    if (!spec.swappable) {
      resident_slots.push_back(i);
      continue;
    }
    swappable_slots.push_back(i);
    int64_t cost = kStepBytes;
    for (int key = 0; key < kStateKeyCount; ++key) {
      if (key_kept(spec, key)) cost += align_up(key_bytes(spec, key), kRegionAlignment);
    }
    costs.push_back(cost);
  }

  if (!resident_slots.empty()) {
    BatchPlan batch;
    batch.slots = resident_slots;
    batch.resident = true;
    plan.batches.push_back(batch);
  }
  for (const auto& [begin, end] : partition_balanced(costs, swap_times)) {
    BatchPlan batch;
    batch.slots.assign(swappable_slots.begin() + begin, swappable_slots.begin() + end);
    plan.batches.push_back(batch);
    ++plan.rotating_batches;
  }

  for (int64_t b = 0; b < static_cast<int64_t>(plan.batches.size()); ++b) {
    BatchPlan& batch = plan.batches[b];
    const int64_t count = static_cast<int64_t>(batch.slots.size());
    for (int64_t k = 0; k < count; ++k) {
      plan.slots[batch.slots[k]].batch = b;
      plan.slots[batch.slots[k]].index_in_batch = k;
    }
    batch.steps_bytes = align_up(count * kStepBytes, kRegionAlignment);
    if (batch.resident) {
      // Only the step table travels; every state sits in the resident store.
      batch.host_bytes = count * kStepBytes;
      batch.resident_begin = 0;
      batch.arena_bytes = place_states(specs, batch.slots, swap_keys, false, batch.steps_bytes, plan.slots);
    } else {
      batch.host_bytes = place_states(specs, batch.slots, swap_keys, true, batch.steps_bytes, plan.slots);
      batch.resident_begin = align_up(batch.host_bytes, kRegionAlignment);
      const int64_t end = place_states(specs, batch.slots, swap_keys, false, batch.resident_begin, plan.slots);
      batch.arena_bytes = end > batch.resident_begin ? end : batch.host_bytes;
      plan.staging_arena_bytes = std::max(plan.staging_arena_bytes, batch.arena_bytes);
    }
    const int64_t resident_part = batch.arena_bytes - batch.resident_begin;
    if (resident_part > 0) {
      batch.resident_offset = plan.resident_store_bytes;
      plan.resident_store_bytes += align_up(resident_part, kRegionAlignment);
    }
    plan.host_bytes += batch.host_bytes;
  }
  return plan;
}

}  // namespace swap_optimizer::runtime
