#include "store_layout.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>

namespace swap_optimizer::runtime {
namespace {

// A whole param, or the elements [offset, offset + count) of one.
struct Piece {
  int64_t slot;
  int64_t offset;
  int64_t count;
};
using PieceBatches = std::vector<std::vector<Piece>>;

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

// Bytes of one granule of a slot's kept states (exact: absmax blocks divide it).
int64_t granule_bytes(const SlotSpec& slot) {
  int64_t bytes = 0;
  for (int key = 0; key < static_cast<int>(slot.states.size()); ++key) {
    if (key_kept(slot, key)) bytes += key_bytes(slot, key, kSplitGranule);
  }
  return bytes;
}

// Arena bytes of `count` elements of a slot: every kept state on its own aligned region.
int64_t piece_cost(const SlotSpec& slot, int64_t count) {
  int64_t cost = 0;
  for (int key = 0; key < static_cast<int>(slot.states.size()); ++key) {
    if (key_kept(slot, key)) cost += align_up(key_bytes(slot, key, count), kRegionAlignment);
  }
  return cost;
}

int64_t min_piece_elements(const SlotSpec& slot) {
  const int64_t per_granule = granule_bytes(slot);
  return (kMinPieceBytes + per_granule - 1) / per_granule * kSplitGranule;
}

PieceBatches whole_param_batches(const std::vector<SlotSpec>& specs, const std::vector<int64_t>& slots,
                                 const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  PieceBatches batches;
  for (const auto& [begin, end] : ranges) {
    std::vector<Piece>& batch = batches.emplace_back();
    for (int64_t i = begin; i < end; ++i) batch.push_back({slots[i], 0, specs[slots[i]].numel});
  }
  return batches;
}

// Fills batches of about `capacity` bytes in order. A param that does not fit
// stays whole when it overshoots by at most a piece; otherwise it is split at a
// granule so its head fills the batch, as long as head and rest are each at
// least a piece. A batch only ever exceeds the capacity by less than a piece,
// or holds a single piece or unsplittable param larger than the capacity.
PieceBatches fill_with_splits(const std::vector<SlotSpec>& specs, const std::vector<int64_t>& slots,
                              int64_t capacity) {
  PieceBatches batches(1);
  int64_t used = 0;
  auto close_batch = [&] {
    batches.emplace_back();
    used = 0;
  };
  for (int64_t slot : slots) {
    const SlotSpec& spec = specs[slot];
    if (spec.numel == 0) {  // nothing to move, but it has (empty) states and a step count
      batches.back().push_back({slot, 0, 0});
      continue;
    }
    if (!can_split(spec)) {  // whole: in this batch if it fits (or overshoots by less than a piece), else alone
      const int64_t cost = piece_cost(spec, spec.numel);
      if (used > 0 && cost > capacity - used + kMinPieceBytes) close_batch();
      batches.back().push_back({slot, 0, spec.numel});
      used += cost;
      continue;
    }
    const int64_t min_piece = min_piece_elements(spec);
    const int64_t per_granule = granule_bytes(spec);
    int64_t offset = 0, remaining = spec.numel;
    while (remaining > 0) {
      const int64_t cost = piece_cost(spec, remaining);
      const int64_t room = capacity - used;
      if (cost <= room + kMinPieceBytes || (used == 0 && remaining < 2 * min_piece)) {
        batches.back().push_back({slot, offset, remaining});
        used += cost;
        break;
      }
      if (remaining >= 2 * min_piece) {
        // The largest granule-aligned head whose states fit, leaving at least a
        // piece behind (its regions' alignment padding, under 256 bytes each, may
        // overshoot the room: less than a piece, which arenas are sized for).
        int64_t head = std::max<int64_t>(room, 0) / per_granule * kSplitGranule;
        head = std::min(head, (remaining - min_piece) / kSplitGranule * kSplitGranule);
        if (head < min_piece && used == 0) head = min_piece;  // the capacity is below one piece
        if (head >= min_piece) {
          batches.back().push_back({slot, offset, head});
          offset += head;
          remaining -= head;
        }
      }
      close_batch();
    }
  }
  if (batches.back().empty()) batches.pop_back();
  return batches;
}

int64_t largest_batch_cost(const std::vector<SlotSpec>& specs, const PieceBatches& batches) {
  int64_t largest = 0;
  for (const auto& batch : batches) {
    int64_t cost = 0;
    for (const Piece& piece : batch) cost += piece_cost(specs[piece.slot], piece.count);
    largest = std::max(largest, cost);
  }
  return largest;
}

int64_t finest_parts(int64_t slot_count, int64_t total_cost) {
  return std::max<int64_t>({slot_count, (total_cost + kMinPieceBytes - 1) / kMinPieceBytes, 1});
}

PieceBatches partition_pieces(const std::vector<SlotSpec>& specs, const std::vector<int64_t>& slots,
                              int64_t parts) {
  if (slots.empty()) return {};
  std::vector<int64_t> costs;
  for (int64_t slot : slots) costs.push_back(piece_cost(specs[slot], specs[slot].numel));
  const int64_t total = std::accumulate(costs.begin(), costs.end(), int64_t{0});
  parts = std::min(parts, finest_parts(static_cast<int64_t>(slots.size()), total));
  const int64_t ideal = (total + parts - 1) / parts;
  PieceBatches whole = whole_param_batches(specs, slots, partition_balanced(costs, parts));
  if (largest_batch_cost(specs, whole) <= ideal + kMinPieceBytes) return whole;
  // The smallest capacity for which filling with splits needs at most `parts`
  // batches. Batches hold less than capacity + a piece, so none below
  // ideal - piece can do.
  int64_t low = std::max<int64_t>(1, ideal - kMinPieceBytes), high = total;
  while (low < high) {
    const int64_t mid = low + (high - low) / 2;
    if (static_cast<int64_t>(fill_with_splits(specs, slots, mid).size()) <= parts) high = mid; else low = mid + 1;
  }
  // Near that capacity the last batch may still overshoot by up to a piece;
  // a slightly larger capacity can balance it better: take the best of a few.
  PieceBatches best = whole;
  int64_t best_cost = largest_batch_cost(specs, whole);
  for (int64_t capacity = low; capacity <= low + 2 * kMinPieceBytes; capacity += kMinPieceBytes / 16) {
    PieceBatches split = fill_with_splits(specs, slots, capacity);
    const int64_t cost = largest_batch_cost(specs, split);
    if (static_cast<int64_t>(split.size()) <= parts && cost < best_cost) {
      best = std::move(split);
      best_cost = cost;
    }
  }
  return best;
}

// The kept states of a slot that live on the host (swapped) or on the device.
std::vector<int> keys_at(const SlotSpec& spec, const KeyFlags& swap_keys, bool host) {
  std::vector<int> keys;
  for (int key = 0; key < static_cast<int>(spec.states.size()); ++key) {
    if (key_kept(spec, key) && (spec.swappable && swap_keys[key]) == host) keys.push_back(key);
  }
  return keys;
}

// Lays the given states of a whole param one after another from `cursor`,
// each aligned; records where each lands at home (`home_base` + position, in
// `region`) and, when `arena_offset` is given, in the arena. Returns the end.
int64_t place_whole(const SlotSpec& spec, const std::vector<int>& keys, int64_t cursor, int64_t region,
                    int64_t home_base, KeyOffsets* arena_offset, SlotPlacement& placement) {
  for (int key : keys) {
    cursor = align_up(cursor, kRegionAlignment);
    if (arena_offset != nullptr) (*arena_offset)[key] = cursor;
    placement.home[key] = {region, home_base + cursor};
    cursor += key_bytes(spec, key, spec.numel);
  }
  return cursor;
}

// Whether two states of a slot lie alike at home and in the arena: the same
// bytes for a piece and for the whole param, so one strided copy moves both.
bool same_shape(const SlotSpec& spec, int a, int b, int64_t count) {
  return key_bytes(spec, a, count) == key_bytes(spec, b, count) &&
         key_bytes(spec, a, spec.numel) == key_bytes(spec, b, spec.numel);
}

// Lays a piece of a split param's states from `cursor` and adds the copies that
// move them from their homes: one strided copy per run of alike states (their
// rows lie at one pitch at home and in the arena). Returns the end.
int64_t place_piece(const SlotSpec& spec, const std::vector<int>& keys, const SlotPlacement& placement,
                    int64_t cursor, PieceRow& row, std::vector<RegionCopy>& copies) {
  size_t k = 0;
  while (k < keys.size()) {
    size_t end = k + 1;
    while (end < keys.size() && same_shape(spec, keys[k], keys[end], row.count)) ++end;
    const int64_t width = key_bytes(spec, keys[k], row.count);
    cursor = align_up(cursor, kRegionAlignment);
    const int64_t arena_pitch = align_up(width, kRegionAlignment);
    const StateHome& first = placement.home[keys[k]];
    copies.push_back({first.region, first.offset + key_bytes(spec, keys[k], row.element_offset),
                      align_up(key_bytes(spec, keys[k], spec.numel), kRegionAlignment), cursor, arena_pitch,
                      width, static_cast<int64_t>(end - k)});
    for (size_t r = k; r < end; ++r) {
      row.arena_offset[keys[r]] = cursor;
      cursor += r + 1 < end ? arena_pitch : width;
    }
    k = end;
  }
  return cursor;
}

}  // namespace

bool key_kept(const SlotSpec& slot, int key) { return slot.states[key].kind != StateKind::kAbsent; }

int64_t key_bytes(const SlotSpec& slot, int key, int64_t count) {
  const StateLayout& state = slot.states[key];
  switch (state.kind) {
    case StateKind::kAbsent: return 0;
    case StateKind::kPerElement: return count * state.unit_bytes;
    case StateKind::kPerBlock: return (count + state.block_elements - 1) / state.block_elements * state.unit_bytes;
    case StateKind::kWhole: return state.unit_bytes;
  }
  return 0;
}

bool can_split(const SlotSpec& slot) {
  if (!slot.splittable) return false;
  for (const StateLayout& state : slot.states) {
    if (state.kind == StateKind::kWhole) return false;
  }
  return granule_bytes(slot) > 0;
}

int64_t finest_swap_times(const std::vector<SlotSpec>& specs) {
  int64_t slots = 0, total = 0;
  for (const SlotSpec& spec : specs) {
    if (!spec.swappable) continue;
    ++slots;
    total += piece_cost(spec, spec.numel);  // every kept state joins the arena, swapped or not
  }
  return finest_parts(slots, total);
}

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

StoreLayout lay_out_store(const std::vector<SlotSpec>& specs, const KeyFlags& swap_keys, int64_t swap_times,
                          int64_t step_bytes) {
  if (swap_times < 1) throw std::invalid_argument("lay_out_store: swap_times must be >= 1");
  StoreLayout layout;
  const int64_t slot_count = static_cast<int64_t>(specs.size());
  for (const SlotSpec& spec : specs) {
    if (spec.states.size() != swap_keys.size()) {
      throw std::invalid_argument("lay_out_store: every slot needs one state layout per swap key");
    }
  }
  layout.slots.assign(slot_count, SlotPlacement{std::vector<StateHome>(swap_keys.size())});
  layout.host_region_bytes.push_back(slot_count * step_bytes);  // kStepTableRegion
  layout.step_table_bytes = align_up(slot_count * step_bytes, kRegionAlignment);

  std::vector<int64_t> resident_slots, swappable_slots;
  for (int64_t i = 0; i < slot_count; ++i) (specs[i].swappable ? swappable_slots : resident_slots).push_back(i);

  if (!resident_slots.empty()) {
    std::stable_sort(resident_slots.begin(), resident_slots.end(), [&](int64_t a, int64_t b) {
      return specs[a].resident_group < specs[b].resident_group;
    });
    int64_t cursor = 0;
    for (size_t k = 0; k < resident_slots.size(); ++k) {
      const int64_t slot = resident_slots[k];
      if (k == 0 || specs[slot].resident_group != specs[resident_slots[k - 1]].resident_group) {
        layout.batches.emplace_back().resident = true;
      }
      BatchLayout& batch = layout.batches.back();
      const int64_t index = static_cast<int64_t>(layout.batches.size()) - 1;
      PieceRow& row = batch.rows.emplace_back(
          PieceRow{slot, 0, specs[slot].numel, KeyOffsets(swap_keys.size(), kNoOffset), slot, true});
      cursor = place_whole(specs[slot], keys_at(specs[slot], swap_keys, false), cursor, kResidentStore, 0,
                           &row.arena_offset, layout.slots[slot]);
      layout.slots[slot].first_batch = layout.slots[slot].last_batch = index;
      batch.arena_bytes = cursor;
    }
    layout.resident_store_bytes = align_up(cursor, kRegionAlignment);
  }

  const PieceBatches pieces = partition_pieces(specs, swappable_slots, swap_times);
  const int64_t first_rotating = static_cast<int64_t>(layout.batches.size());
  for (size_t b = 0; b < pieces.size(); ++b) {
    for (const Piece& piece : pieces[b]) {
      SlotPlacement& placement = layout.slots[piece.slot];
      if (placement.first_batch < 0) placement.first_batch = first_rotating + static_cast<int64_t>(b);
      placement.last_batch = first_rotating + static_cast<int64_t>(b);
      placement.split = piece.count != specs[piece.slot].numel;
    }
  }
  // A split param keeps each state whole at home: its swapped states in a host
  // region of its own, its device-kept states in a block of the resident store,
  // one after another, each aligned.
  for (int64_t slot : swappable_slots) {
    SlotPlacement& placement = layout.slots[slot];
    if (!placement.split) continue;
    const std::vector<int> host_keys = keys_at(specs[slot], swap_keys, true);
    if (!host_keys.empty()) {
      const int64_t region = static_cast<int64_t>(layout.host_region_bytes.size());
      layout.host_region_bytes.push_back(place_whole(specs[slot], host_keys, 0, region, 0, nullptr, placement));
    }
    const int64_t block = layout.resident_store_bytes;
    const int64_t end = place_whole(specs[slot], keys_at(specs[slot], swap_keys, false), 0, kResidentStore, block,
                                    nullptr, placement);
    layout.resident_store_bytes += align_up(end, kRegionAlignment);
  }

  for (const std::vector<Piece>& batch_pieces : pieces) {
    BatchLayout& batch = layout.batches.emplace_back();
    for (const Piece& piece : batch_pieces) {
      PieceRow& row = batch.rows.emplace_back(
          PieceRow{piece.slot, piece.offset, piece.count, KeyOffsets(swap_keys.size(), kNoOffset), piece.slot, false});
      row.advances_step = piece.offset + piece.count == specs[piece.slot].numel;
    }
    // Host states: whole params packed as in the batch's own host region, then
    // pieces. The region exists whenever a whole param has host states, even
    // empty ones (a param of 0 elements): their views point into it.
    const int64_t packed_region = static_cast<int64_t>(layout.host_region_bytes.size());
    int64_t cursor = 0;
    bool packed_states = false;
    for (PieceRow& row : batch.rows) {
      if (layout.slots[row.slot].split) continue;
      const std::vector<int> keys = keys_at(specs[row.slot], swap_keys, true);
      packed_states |= !keys.empty();
      cursor = place_whole(specs[row.slot], keys, cursor, packed_region, 0, &row.arena_offset, layout.slots[row.slot]);
    }
    if (packed_states) layout.host_region_bytes.push_back(cursor);
    if (cursor > 0) batch.host_copies.push_back({packed_region, 0, cursor, 0, cursor, cursor, 1});
    for (PieceRow& row : batch.rows) {
      if (!layout.slots[row.slot].split) continue;
      cursor = place_piece(specs[row.slot], keys_at(specs[row.slot], swap_keys, true), layout.slots[row.slot], cursor,
                           row, batch.host_copies);
    }
    // Device-kept states after them: whole params as in the batch's block of the
    // resident store (one copy), then pieces from their params' blocks.
    const int64_t resident_begin = align_up(cursor, kRegionAlignment);
    const int64_t block = layout.resident_store_bytes - resident_begin;  // home = block + arena offset
    int64_t resident_end = resident_begin;
    for (PieceRow& row : batch.rows) {
      if (layout.slots[row.slot].split) continue;
      resident_end = place_whole(specs[row.slot], keys_at(specs[row.slot], swap_keys, false), resident_end,
                                 kResidentStore, block, &row.arena_offset, layout.slots[row.slot]);
    }
    if (resident_end > resident_begin) {
      const int64_t bytes = resident_end - resident_begin;
      batch.resident_copies.push_back({kResidentStore, layout.resident_store_bytes, bytes, resident_begin, bytes,
                                       bytes, 1});
      layout.resident_store_bytes += align_up(bytes, kRegionAlignment);
    }
    for (PieceRow& row : batch.rows) {
      if (!layout.slots[row.slot].split) continue;
      resident_end = place_piece(specs[row.slot], keys_at(specs[row.slot], swap_keys, false), layout.slots[row.slot],
                                 resident_end, row, batch.resident_copies);
    }
    for (const RegionCopy& copy : batch.host_copies) batch.host_bytes += copy.width * copy.rows;
    batch.arena_bytes = std::max(cursor, resident_end);
    layout.staging_arena_bytes = std::max(layout.staging_arena_bytes, batch.arena_bytes);
    layout.moved_bytes += batch.host_bytes;
    ++layout.rotating_batches;
  }
  layout.moved_bytes += layout.host_region_bytes[kStepTableRegion];
  layout.split_params = std::count_if(layout.slots.begin(), layout.slots.end(),
                                    [](const SlotPlacement& slot) { return slot.split; });
  layout.host_bytes = std::accumulate(layout.host_region_bytes.begin(), layout.host_region_bytes.end(), int64_t{0});
  return layout;
}

}  // namespace swap_optimizer::runtime
