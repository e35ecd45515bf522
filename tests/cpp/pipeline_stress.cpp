// Stress test of the runtime core without torch: the pipeline schedule and the
// host backend's worker-thread transport, built with ThreadSanitizer by
// tests/cpp/run_sanitizers.sh. Each batch's "update" adds 1 to every value of
// its arena (moved by strided copies, as split params' pieces are) and to its
// count in the device step table, and checks that the arena and the step table
// hold exactly what the host held (a missing wait shows up as a wrong value or
// as a data race). Random copy delays reorder the workers; injected update and
// copy-in failures and interrupts check that every batch, step count included,
// ends wholly old or wholly new. Deferred steps run the pipeline on an update
// thread while the main thread waits for each batch's readiness (as the
// forward's hooks do) and reads what the update wrote. The store layout and the
// whole-param partition are checked on random inputs too. Exits non-zero on
// the first failure.
#include "runtime/host_transport.h"
#include "runtime/pipeline.h"
#include "runtime/store_layout.h"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace rt = swap_optimizer::runtime;

namespace {

int failures = 0;

void expect(bool condition, const std::string& what) {
  if (!condition) {
    std::fprintf(stderr, "FAILED: %s\n", what.c_str());
    ++failures;
  }
}

struct Injected : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class CountingWork final : public rt::BatchWork {
 public:
  CountingWork(rt::Transport& transport, std::vector<std::vector<float>>& host, int slots, int64_t arena_floats)
      : transport_(transport), host_(host), arenas_(slots, std::vector<float>(arena_floats)) {}

  int64_t fail_update_at = -1;
  int64_t fail_stage_in_at = -1;
  int64_t interrupt_before = -1;
  int64_t expected_value = 0;  // what every host value holds before this step

  // The step table: one count per batch, incremented by the batch's update.
  std::vector<float> host_steps, device_steps;
  // Deferred steps: what each update writes outside the arenas (a param), and
  // readiness marked after it.
  bool deferred = false;
  std::vector<float> params;

  void stage_in_step_table() override {
    const int64_t bytes = static_cast<int64_t>(host_steps.size() * sizeof(float));
    transport_.copy_to_device({device_steps.data(), bytes, host_steps.data(), bytes, bytes, 1});
  }
  void stage_out_step_table() override {
    const int64_t bytes = static_cast<int64_t>(host_steps.size() * sizeof(float));
    transport_.copy_to_host({host_steps.data(), bytes, device_steps.data(), bytes, bytes, 1});
  }
  // Each batch moves as two strided copies of half-rows (the shape of a split
  // param's pieces) when it has an even count of values, else as one plain copy.
  void stage_in(int64_t batch, int slot) override {
    if (batch == fail_stage_in_at) throw Injected("stage in");
    for (const rt::StridedCopy& copy : copies(arenas_[slot].data(), host_[batch].data(), batch, true)) {
      transport_.copy_to_device(copy);
    }
  }
  void stage_out(int64_t batch, int slot) override {
    for (const rt::StridedCopy& copy : copies(host_[batch].data(), arenas_[slot].data(), batch, false)) {
      transport_.copy_to_host(copy);
    }
  }
  void between_batches(int64_t next) override {
    if (next == interrupt_before) throw Injected("interrupt");
  }
  void update(int64_t batch, int slot) override {
    if (batch == fail_update_at) throw Injected("update");
    std::vector<float>& arena = arenas_[slot];
    if (device_steps[batch] != static_cast<float>(expected_value)) {
      expect(false, "batch " + std::to_string(batch) + " was updated before the step table landed");
    }
    for (int64_t i = 0; i < static_cast<int64_t>(host_[batch].size()); ++i) {
      float& value = arena[arena_index(batch, i)];
      if (value != static_cast<float>(expected_value)) {
        expect(false, "batch " + std::to_string(batch) + " was updated before its copy in landed");
        return;
      }
      value += 1.0f;
    }
    device_steps[batch] += 1.0f;
    if (deferred) {
      params[batch] = static_cast<float>(expected_value + 1);
      transport_.mark_ready(batch);
    }
  }

 private:
  // Rows of `half` values: row r of the host region at r * half, in the arena
  // at r * (half + 3) (a wider pitch, as an arena's aligned rows have).
  int64_t arena_index(int64_t batch, int64_t i) const {
    const int64_t n = static_cast<int64_t>(host_[batch].size());
    if (n % 2 != 0) return i;
    const int64_t half = n / 2;
    return i / half * (half + 3) + i % half;
  }

