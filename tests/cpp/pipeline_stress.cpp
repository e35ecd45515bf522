// Stress test of the runtime core without torch: the pipeline schedule and the
// host backend's worker-thread transport, built with ThreadSanitizer by
// tests/cpp/run_sanitizers.sh. Each batch's "update" adds 1 to every value of
// its arena and checks that the arena holds exactly what the host region held
// (a missing wait shows up as a wrong value or as a data race). Random copy
// delays reorder the workers; injected failures and interrupts check that every
// batch ends wholly old or wholly new. Exits non-zero on the first failure.
#include "runtime/host_transport.h"
#include "runtime/pipeline.h"
#include "runtime/store_plan.h"

#include <cstdio>
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
  int64_t interrupt_before = -1;
  int64_t expected_value = 0;  // what every host value holds before this step

  void stage_in(int64_t batch, int slot) override {
    transport_.copy_to_device(arenas_[slot].data(), host_[batch].data(), bytes(batch));
  }
  void stage_out(int64_t batch, int slot) override {
    transport_.copy_to_host(host_[batch].data(), arenas_[slot].data(), bytes(batch));
  }
  void between_batches(int64_t next) override {
    if (next == interrupt_before) throw Injected("interrupt");
  }
  void update(int64_t batch, int slot) override {
    if (batch == fail_update_at) throw Injected("update");
    std::vector<float>& arena = arenas_[slot];
    for (size_t i = 0; i < host_[batch].size(); ++i) {
      if (arena[i] != static_cast<float>(expected_value)) {
        expect(false, "batch " + std::to_string(batch) + " was updated before its copy in landed");
        return;
      }
      arena[i] += 1.0f;
    }
  }

 private:
  int64_t bytes(int64_t batch) const { return static_cast<int64_t>(host_[batch].size() * sizeof(float)); }
  rt::Transport& transport_;
  std::vector<std::vector<float>>& host_;
  std::vector<std::vector<float>> arenas_;
};

void run_case(int arenas, int batches, uint64_t seed) {
  std::mt19937_64 random(seed);
  std::vector<std::vector<float>> host;
  int64_t largest = 0;
  for (int b = 0; b < batches; ++b) {
    host.emplace_back(1 + random() % 5000, 0.0f);
    largest = std::max<int64_t>(largest, static_cast<int64_t>(host.back().size()));
  }
  const int slots = std::min(arenas, batches);
  rt::HostTransport transport(slots, /*separate_copy_queues=*/slots >= 3);
  transport.set_copy_delay(200, seed);
  std::vector<int> slot_of_batch;
  for (int b = 0; b < batches; ++b) slot_of_batch.push_back(b % slots);
  CountingWork work(transport, host, slots, largest);

  int64_t steps_done = 0;
  for (int step = 0; step < 12; ++step) {
    work.expected_value = steps_done;
    const bool fail = step % 4 == 3;
    const int64_t at = static_cast<int64_t>(random() % batches);
    work.fail_update_at = fail && step % 8 == 3 ? at : -1;
    work.interrupt_before = fail && step % 8 == 7 && at > 0 ? at : -1;
    bool threw = false;
    try {
      rt::run_pipeline(transport, work, slot_of_batch);
      transport.host_wait(rt::kStepEndMarker);
    } catch (const Injected&) {
      threw = true;
    }
    const int64_t stop = work.fail_update_at >= 0 ? work.fail_update_at : work.interrupt_before;
    expect(threw == (stop >= 0), "a failure was injected exactly when one was thrown");
    // Batches before the failure are new, the rest old; each wholly.
    for (int b = 0; b < batches; ++b) {
      const float want = static_cast<float>(threw && b >= stop ? steps_done : steps_done + 1);
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
      for (int b = static_cast<int>(stop); b < batches; ++b)
        for (float& value : host[b]) value += 1.0f;
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

}  // namespace

int main() {
  check_partition();
  uint64_t seed = 1;
  for (int arenas : {2, 3, 4}) {
    for (int batches : {1, 2, 3, 5, 9}) run_case(arenas, batches, seed++);
  }
  if (failures) {
    std::fprintf(stderr, "%d failure(s)\n", failures);
    return 1;
  }
  std::printf("pipeline_stress: 15 pipeline cases x 12 steps and 300 partitions passed\n");
  return 0;
}
