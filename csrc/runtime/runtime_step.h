// The work of one SwapRuntime step, as the pipeline drives it (runtime_step.cpp):
// per batch position the copies in and out, the update (the fused Adam op, or
// another optimizer's rule), the grads and AMP scalars the step holds, and its
// progress, from which a failed step's torn params are told. Private to the
// runtime's sources (swap_runtime.cpp, runtime_step.cpp, deferred_step.cpp).
#pragma once

#include "swap_runtime.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

namespace swap_optimizer::runtime {

class SwapRuntime::Step final : public BatchWork {
 public:
  // Holds what the update reads (grads[i] undefined: param i has none), so a
  // deferred step outlives the caller's references.
  Step(SwapRuntime& runtime, std::vector<at::Tensor> grads, std::vector<PackedUpdateArgs> group_args,
       std::optional<at::Tensor> grad_scale, std::optional<at::Tensor> found_inf,
       std::function<void()> check_interrupt, bool deferred);

  std::exception_ptr failure;  // what stopped a deferred step on the update thread

  const std::optional<at::Tensor>& found_inf() const { return found_inf_; }
  // The position whose update rule (not the fused op) was running when the step failed, or -1.
  int64_t failed_rule_position() const { return inside_rule_; }

  // Bytes of the grads this step holds.
  int64_t grad_bytes() const;

  // Drops the grads of the params whose last batch is at a position up to
  // `position`, and at the last position the AMP snapshots; returns the grad
  // bytes dropped. Only for what the update has finished reading: on the host
  // the update thread is still running later positions, which read other
  // elements of grads_ (and has_grad_, never changed, for the row checks).
  int64_t release_through(int64_t position);
  int64_t released_through() const { return released_through_; }

  void stage_in_step_table() override;
  void stage_out_step_table() override;

  // The pipeline calls these by position; runtime_.order_ gives the layout's batch.
  void stage_in(int64_t position, int slot) override;
  void stage_out(int64_t position, int slot) override;

  // Interrupts are taken only where no param is cut, so an interrupted step
  // leaves every param wholly old or wholly new.
  void between_batches(int64_t next_position) override;

  void update(int64_t position, int slot) override;

  // Whether the update of `row` of layout batch `batch` has run (its param has a grad and its op call returned).
  bool row_updated(int64_t batch, int64_t row) const;

  // Timeline stamps: 0 is the step's start, then per position the start and
  // end of its copies in, update and copies out.
  static constexpr int kCopyInStamp = 0, kUpdateStamp = 2, kCopyOutStamp = 4, kStampsPerBatch = 6;
  static int stamp_index(int64_t position, int lane) {
    return static_cast<int>(1 + kStampsPerBatch * position + lane);
  }

 private:
  void inject(FaultPoint point, int64_t position, const char* what) const;

  void* host_at(const RegionCopy& copy) const;

  // One op call per run of consecutive rows of one group that have grads;
  // another optimizer's rule: one call for the batch.
  void update_rows(int64_t position, int64_t batch, const at::Tensor& arena);

  void call_op(const BatchLayout& batch_layout, int64_t begin, int64_t end, const at::Tensor& arena,
               const at::Tensor& layout, const PackedUpdateArgs& args);

  SwapRuntime& runtime_;
  std::vector<at::Tensor> grads_;
  std::vector<bool> has_grad_;  // grads_[i] was given; fixed, unlike grads_, which release_through empties
  int64_t released_through_ = -1;  // positions whose grads are dropped
  std::vector<PackedUpdateArgs> group_args_;
  std::optional<at::Tensor> grad_scale_;
  std::optional<at::Tensor> found_inf_;
  std::function<void()> check_interrupt_;
  bool deferred_;
  std::pair<int64_t, int64_t> progress_{0, 0};  // (position, rows of it) whose updates have run
  int64_t inside_rule_ = -1;  // the position whose update rule threw, if one did
};

}  // namespace swap_optimizer::runtime