  std::vector<rt::StridedCopy> copies(float* dst, float* src, int64_t batch, bool to_arena) const {
    const int64_t n = static_cast<int64_t>(host_[batch].size());
    if (n % 2 != 0) return {{dst, 0, src, 0, n * 4, 1}};
    const int64_t half = n / 2, host_pitch = half * 4, arena_pitch = (half + 3) * 4;
    return {{dst, to_arena ? arena_pitch : host_pitch, src, to_arena ? host_pitch : arena_pitch, half * 4, 2}};
  }
  rt::Transport& transport_;
  std::vector<std::vector<float>>& host_;
  std::vector<std::vector<float>> arenas_;
};

// How a case's copies run: all on the workers, with random delays; mixed, the
// caller making each copy up to 8 KiB itself where its queue is idle, the
// others delayed on the workers (a copy made too early shows as a wrong value);
// with no delays, the runtime's own default.
constexpr int kDelayed = 0, kMixed = 1, kNoDelays = 2;

// `residents` of the batches, at random positions, have a slot of their own
// (N + k, as the runtime gives each resident batch); the others rotate over N.
void run_case(int arenas, int batches, int residents, uint64_t seed, bool deferred, int copies) {
  std::mt19937_64 random(seed);
  std::vector<std::vector<float>> host;
  int64_t largest = 0;
  for (int b = 0; b < batches; ++b) {
    host.emplace_back(1 + random() % 5000, 0.0f);
    largest = std::max<int64_t>(largest, static_cast<int64_t>(host.back().size()) + 6);  // + the wider pitch
  }
  std::vector<bool> resident(batches, false);
  for (int k = 0; k < std::min(residents, batches - 1); ++k) resident[k] = true;
  std::shuffle(resident.begin(), resident.end(), random);
  const int rotating = batches - static_cast<int>(std::count(resident.begin(), resident.end(), true));
  const int arena_slots = std::min(arenas, rotating);
  std::vector<int> slot_of_batch;
  for (int b = 0, r = 0, k = 0; b < batches; ++b) slot_of_batch.push_back(resident[b] ? arena_slots + k++ : r++ % arena_slots);
  const int slots = arena_slots + (batches - rotating);
  // previous_user[b]: the batch that used b's slot before it in this step, or -1.
  std::vector<int64_t> previous_user(batches, -1);
  for (int b = 0; b < batches; ++b) {
    for (int a = b - 1; a >= 0; --a) {
      if (slot_of_batch[a] == slot_of_batch[b]) {
        previous_user[b] = a;
        break;
      }
    }
  }
  rt::HostTransport transport(slots, /*separate_copy_queues=*/arena_slots >= 3);
  transport.set_copy_delay(copies == kNoDelays ? 0 : 200, seed);
  if (copies == kMixed) transport.set_copy_here_bytes(8 << 10);
  CountingWork work(transport, host, slots, largest);
  work.host_steps.assign(batches, 0.0f);
  work.device_steps.assign(batches, -1.0f);  // garbage until the step table is copied in
  work.deferred = deferred;
  work.params.assign(batches, 0.0f);
  rt::WorkerQueue update_thread;

  int64_t steps_done = 0;
  for (int step = 0; step < 12; ++step) {
    work.expected_value = steps_done;
    // Steps 3, 7 and 11 fail: an update, an interrupt, a copy in.
    const bool fail = step % 4 == 3;
    const int64_t kind = step / 4 % 3;
    const int64_t at = static_cast<int64_t>(random() % batches);
    work.fail_update_at = fail && kind == 0 ? at : -1;
    work.interrupt_before = fail && kind == 1 && at > 0 ? at : -1;
    work.fail_stage_in_at = fail && kind == 2 ? at : -1;
    // A fresh device step table holds garbage until its copy in lands.
    std::fill(work.device_steps.begin(), work.device_steps.end(), -1.0f);
    bool threw = false;
    if (deferred) {
      std::exception_ptr failure;
      transport.open_ready(batches);
      const uint64_t ticket = update_thread.submit([&] {
        try {
          rt::run_pipeline(transport, work, slot_of_batch);
        } catch (...) {
          failure = std::current_exception();
        }
        transport.release_ready();
      });
      // The forward's hooks: wait for each batch in turn and read its param.
      for (int b = 0; b < batches; ++b) {
        const bool ended = transport.wait_ready(b);
        if (!ended && work.params[b] != static_cast<float>(steps_done + 1)) {
          expect(false, "batch " + std::to_string(b) + " was ready before its update wrote the param");
        }
      }
      update_thread.wait_for(ticket);
      transport.host_wait(rt::kStepEndMarker);
      try {
        if (failure) std::rethrow_exception(failure);
      } catch (const Injected&) {
        threw = true;
      }
    } else {
      try {
        rt::run_pipeline(transport, work, slot_of_batch);
        transport.host_wait(rt::kStepEndMarker);
      } catch (const Injected&) {
        threw = true;
      }
    }
    // Copies in are enqueued in order, each once the batch before it in its
    // slot is copied out: batch `at`'s once every batch up to it has its slot.
    int64_t staged_after = -1;
    for (int64_t b = 0; b <= work.fail_stage_in_at; ++b) staged_after = std::max(staged_after, previous_user[b]);
    const int64_t stop = work.fail_update_at >= 0      ? work.fail_update_at
                         : work.fail_stage_in_at >= 0 ? staged_after + 1
                                                      : work.interrupt_before;
    expect(threw == (stop >= 0), "a failure was injected exactly when one was thrown");
    // Batches before the failure are new, the rest old; each wholly, its step count too.
    for (int b = 0; b < batches; ++b) {
      const float want = static_cast<float>(threw && b >= stop ? steps_done : steps_done + 1);
      if (deferred && work.params[b] != want) {
        expect(false, "batch " + std::to_string(b) + "'s param is " + std::to_string(work.params[b]));
      }
      if (work.host_steps[b] != want) {
        expect(false, "batch " + std::to_string(b) + "'s step count is " + std::to_string(work.host_steps[b]) +
                          ", expected " + std::to_string(want));
      }
      for (float value : host[b]) {
        if (value != want) {
          expect(false, "arenas " + std::to_string(arenas) + ", batches " + std::to_string(batches) + ", step " +
                            std::to_string(step) + ": batch " + std::to_string(b) + " holds " +
                            std::to_string(value) + ", expected " + std::to_string(want));
          break;
        }
      }
    }
    if (threw) {
      // Bring the stopped batches level again, as the next full step would expect.
      for (int b = static_cast<int>(stop); b < batches; ++b) {
        for (float& value : host[b]) value += 1.0f;
        work.host_steps[b] += 1.0f;
        work.params[b] += 1.0f;
      }
    }
    ++steps_done;
  }
}

void check_partition() {
  std::mt19937_64 random(7);
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<int64_t> costs(1 + random() % 12);
    for (int64_t& c : costs) c = 1 + random() % 100;
    const int64_t parts = 1 + random() % 14;
    const auto ranges = rt::partition_balanced(costs, parts);
    expect(static_cast<int64_t>(ranges.size()) == std::min<int64_t>(parts, costs.size()), "exactly min(parts, n) ranges");
    int64_t largest = 0, next = 0;
    for (const auto& [begin, end] : ranges) {
      expect(begin == next && end > begin, "ranges are contiguous and non-empty");
      int64_t sum = 0;
      for (int64_t i = begin; i < end; ++i) sum += costs[i];
      largest = std::max(largest, sum);
      next = end;
    }
    expect(next == static_cast<int64_t>(costs.size()), "ranges cover every item");
    // Brute force over all splits into the same number of ranges.
    const int64_t n = costs.size(), k = ranges.size();
    int64_t best = INT64_MAX;
    for (uint64_t mask = 0; mask < (1ull << (n - 1)); ++mask) {
      if (__builtin_popcountll(mask) != k - 1) continue;
      int64_t sum = 0, worst = 0;
      for (int64_t i = 0; i < n; ++i) {
        sum += costs[i];
        if (i == n - 1 || (mask >> i) & 1) {
          worst = std::max(worst, sum);
          sum = 0;
        }
      }
      best = std::min(best, worst);
    }
    expect(largest == best, "the largest range is as small as any split makes it");
  }
}

