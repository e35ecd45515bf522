// The swap runtime of one SwapOptimizer: the host store (exact-size slabs, pinned
// on CUDA), the resident store, the staging arenas and the transport, and the
// step that runs the packed pipeline over them, each batch updated by the fused
// Adam op or by a given per-batch update (a Python rule: torch's own update).
#pragma once

#include "../kernels/packed_layout.h"
#include "adam_slots.h"
#include "host_transport.h"
#include "pipeline.h"
#include "runtime_options.h"
#include "store_layout.h"

#include <ATen/core/Tensor.h>

#include <atomic>
#include <exception>
#include <functional>
#include <thread>
#include <tuple>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace swap_optimizer::runtime {

struct MemoryStats {
  int64_t host_state_bytes = 0;
  bool pinned = false;
  int64_t staging_bytes = 0;       // arenas and the device step table in use now (a deferred step's: until waited for)
  int64_t peak_staging_bytes = 0;
  int64_t step_table_bytes = 0;    // of the staging: the device step table
  int64_t resident_state_bytes = 0;
  int64_t h2d_bytes = 0;  // of the last step
  int64_t d2h_bytes = 0;
  int64_t batches = 0;    // batches through the staging arenas
  int64_t num_arenas = 0; // arenas a step allocates
  int64_t split_params = 0;  // params whose elements are spread over several batches
  int64_t unpinned_host_bytes = 0;  // host store bytes that could not be pinned
  int64_t swapped_elements = 0;     // elements of the params whose states go through staging
  int64_t held_grad_bytes = 0;      // grads a deferred step still holds (numel * element size of each)
};

// Test hooks: random delays before each copy and before each batch's update
// (both backends), and one injected failure.
// kUpdateLastCall fails before the last op call of the batch, after the others ran.
enum class FaultPoint { kNone, kStageIn, kUpdate, kUpdateLastCall, kInterrupt };
struct TestHooks {
  int64_t copy_delay_us = 0;
  uint64_t seed = 0;  // of both delays
  FaultPoint fault = FaultPoint::kNone;
  int64_t fault_batch = -1;  // index in pipeline order (the resident batch, if any, is 0)
  // >= 0: allocate arenas as if the device had this many bytes free.
  int64_t simulated_free_bytes = -1;
  int64_t compute_delay_us = 0;  // the compute queue waits up to this long before each update
};

// One row's kept states in its batch's arena: (store key, view) per key the
// row keeps, in key order; a whole param's views have its states' shapes, a
// piece's are flat (count elements, or its blocks for a per-block key).
using RowViews = std::vector<std::pair<std::string, at::Tensor>>;

// A batch's update by a rule other than the fused Adam op (torch's own update
// of another optimizer): called once per batch with the compute queue current,
// under no_grad, with the batch's index in the layout, its arena (every kept
// state of its rows at the rows' arena offsets) and, per row, the param, its
// grad (undefined: none this step) and its views in the arena (built here in
// one pass: on a GPU the update of a batch takes microseconds, so the host's
// per-row work bounds the step). It may throw to fail the batch.
using BatchUpdate = std::function<void(int64_t batch, const at::Tensor& arena, const std::vector<at::Tensor>& params,
                                       const std::vector<at::Tensor>& grads, const std::vector<RowViews>& views)>;

// Device bytes a step allocates for staging: min(num_arenas, batches) arenas of
// the largest batch, and the device step table.
int64_t staging_bytes_of(const StoreLayout& layout, int64_t num_arenas);

// The smallest swap_times whose staging (staging_bytes_of) fits in budget_bytes,
// or -1 when none does; then *smallest_possible_bytes says what the finest
// split needs.
int64_t smallest_swap_times_for_budget(const std::vector<SlotSpec>& specs, const KeyFlags& swap_keys,
                                       int64_t step_bytes, int64_t num_arenas, int64_t budget_bytes,
                                       int64_t* smallest_possible_bytes);

class SwapRuntime {
 public:
  // params: every param in optimizer order; group_of_param: its param group;
  // group_amsgrad: whether each group keeps max_exp_avg_sq; swappable: whether
  // each param's states go through the host store (else they stay resident).
  SwapRuntime(std::vector<at::Tensor> params, std::vector<int64_t> group_of_param,
              const std::vector<bool>& group_amsgrad, const std::vector<bool>& swappable,
              const RuntimeOptions& options);
  // Another optimizer's states: specs[i] and descriptions[i][key] say how
  // param i keeps each key (options.swap_keys has one flag per key), and
  // `update` runs each batch's update. No step table: the update keeps the
  // per-param scalars. Of the options, the layout and staging ones apply.
  SwapRuntime(std::vector<at::Tensor> params, std::vector<SlotSpec> specs,
              std::vector<std::vector<StateDescription>> descriptions, BatchUpdate update,
              const RuntimeOptions& options);
  ~SwapRuntime();
  SwapRuntime(const SwapRuntime&) = delete;
  SwapRuntime& operator=(const SwapRuntime&) = delete;

