// The packed swap pipeline: the order in which batches are copied in, updated
// and copied out through a few rotating staging arenas, written once for every
// backend. Plain C++ (no torch).
#pragma once

#include <cstdint>
#include <vector>

namespace swap_optimizer::runtime {

// Ordered work queues: CUDA streams, or on the host backend the calling thread
// (compute) and worker threads (copies). The two copy queues may be one queue.
enum class Queue : int { kCompute = 0, kHostToDevice = 1, kDeviceToHost = 2 };

// Completion markers: CUDA events, or completion counts of the worker queues.
// Five for the step itself, then three for each arena slot.
enum class Marker : int { kStaged = 0, kUpdated = 1, kUnstaged = 2 };
constexpr int kStepBeginMarker = 0;
constexpr int kStepEndMarker = 1;
constexpr int kUpdatesDoneMarker = 2;     // compute: every update of the step enqueued
constexpr int kStepTableInMarker = 3;     // copy in: the step table is on the device
constexpr int kStepTableOutMarker = 4;    // copy out: the step table is back on the host
constexpr int kStepMarkers = 5;
constexpr int marker_count(int slots) { return kStepMarkers + 3 * slots; }
constexpr int slot_marker(Marker marker, int slot) { return kStepMarkers + 3 * slot + static_cast<int>(marker); }

// `rows` rows of `width` bytes, `dst_pitch` and `src_pitch` bytes apart; one row
// is a plain contiguous copy.
struct StridedCopy {
  void* dst;
  int64_t dst_pitch;
  const void* src;
  int64_t src_pitch;
  int64_t width;
  int64_t rows;
};

// What a backend provides. wait(queue, marker) makes `queue` wait for the work
// that preceded the most recent record(…, marker); it does not block the host
// unless `queue` is the compute queue of a backend whose compute runs inline.
class Transport {
 public:
  virtual ~Transport() = default;
  virtual void begin_step() = 0;
  virtual void copy_to_device(const StridedCopy& copy) = 0;  // on kHostToDevice
  virtual void copy_to_host(const StridedCopy& copy) = 0;    // on kDeviceToHost
  virtual void record(Queue queue, int marker) = 0;
  virtual void wait(Queue queue, int marker) = 0;
  virtual void host_wait(int marker) = 0;  // blocks the calling thread
  virtual void drain() noexcept = 0;       // blocks until everything enqueued has run
  // Test hook: each copy first waits a random 0..max_microseconds on its queue,
  // to expose missing waits. 0 turns it off.
  virtual void set_copy_delay(int64_t max_microseconds, uint64_t seed) = 0;
};

// The per-batch work of one step, supplied by the runtime.
class BatchWork {
 public:
  virtual ~BatchWork() = default;
  virtual void stage_in_step_table() = 0;               // enqueue the step counts' copy in
  virtual void stage_out_step_table() = 0;              // enqueue their copy back to the host
  virtual void stage_in(int64_t batch, int slot) = 0;   // enqueue the batch's copies in
  virtual void update(int64_t batch, int slot) = 0;     // enqueue the fused update on compute
  virtual void stage_out(int64_t batch, int slot) = 0;  // enqueue the copies back to the host
  virtual void between_batches(int64_t next_batch) = 0; // may throw to stop the step (interrupt)
};

// Enqueues the step table's copy back to the host after every update enqueued
// so far (and after the table's own copy in).
void stage_out_step_table(Transport& transport, BatchWork& work);

// Runs one step over batches 0..n-1, batch b in arena slot slot_of_batch[b].
// The step table (every param's step count) is copied in before the first batch
// and out after the last update. A slot is reused only after the copy out of its
// previous batch has finished; staging runs ahead as far as free slots allow. At
// the end the compute queue waits for every copy out, so arenas and the device
// step table can be released in stream order.
//
// If anything throws, the batch being updated is copied out, then the step
// table (when it was copied in), the transport is drained (the host store then
// holds, element by element, each state old or new together with its param)
// and the exception is rethrown.
void run_pipeline(Transport& transport, BatchWork& work, const std::vector<int>& slot_of_batch);

}  // namespace swap_optimizer::runtime