// Random params (some empty), states and swap_times: the layout covers every
// element of every param once, in order, in pieces starting at multiples of
// the granule; no two states overlap in an arena or a home; each state's piece in
// the arena is exactly where the batch's copies bring its home bytes; and the
// largest arena is within two pieces (plus a granule and alignment) of an even
// share of the state.
void check_plan() {
  std::mt19937_64 random(11);
  for (int trial = 0; trial < 400; ++trial) {
    // Slots of 1-5 keys: per-element states of 1, 2 or 4 bytes (some absent);
    // now and then a slot that may not be split, or one with a whole state.
    const int key_count = 1 + static_cast<int>(random() % 5);
    std::vector<rt::SlotSpec> specs(1 + random() % 8);
    bool all_splittable = true;
    for (rt::SlotSpec& spec : specs) {
      const int64_t scale = random() % 3 == 0 ? 400000 : 3000;
      const int64_t numel = random() % 10 == 0 ? 0 : static_cast<int64_t>(1 + random() % scale);
      spec = {numel, random() % 5 != 0, std::vector<rt::StateLayout>(key_count), random() % 10 != 0};
      for (rt::StateLayout& state : spec.states) {
        if (random() % 4 != 0) state = {rt::StateKind::kPerElement, int64_t{1} << (random() % 3), 1};
      }
      if (random() % 10 == 0) spec.states[0] = {rt::StateKind::kWhole, static_cast<int64_t>(random() % 5000), 1};
      spec.resident_group = static_cast<int64_t>(random() % 3);  // resident slots: one batch per group
      all_splittable = all_splittable && rt::can_split(spec);
    }
    rt::KeyFlags swap_keys(key_count);
    for (int key = 0; key < key_count; ++key) swap_keys[key] = random() % 4 != 0;
    const int64_t swap_times = 1 + random() % 40;
    const int64_t step_bytes = random() % 2 ? 4 : 0;
    const rt::StoreLayout layout = rt::lay_out_store(specs, swap_keys, swap_times, step_bytes);
    const std::string where = "layout trial " + std::to_string(trial);
    expect(layout.rotating_batches <= swap_times, where + ": at most swap_times batches");

    // Homes: inside their host region, and no two states overlapping in a region or the resident store.
    std::vector<std::vector<std::pair<int64_t, int64_t>>> home_ranges(layout.host_region_bytes.size() + 1);
    for (size_t i = 0; i < specs.size(); ++i) {
      for (int key = 0; key < key_count; ++key) {
        const rt::StateHome& home = layout.slots[i].home[key];
        if (home.offset == rt::kNoOffset || specs[i].numel == 0) continue;
        const int64_t end = home.offset + rt::key_bytes(specs[i], key, specs[i].numel);
        if (home.region == rt::kResidentStore) {
          expect(end <= layout.resident_store_bytes, where + ": inside the resident store");
          home_ranges.back().emplace_back(home.offset, end);
        } else {
          expect(home.region > rt::kStepTableRegion &&
                     home.region < static_cast<int64_t>(layout.host_region_bytes.size()) &&
                     end <= layout.host_region_bytes[home.region],
                 where + ": inside its host region");
          home_ranges[home.region].emplace_back(home.offset, end);
        }
      }
    }
    for (auto& ranges : home_ranges) {
      std::sort(ranges.begin(), ranges.end());
      for (size_t k = 1; k < ranges.size(); ++k) {
        expect(ranges[k].first >= ranges[k - 1].second, where + ": no two states overlap at home");
      }
    }

    std::vector<int64_t> covered(specs.size(), 0);
    int64_t total = 0;
    for (size_t i = 0; i < specs.size(); ++i) {
      for (int key = 0; key < key_count; ++key) {
        if (specs[i].swappable && layout.slots[i].home[key].offset != rt::kNoOffset) {
          total += rt::align_up(rt::key_bytes(specs[i], key, specs[i].numel), rt::kRegionAlignment);
        }
      }
    }
    int64_t last_group = -1;
    for (const rt::BatchLayout& batch : layout.batches) {
      if (batch.resident) {  // one group per resident batch, in increasing order, before every rotating batch
        const int64_t group = specs[batch.rows.front().slot].resident_group;
        const auto resident_batches = static_cast<std::ptrdiff_t>(layout.batches.size() - layout.rotating_batches);
        expect(group > last_group && &batch - layout.batches.data() < resident_batches,
               where + ": resident batches by group, first");
        for (const rt::PieceRow& row : batch.rows) {
          expect(specs[row.slot].resident_group == group, where + ": a resident batch holds one group");
        }
        last_group = group;
      }
      std::vector<std::pair<int64_t, int64_t>> arena_ranges;
      for (const rt::PieceRow& row : batch.rows) {
        const rt::SlotSpec& spec = specs[row.slot];
        expect(row.element_offset == covered[row.slot] && (row.count > 0 || spec.numel == 0),
               where + ": pieces in order, once");
        expect(row.step_index == row.slot, where + ": the step table holds param i's count at i");
        expect(row.element_offset % rt::kSplitGranule == 0, where + ": pieces start on a granule");
        expect(rt::can_split(spec) || row.count == spec.numel, where + ": a slot that may not be split stays whole");
        covered[row.slot] += row.count;
        expect(row.advances_step == (covered[row.slot] == spec.numel), where + ": the last piece advances");
        for (int key = 0; key < key_count; ++key) {
          const rt::StateHome& home = layout.slots[row.slot].home[key];
          expect((row.arena_offset[key] == rt::kNoOffset) == (home.offset == rt::kNoOffset), where + ": kept states");
          if (home.offset == rt::kNoOffset) continue;
          const int64_t width = spec.states[key].unit_bytes;  // per element (whole states: checked whole below)
          const int64_t begin = row.arena_offset[key], end = begin + rt::key_bytes(spec, key, row.count);
          expect(begin % rt::kRegionAlignment == 0 && end <= batch.arena_bytes, where + ": inside the arena");
          arena_ranges.emplace_back(begin, end);
          if (batch.resident || row.count == 0 || spec.states[key].kind != rt::StateKind::kPerElement) continue;
          // Follow the copies: which home byte lands on the piece's first and last element?
          const std::vector<rt::RegionCopy>& copies =
              home.region == rt::kResidentStore ? batch.resident_copies : batch.host_copies;
          for (const int64_t element : {int64_t{0}, row.count - 1}) {
            const int64_t arena_byte = begin + element * width;
            int64_t found = -1;
            for (const rt::RegionCopy& copy : copies) {
              if (copy.region != home.region) continue;
              for (int64_t r = 0; r < copy.rows; ++r) {
                const int64_t at = copy.arena_offset + r * copy.arena_pitch;
                if (arena_byte >= at && arena_byte < at + copy.width) found = copy.offset + r * copy.pitch + arena_byte - at;
              }
            }
            expect(found == home.offset + (row.element_offset + element) * width, where + ": copies bring the piece");
          }
        }
      }
      std::sort(arena_ranges.begin(), arena_ranges.end());
      for (size_t k = 1; k < arena_ranges.size(); ++k) {
        expect(arena_ranges[k].first >= arena_ranges[k - 1].second, where + ": no overlap in the arena");
      }
      // One copy for the whole params, and per piece of a cut param one per
      // run of alike states (at most one per key).
      int64_t pieces = 0;
      for (const rt::PieceRow& row : batch.rows) pieces += layout.slots[row.slot].split ? 1 : 0;
      expect(static_cast<int64_t>(batch.host_copies.size()) <= 1 + pieces * key_count,
             where + ": a few copies per batch");
    }
    std::vector<bool> in_a_batch(specs.size(), false);
    for (const rt::BatchLayout& batch : layout.batches) {
      for (const rt::PieceRow& row : batch.rows) in_a_batch[row.slot] = true;
    }
    for (size_t i = 0; i < specs.size(); ++i) {
      expect(covered[i] == specs[i].numel && in_a_batch[i], where + ": every element once, every param in a batch");
    }
    expect(layout.step_table_bytes == rt::align_up(static_cast<int64_t>(specs.size()) * step_bytes,
                                                 rt::kRegionAlignment),
           where + ": the step table has step_bytes per param");
    if (!all_splittable) continue;  // a whole slot larger than a share makes its batch larger
    const int64_t bound = (total + swap_times - 1) / swap_times + 2 * rt::kMinPieceBytes + 8192;
    expect(layout.staging_arena_bytes <= bound, where + ": largest arena " +
                                                    std::to_string(layout.staging_arena_bytes) + " within the bound " +
                                                    std::to_string(bound));
  }
}

}  // namespace

int main() {
  check_partition();
  check_plan();
  uint64_t seed = 1;
  for (const int copies : {kDelayed, kMixed, kNoDelays}) {
    for (const bool deferred : {false, true}) {
      for (int arenas : {2, 3, 4}) {
        for (int batches : {1, 2, 3, 5, 9}) run_case(arenas, batches, /*residents=*/0, seed++, deferred, copies);
        for (int batches : {4, 9}) {
          run_case(arenas, batches, /*residents=*/1 + batches / 3, seed++, deferred, copies);
        }
      }
    }
  }
  if (failures) {
    std::fprintf(stderr, "%d failure(s)\n", failures);
    return 1;
  }
  std::printf("pipeline_stress: 63 pipeline cases (18 with resident slots; copies delayed, mixed and undelayed) x 12 "
              "steps, inline and deferred, 300 partitions and 400 store layouts passed\n");
  return 0;
}
