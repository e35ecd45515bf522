// Where every optimizer state lives: the partition of the params' elements into
// batches (a large param may be split into pieces across batches), the byte
// layout of the host regions, of each batch's staging arena and of the resident
// store, and the copies that move a batch between them. Plain C++ (no torch), so
// it can be tested on its own; the runtime follows this layout and decides nothing
// about layout itself.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace swap_optimizer::runtime {

// Regions start on this boundary in host slabs, arenas and the resident store:
// enough for the kernels' 16-byte vector accesses and for DMA-friendly copies.
constexpr int64_t kRegionAlignment = 256;
constexpr int64_t kNoOffset = -1;
// A piece of a split param starts at a multiple of this many elements: whole
// vectors, whole 32-bit words of 16-bit dtypes, whole blocks of quantized states.
constexpr int64_t kSplitGranule = 256;
// No piece of a split param holds less state than this, so a small budget or a
// large swap_times cannot turn a step into thousands of tiny copies.
constexpr int64_t kMinPieceBytes = int64_t{64} << 10;

// How one state of a param is laid out, by the bytes `count` of its elements
// take. Every slot of a layout has the same keys (an optimizer's states); a key
// the slot does not keep is absent.
enum class StateKind : int {
  kAbsent,
  kPerElement,  // unit_bytes per element: param-shaped, cut with its param
  kPerBlock,    // unit_bytes per started block of block_elements (8-bit scales)
  kWhole,       // unit_bytes in all, not param-shaped: its param is never cut
};

struct StateLayout {
  StateKind kind = StateKind::kAbsent;
  int64_t unit_bytes = 0;
  int64_t block_elements = 1;  // kPerBlock only; divides kSplitGranule
};

struct SlotSpec {
  int64_t numel;
  bool swappable;                   // false: all its states stay in the resident store
  std::vector<StateLayout> states;  // one per key
  bool splittable = true;           // false: its update reads the whole param, so it is never cut
  // Resident slots of one group are updated as one resident batch; the groups'
  // batches come in increasing group order (overlap_forward: one per block).
  int64_t resident_group = 0;
};

// Per key: whether a slot keeps it, whether it is swapped, where it lies.
using KeyFlags = std::vector<bool>;
using KeyOffsets = std::vector<int64_t>;

// Whether a slot keeps state `key`, and the bytes of `count` of its elements
// of it (from a multiple of the key's block, for block keys; all of them, for
// whole keys).
bool key_kept(const SlotSpec& slot, int key);
int64_t key_bytes(const SlotSpec& slot, int key, int64_t count);

// Whether a slot may be cut into pieces: its rule allows it, and it keeps a
// state with bytes to share out.
bool can_split(const SlotSpec& slot);

// Host region 0 is the step table: step_bytes per param (Adam's float32 step
// count; 0 where the update keeps its scalars itself), copied to a device step
// table at the start of a step and back at its end.
constexpr int64_t kStepTableRegion = 0;
// The `region` of a state or copy that lives in the device's resident store.
constexpr int64_t kResidentStore = -1;

// Where one state of a param lives between steps: a host region or the resident
// store, and the byte offset of its first element there. The state is one
// contiguous tensor of numel elements (a split param's pieces are not cut out).
struct StateHome {
  int64_t region = kResidentStore;
  int64_t offset = kNoOffset;  // kNoOffset: the param does not keep this state
};

struct SlotPlacement {
  std::vector<StateHome> home;  // per key
  int64_t first_batch = -1;  // the batches holding its pieces, in pipeline order
  int64_t last_batch = -1;
  bool split = false;        // its elements are spread over several batches
};

// One row of a batch's fused update: a whole param or a piece of one.
struct PieceRow {
  int64_t slot;
  int64_t element_offset;  // first element of the piece in the param
  int64_t count;           // elements in the piece
  KeyOffsets arena_offset; // byte offset of each kept state's piece in the arena; kNoOffset if not kept
  int64_t step_index;      // the param's count in the step table
  bool advances_step;      // the param's last piece: its update advances the step count
};

// `rows` rows of `width` bytes between a home (a host region, or the resident
// store for a device-to-device copy) and the arena; rows are `pitch` bytes apart
// at home and `arena_pitch` bytes apart in the arena.
struct RegionCopy {
  int64_t region;
  int64_t offset;
  int64_t pitch;
  int64_t arena_offset;
  int64_t arena_pitch;
  int64_t width;
  int64_t rows;
};

// One batch of the pipeline. Its arena holds the host-swapped states of its rows
// (first the whole params, packed exactly as in the batch's own host region, so
// one copy moves them; then each piece of a split param, its states row by row),
// then the states kept on the device, which join the arena for the update.
// A resident batch (params too small or not swappable, one batch per resident
// group) uses the resident store from its start as its arena (its rows' offsets
// are the store's, its arena_bytes where its last state ends), so nothing of it
// travels.
struct BatchLayout {
  std::vector<PieceRow> rows;
  std::vector<RegionCopy> host_copies;      // over the link, the same each way
  std::vector<RegionCopy> resident_copies;  // device to device, in before the update and out after
  int64_t host_bytes = 0;                   // moved each way
  int64_t arena_bytes = 0;
  bool resident = false;
};

struct StoreLayout {
  std::vector<SlotPlacement> slots;
  std::vector<BatchLayout> batches;        // the resident batches, if any, come first
  std::vector<int64_t> host_region_bytes;  // exact size of each host region; 0 is the step table
  int64_t rotating_batches = 0;            // batches that go through staging arenas
  int64_t staging_arena_bytes = 0;         // the largest arena of a rotating batch
  int64_t step_table_bytes = 0;            // the device step table as counted in staging (256-B aligned)
  int64_t split_params = 0;                // params whose pieces are in several batches
  int64_t resident_store_bytes = 0;
  int64_t host_bytes = 0;                  // all host regions
  int64_t moved_bytes = 0;                 // bytes a step moves each way, step table included
};

constexpr int64_t align_up(int64_t value, int64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

// Splits costs (in order) into min(parts, costs.size()) contiguous ranges
// [begin, end) whose largest sum is as small as possible.
std::vector<std::pair<int64_t, int64_t>> partition_balanced(const std::vector<int64_t>& costs,
                                                            int64_t parts);

// The finest split worth asking for: a batch per swappable slot, or a batch per
// piece of the state, whichever is more. lay_out_store makes no more batches.
int64_t finest_swap_times(const std::vector<SlotSpec>& slots);

// `swap_keys` says which states of swappable slots go to the host store; the
// others stay in the resident store. swap_times >= 1.
//
// Swappable slots are cut, in order, into at most swap_times batches. When whole
// params can be balanced to within kMinPieceBytes of the ideal (state / swap_times),
// no param is split and the largest batch is as small as any contiguous split of
// whole params makes it. Otherwise a param is split where keeping it whole would
// put a batch more than a piece over the capacity, at multiples of kSplitGranule
// elements, and the capacity is the smallest for which swap_times batches suffice:
// the largest arena is then at most about state / swap_times + 2 * kMinPieceBytes.
// A slot that cannot be split stays whole; a batch holding one larger than the
// capacity holds only it. swap_keys has one flag per key of the slots.
StoreLayout lay_out_store(const std::vector<SlotSpec>& slots, const KeyFlags& swap_keys, int64_t swap_times,
                          int64_t step_bytes);

}  // namespace swap_optimizer::runtime