  // Views of one param's state in the stores, named by their descriptions;
  // Adam's: "step" (0-dim float32, host), "exp_avg", "exp_avg_sq",
  // "max_exp_avg_sq", "master_param"; 8-bit moments as "<name>_codes" (uint8,
  // the param's shape) and "<name>_absmax" (float32, one per block);
  // "compensation" (Kahan). Swapped states are host tensors, resident ones
  // device tensors.
  std::vector<std::pair<std::string, at::Tensor>> state_views(int64_t param) const;

  // One optimizer step. params are the params now (the same dtypes, shapes and
  // device as at construction; a framework may have swapped the tensor objects);
  // grads[i] is param i's grad or none (skipped, as torch skips it);
  // group_args[g] are group g's hyper-parameters this step. check_interrupt
  // runs between batches that do not cut a param, and may throw to stop the
  // step. A failure that leaves a split param partly updated marks it torn;
  // step() then refuses until clear_torn() (a loaded checkpoint).
  //
  // deferred: enqueue the whole step and return (overlap with the next
  // forward). The updates run on the update queue: a CUDA stream of the
  // transport's, or on the host backend this runtime's update thread, which
  // runs the pipeline with the caller's thread-local state. The step holds
  // the grads it reads and snapshots of the AMP scalars (made on the caller's
  // queue) until a wait covers their last reader: wait_ready(p) drops the grads
  // of every param whose last batch is at position p or before (the snapshots
  // at the last position), wait_step the rest, each in the caller's queue order
  // (Transport::order_release), so no record_stream is needed. On CUDA the
  // arenas and the step table are allocated on the update stream and freed in
  // its order once enqueued. The caller must wait before it reads a param
  // (wait_ready, wait_step) or touches a grad in place. check_interrupt is not
  // run: an interrupt lets the step complete. A failure shows on CUDA at once
  // (enqueueing fails), on the host at the next wait_ready / wait_step or other
  // call that needs the step done.
  void step(const std::vector<at::Tensor>& params, const std::vector<std::optional<at::Tensor>>& grads,
            const std::vector<PackedUpdateArgs>& group_args,
            const std::optional<at::Tensor>& grad_scale,
            const std::optional<at::Tensor>& found_inf,
            const std::function<void()>& check_interrupt, bool deferred = false);

  // The caller's queue waits for the batch at pipeline `position` of a
  // deferred step (CUDA: a stream wait, no host sync; host: blocks), or for
  // the whole step, and the step lets go of the grads it has read for good.
  // Either raises what stopped the step, once. On the thread inside a whole
  // step (a signal handler run by check_interrupt) there is no deferred step:
  // they and has_deferred_step() return at once. Once the step is finished
  // (another stream waited), CUDA waits for its end instead; the host backend
  // has nothing left to wait for.
  void wait_ready(int64_t position);
  void wait_step();
  bool has_deferred_step() const;  // a deferred step not yet waited for
  // Whether every batch of the deferred step (true: none) has been updated,
  // without waiting (CUDA: an event query, no host sync; false while another
  // thread holds the step lock): overlap_forward's watch then has nothing
  // left to guard and ends its pass.
  bool deferred_step_updated();

  // Whether the caller is this runtime's update thread (host backend), which
  // runs a deferred step's Python update rule: Python code there (a garbage
  // collection, say) must neither wait for that step (the waits above return
  // at once there) nor destroy the runtime in the middle of it.
  bool on_update_thread() const { return update_thread_id_.load() == std::this_thread::get_id(); }

  // Runs the batches in the order of their params' ranks (a chain of batches
  // that cut a param moves as one, by its least rank; ties keep layout order).
  // The host slabs stay where they are. pipeline_order()[p]: the layout's index
  // of the batch at position p.
  void set_batch_order(const std::vector<int64_t>& rank_of_param);
  std::vector<int64_t> pipeline_order() const;

  // Benchmark timeline: when on, each step notes when each batch's copies in,
  // update and copies out start and end. timeline(): (lane, position, start,
  // end) in seconds after the last step() began, once it has finished.
  void enable_timeline(bool enabled);
  std::vector<std::tuple<std::string, int64_t, double, double>> timeline();

