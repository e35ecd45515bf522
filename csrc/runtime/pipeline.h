// The packed swap pipeline: the order in which batches are copied in, updated
// and copied out through a few rotating staging arenas, written once for every
// backend. Plain C++ (no torch).
#pragma once

#include <cstdint>
#include <vector>

namespace swap_optimizer::runtime {

// Ordered work queues: CUDA streams, or on the host backend the calling thread
// (compute) and worker threads (copies). The two copy queues may be one queue.
// kCaller is the queue current where the runtime is called (the model's
// stream); it differs from kCompute only inside a deferred step, whose compute
// queue is the transport's own update queue.
enum class Queue : int { kCompute = 0, kHostToDevice = 1, kDeviceToHost = 2, kCaller = 3 };

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

  // Deferred steps (overlap with the next forward). Between enter and leave,
  // kCompute is the transport's own update queue, which first waits for the
  // work enqueued on the caller's queue so far. On CUDA that is a stream of
  // its own, made current so that kernels launch on it; on the host backend
  // the runtime runs the whole pipeline on its update thread, which is then
  // the compute queue (inline), so these two only mark the step.
  virtual void enter_update_queue() = 0;
  virtual void leave_update_queue() noexcept = 0;
  // Readiness of a deferred step's batches, by pipeline position: open_ready
  // starts a step with none ready, mark_ready(p) follows p's update on the
  // compute queue, wait_ready(p) makes the caller's queue wait for it (CUDA: a
  // stream wait; host: blocks) and returns whether the step stopped before
  // reaching it (host: release_ready came first, after a failure; CUDA:
  // always false, as its failures show when enqueued).
  virtual void open_ready(int64_t positions) = 0;
  virtual void mark_ready(int64_t position) = 0;
  virtual bool wait_ready(int64_t position) = 0;
  virtual void release_ready() noexcept = 0;
  // Whether position p's update has run, without waiting (CUDA: an event
  // query, no host sync); the host backend's is also true once the step has
  // stopped short of it.
  virtual bool ready_now(int64_t position) = 0;
  // Makes the queue the deferred step was enqueued from (its grads and AMP
  // snapshots were made there) wait for position p's update, so that tensors
  // made there and read by the updates up to p can be freed now: the caching
  // allocator then reuses them in that queue's order, after the updates. CUDA:
  // a stream wait, skipped where that stream already waited for p or later;
  // host: nothing (the caller blocked in wait_ready until p's update ran).
  virtual void order_release(int64_t position) = 0;

  // Timeline stamps (the benchmark's plot): enable_stamps(n) keeps n of them
  // (0: off), stamp(queue, i) notes when `queue` reaches that point, and
  // stamp_seconds() gives each one's seconds after stamp 0 once all have run
  // (NaN for one never stamped).
  virtual void enable_stamps(int count) = 0;
  virtual void stamp(Queue queue, int index) = 0;
  virtual std::vector<double> stamp_seconds() = 0;
  // Test hooks, to expose missing waits; 0 turns each off. Copy delay: each
  // copy first waits a random 0..max_microseconds on its queue. Compute delay:
  // delay_compute() makes the compute queue wait a random 0..max_microseconds
  // (called before each batch's update), so a copy out or a caller that does
  // not wait for the update reads the old state.
  virtual void set_copy_delay(int64_t max_microseconds, uint64_t seed) = 0;
  virtual void set_compute_delay(int64_t max_microseconds, uint64_t seed) = 0;
  virtual void delay_compute() = 0;
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