  // Blocks until the host store holds the last step's results. Called on the
  // thread that is inside step() (a signal handler run by check_interrupt,
  // which runs only where no param is cut), it instead drains the queues and
  // copies the step table out, so the store holds each param wholly old or
  // wholly new, and returns without waiting for the step's lock.
  void synchronize();

  // Orders writes made to the stores on the current stream (the resident
  // states written at construction or by load_state_dict) before the next
  // step, whatever stream that step runs on.
  void order_writes();

  // Params (indices) left partly updated by a failed step, and forgetting them
  // once their state has been rewritten.
  std::vector<int64_t> torn_params() const;
  void clear_torn();

  // Reseeds stochastic rounding (a loaded checkpoint's seed), between steps.
  void set_rounding_seed(int64_t seed);

  MemoryStats memory_stats() const;
  const StoreLayout& layout() const { return layout_; }
  void set_test_hooks(const TestHooks& hooks);

 private:
  class Step;
  friend class Step;

  void set_up();  // what both constructors share, once the specs are known

  void allocate_arenas();
  void release_arenas();
  void adopt_order(std::vector<int64_t> order);
  void finish_deferred();
  void release_deferred_through(int64_t position);
  [[noreturn]] void rethrow_failure(const Step& work, std::exception_ptr failure);
  void enqueue_deferred(const std::shared_ptr<Step>& work);
  at::Tensor arena_for(int64_t batch, int slot) const;
  // Per row of `batch` with a grad (has_grad), its views in `arena` (RowViews);
  // rows without a grad get none.
  std::vector<RowViews> arena_views(int64_t batch, const at::Tensor& arena, const std::vector<bool>& has_grad) const;
  at::Tensor state_view(int64_t param, int key) const;
  int64_t global_offset(int64_t param) const;
  std::string tear_report(const Step& work, const std::optional<at::Tensor>& found_inf);

  std::vector<at::Tensor> params_;
  std::vector<int64_t> group_of_param_;
  std::vector<bool> group_amsgrad_;
  std::vector<c10::ScalarType> param_dtype_;
  std::vector<std::vector<int64_t>> param_shape_;
  c10::Device device_;
  RuntimeOptions options_;
  std::vector<SlotSpec> specs_;
  std::vector<std::vector<StateDescription>> descriptions_;  // per param, per key
  int64_t step_bytes_ = kAdamStepBytes;  // per param in the step table
  BatchUpdate batch_update_;           // set: it updates each batch, not the fused Adam op
  StoreLayout layout_;
  std::vector<at::Tensor> op_layout_tables_;  // fused Adam op: per batch, the op's layout table, rows in batch order
  std::vector<at::Tensor> host_slabs_; // per host region of the layout, exact size
  at::Tensor resident_store_;
  std::vector<at::Tensor> arenas_;
  at::Tensor device_steps_;            // the step table on the device, during a step
  std::vector<int64_t> torn_;          // params a failed step left partly updated
  std::atomic<std::thread::id> stepping_thread_{};  // the thread inside step(), if any
  Step* current_step_ = nullptr;                     // its work, for synchronize() from that thread
  int arena_count_ = 0;
  std::vector<int64_t> order_;        // layout batch at each pipeline position
  std::vector<int64_t> position_of_;  // pipeline position of each layout batch
  std::vector<int> slot_of_batch_;    // arena slot of each pipeline position
  std::vector<std::vector<int64_t>> last_read_at_;  // per position: the params whose last batch it is
  std::unique_ptr<Transport> transport_;
  // Host backend: the thread of the deferred step in flight, one per step, joined when the step is
  // finished (or the runtime destroyed). It ends with its step, and so does the OpenMP team its
  // update's ops made: while more threads than CPUs live, libgomp cuts every team's spin-wait short,
  // and each parallel op anywhere in the process then sleeps and wakes its workers (a kept thread
  // made every later forward on a 2-core machine about 4.5x slower).
  std::thread update_thread_;
  std::atomic<std::thread::id> update_thread_id_{};  // its id while its step runs, readable without the lock
  std::shared_ptr<Step> deferred_;                   // the deferred step not yet finished, if any
  std::atomic<int64_t> held_grad_bytes_{0};     // grads it still holds (read by memory_stats without the lock)
  bool timeline_ = false;
  bool pinned_ = false;
  int64_t unpinned_bytes_ = 0;
  bool step_pending_ = false;  // copies of the last step may still be landing in the host store
  // step() and synchronize() run without the GIL: a thread reading the state
  // while another steps must wait for that step, not for the one before.
  mutable std::mutex step_mutex_;
  MemoryStats stats_;
  TestHooks hooks_;
};

}  // namespace swap_optimizer::runtime
