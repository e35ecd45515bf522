// The work of one step (runtime_step.h) and SwapRuntime::step(), which checks
// its arguments and runs it, whole or deferred; after a failure, the params it
// left partly updated.
#include "runtime_step.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <csignal>
#include <sstream>

namespace swap_optimizer::runtime {
namespace {

using FusedAdamPackedFn =
    void(at::TensorList, at::TensorList, const at::Tensor&, const at::Tensor&, const at::Tensor&,
         double, double, double, double, double, bool, bool, bool, std::optional<c10::ScalarType>,
         const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, std::optional<int64_t>);

const c10::TypedOperatorHandle<FusedAdamPackedFn>& fused_adam_packed_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("swap_optimizer::fused_adam_packed", "")
                             .typed<FusedAdamPackedFn>();
  return op;
}

}  // namespace

SwapRuntime::Step::Step(SwapRuntime& runtime, std::vector<at::Tensor> grads,
                        std::vector<PackedUpdateArgs> group_args, std::optional<at::Tensor> grad_scale,
                        std::optional<at::Tensor> found_inf, std::function<void()> check_interrupt,
                        bool deferred)
    : runtime_(runtime), grads_(std::move(grads)), group_args_(std::move(group_args)),
      grad_scale_(std::move(grad_scale)), found_inf_(std::move(found_inf)),
      check_interrupt_(std::move(check_interrupt)), deferred_(deferred) {
  has_grad_.reserve(grads_.size());
  for (const at::Tensor& grad : grads_) has_grad_.push_back(grad.defined());
}

int64_t SwapRuntime::Step::grad_bytes() const {
  int64_t bytes = 0;
  for (const at::Tensor& grad : grads_) bytes += grad.defined() ? grad.numel() * grad.element_size() : 0;
  return bytes;
}

int64_t SwapRuntime::Step::release_through(int64_t position) {
  int64_t bytes = 0;
  for (; released_through_ < position; ++released_through_) {
    for (const int64_t slot : runtime_.last_read_at_[released_through_ + 1]) {
      at::Tensor& grad = grads_[slot];
      if (!grad.defined()) continue;
      bytes += grad.numel() * grad.element_size();
      grad = at::Tensor();
    }
  }
  if (position + 1 == static_cast<int64_t>(runtime_.order_.size())) {
    grad_scale_.reset();
    found_inf_.reset();
  }
  return bytes;
}

void SwapRuntime::Step::stage_in_step_table() {
  const int64_t bytes = runtime_.layout_.host_region_bytes[kStepTableRegion];
  if (bytes == 0) return;
  runtime_.transport_->copy_to_device({runtime_.device_steps_.data_ptr(), bytes,
                                       runtime_.host_slabs_[kStepTableRegion].data_ptr(), bytes, bytes, 1});
}

void SwapRuntime::Step::stage_out_step_table() {
  const int64_t bytes = runtime_.layout_.host_region_bytes[kStepTableRegion];
  if (bytes == 0) return;
  runtime_.transport_->copy_to_host({runtime_.host_slabs_[kStepTableRegion].data_ptr(), bytes,
                                     runtime_.device_steps_.data_ptr(), bytes, bytes, 1});
}

void SwapRuntime::Step::stage_in(int64_t position, int slot) {
  inject(FaultPoint::kStageIn, position, "copy in");
  const int64_t batch = runtime_.order_[position];
  Transport& transport = *runtime_.transport_;
  transport.stamp(Queue::kHostToDevice, stamp_index(position, kCopyInStamp));
  auto* arena = static_cast<uint8_t*>(runtime_.arena_for(batch, slot).data_ptr());
  for (const RegionCopy& copy : runtime_.layout_.batches[batch].host_copies) {
    transport.copy_to_device({arena + copy.arena_offset, copy.arena_pitch, host_at(copy), copy.pitch,
                              copy.width, copy.rows});
  }
  transport.stamp(Queue::kHostToDevice, stamp_index(position, kCopyInStamp) + 1);
}

void SwapRuntime::Step::stage_out(int64_t position, int slot) {
  const int64_t batch = runtime_.order_[position];
  Transport& transport = *runtime_.transport_;
  transport.stamp(Queue::kDeviceToHost, stamp_index(position, kCopyOutStamp));
  const auto* arena = static_cast<const uint8_t*>(runtime_.arena_for(batch, slot).data_ptr());
  for (const RegionCopy& copy : runtime_.layout_.batches[batch].host_copies) {
    transport.copy_to_host({host_at(copy), copy.pitch, arena + copy.arena_offset, copy.arena_pitch,
                            copy.width, copy.rows});
  }
  transport.stamp(Queue::kDeviceToHost, stamp_index(position, kCopyOutStamp) + 1);
}

void SwapRuntime::Step::between_batches(int64_t next_position) {
  if (runtime_.hooks_.fault == FaultPoint::kInterrupt && runtime_.hooks_.fault_batch == next_position) {
    // Delivered to Python by check_interrupt, like a real Ctrl-C; in a
    // deferred step (which has none) Python raises it on the main thread.
    std::raise(SIGINT);
  }
  const int64_t batch = runtime_.order_[next_position];
  const bool cuts_a_param = runtime_.layout_.batches[batch].rows.front().element_offset > 0;
  if (check_interrupt_ && !cuts_a_param) check_interrupt_();
}

void SwapRuntime::Step::update(int64_t position, int slot) {
  progress_ = {position, 0};
  inject(FaultPoint::kUpdate, position, "update");
  Transport& transport = *runtime_.transport_;
  transport.delay_compute();  // test hook
  transport.stamp(Queue::kCompute, stamp_index(position, kUpdateStamp));
  const int64_t batch = runtime_.order_[position];
  const BatchLayout& batch_layout = runtime_.layout_.batches[batch];
  const at::Tensor arena = runtime_.arena_for(batch, slot);
  // States kept on the device join the arena for the update and go back after it.
  // Row by row: each a contiguous copy (a strided uint8 copy_ would run
  // TensorIterator's elementwise kernel instead of a memcpy).
  auto join = [&](bool into_arena) {
    for (const RegionCopy& copy : batch_layout.resident_copies) {
      for (int64_t r = 0; r < copy.rows; ++r) {
        at::Tensor in_arena = arena.narrow(0, copy.arena_offset + r * copy.arena_pitch, copy.width);
        at::Tensor home = runtime_.resident_store_.narrow(0, copy.offset + r * copy.pitch, copy.width);
        if (into_arena) in_arena.copy_(home); else home.copy_(in_arena);
      }
    }
  };
  join(true);
  try {
    update_rows(position, batch, arena);
  } catch (...) {
    join(false);
    throw;
  }
  join(false);
  if (deferred_) transport.mark_ready(position);
  transport.stamp(Queue::kCompute, stamp_index(position, kUpdateStamp) + 1);
  progress_ = {position + 1, 0};
}

bool SwapRuntime::Step::row_updated(int64_t batch, int64_t row) const {
  if (!has_grad_[runtime_.layout_.batches[batch].rows[row].slot]) return false;
  const int64_t position = runtime_.position_of_[batch];
  return position < progress_.first || (position == progress_.first && row < progress_.second);
}

void SwapRuntime::Step::inject(FaultPoint point, int64_t position, const char* what) const {
  const TestHooks& hooks = runtime_.hooks_;
  TORCH_CHECK(!(hooks.fault == point && hooks.fault_batch == position),
              "SwapOptimizer: injected test fault at the ", what, " of batch ", position);
}

void* SwapRuntime::Step::host_at(const RegionCopy& copy) const {
  return static_cast<uint8_t*>(runtime_.host_slabs_[copy.region].data_ptr()) + copy.offset;
}

void SwapRuntime::Step::update_rows(int64_t position, int64_t batch, const at::Tensor& arena) {
  const BatchLayout& batch_layout = runtime_.layout_.batches[batch];
  const int64_t count = static_cast<int64_t>(batch_layout.rows.size());
  if (runtime_.batch_update_) {
    inject(FaultPoint::kUpdateLastCall, position, "last op call");
    // As for the fused op: the update bumps no param's version counter.
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    std::vector<at::Tensor> params, grads;
    for (const PieceRow& row : batch_layout.rows) {
      params.push_back(runtime_.params_[row.slot]);
      grads.push_back(grads_[row.slot]);
    }
    // Not atomic like the fused op: if it throws, any of its rows may be
    // partly written (tear_report then marks them all torn).
    const std::vector<RowViews> views = runtime_.arena_views(batch, arena, has_grad_);
    inside_rule_ = position;
    runtime_.batch_update_(batch, arena, params, grads, views);
    inside_rule_ = -1;
    progress_.second = count;
    return;
  }
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (int64_t begin = 0; begin < count;) {
    const int64_t first = batch_layout.rows[begin].slot;
    int64_t end = begin + 1;
    if (has_grad_[first]) {
      while (end < count && has_grad_[batch_layout.rows[end].slot] &&
             runtime_.group_of_param_[batch_layout.rows[end].slot] == runtime_.group_of_param_[first]) {
        ++end;
      }
      runs.emplace_back(begin, end);
    }
    begin = end;
  }
  const at::Tensor& layout = runtime_.op_layout_tables_[batch];
  for (size_t r = 0; r < runs.size(); ++r) {
    const auto [begin, end] = runs[r];
    if (r + 1 == runs.size()) inject(FaultPoint::kUpdateLastCall, position, "last op call");
    call_op(batch_layout, begin, end, arena, layout.narrow(0, begin, end - begin),
            group_args_[runtime_.group_of_param_[batch_layout.rows[begin].slot]]);
    progress_.second = end;
  }
}

void SwapRuntime::Step::call_op(const BatchLayout& batch_layout, int64_t begin, int64_t end, const at::Tensor& arena,
                                const at::Tensor& layout, const PackedUpdateArgs& args) {
  // Below autograd and ADInplaceOrView: the step bumps no param's version
  // counter (the op never did; the write-back of a strided param would), so
  // the Python layer can take any bump for a write made outside step(),
  // also while a deferred step runs.
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  std::vector<at::Tensor> params, grads;
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back;  // (param, contiguous copy)
  for (int64_t k = begin; k < end; ++k) {
    const int64_t slot = batch_layout.rows[k].slot;
    const at::Tensor& param = runtime_.params_[slot];
    if (param.is_contiguous()) {
      params.push_back(param);
    } else {
      // Only resident params can be strided: update a contiguous copy.
      params.push_back(param.contiguous());
      write_back.emplace_back(param, params.back());
    }
    // A strided grad: a contiguous copy on the compute queue, freed in its
    // order after the op (no record_stream, nothing held past this call).
    grads.push_back(grads_[slot].contiguous());
  }
  fused_adam_packed_op().call(params, grads, arena, layout, runtime_.device_steps_, args.lr, args.beta1,
                              args.beta2, args.eps, args.weight_decay, args.amsgrad, args.maximize,
                              args.decoupled_weight_decay, runtime_.options_.state_dtype, grad_scale_, found_inf_,
                              runtime_.options_.rounding_seed);
  for (auto& [param, updated] : write_back) param.copy_(updated);
}

// After a failed step: the split params whose first piece was updated but not
// their last. Their updated elements are new with their states, the others old
// with theirs; the step count is old. Returns what to tell the user, or "".
std::string SwapRuntime::tear_report(const Step& work, const std::optional<at::Tensor>& found_inf) {
  try {
    // The queues are drained, so reading found_inf waits for nothing.
    if (found_inf.has_value() && found_inf->item<float>() != 0.f) return "";  // the step wrote nothing
  } catch (const c10::Error&) {
    // The device cannot say: assume the updates ran.
  }
  auto row_of = [&](int64_t batch, int64_t slot) {
    const std::vector<PieceRow>& rows = layout_.batches[batch].rows;
    for (size_t r = 0; r < rows.size(); ++r) {
      if (rows[r].slot == slot) return static_cast<int64_t>(r);
    }
    return int64_t{-1};
  };
  std::string report;
  if (work.failed_rule_position() >= 0) {
    // An update rule that threw may have written any of its rows in part.
    for (const PieceRow& row : layout_.batches[order_[work.failed_rule_position()]].rows) {
      if (std::find(torn_.begin(), torn_.end(), row.slot) != torn_.end()) continue;
      torn_.push_back(row.slot);
      std::ostringstream line;
      line << "SwapOptimizer: param " << row.slot << " (shape " << c10::IntArrayRef(param_shape_[row.slot])
           << ") may be partly updated: the optimizer's own step failed while it updated the batch holding it. "
              "step() now refuses to run until you load_state_dict a checkpoint.\n";
      report += line.str();
    }
  }
  for (int64_t i = 0; i < static_cast<int64_t>(layout_.slots.size()); ++i) {
    const SlotPlacement& slot = layout_.slots[i];
    if (std::find(torn_.begin(), torn_.end(), i) != torn_.end()) continue;
    if (!slot.split || !work.row_updated(slot.first_batch, row_of(slot.first_batch, i)) ||
        work.row_updated(slot.last_batch, row_of(slot.last_batch, i))) {
      continue;
    }
    torn_.push_back(i);
    std::ostringstream line;
    line << "SwapOptimizer: param " << i << " (shape " << c10::IntArrayRef(param_shape_[i])
         << ") was partly updated when the step failed: the elements of its pieces that were updated are new "
            "together with their states, the others old with theirs, and its step count is old. step() now "
            "refuses to run until you load_state_dict a checkpoint, so no piece is stepped twice.\n";
    report += line.str();
  }
  return report;
}

void SwapRuntime::step(const std::vector<at::Tensor>& params, const std::vector<std::optional<at::Tensor>>& grads,
                       const std::vector<PackedUpdateArgs>& group_args,
                       const std::optional<at::Tensor>& grad_scale,
                       const std::optional<at::Tensor>& found_inf,
                       const std::function<void()>& check_interrupt, bool deferred) {
  const std::lock_guard<std::mutex> lock(step_mutex_);
  finish_deferred();  // raises what stopped the last deferred step, if no wait did
  if (!torn_.empty()) {
    std::ostringstream torn;
    for (const int64_t i : torn_) torn << (torn.tellp() > 0 ? ", " : "") << i;
    TORCH_CHECK(false, "SwapOptimizer: a failed step left param(s) ", torn.str(),
                " partly updated; step() refuses to run so that no piece is stepped twice. Load a checkpoint "
                "with load_state_dict() (which clears this), or create a new SwapOptimizer");
  }
  // Everything the op could reject is checked here, before any batch moves.
  const size_t count = params_.size();
  TORCH_CHECK_VALUE(params.size() == count && grads.size() == count, "SwapOptimizer: ", params.size(),
                    " params and ", grads.size(), " grads for a state laid out for ", count, " params");
  TORCH_CHECK_VALUE(group_args.size() == group_amsgrad_.size(), "SwapOptimizer: hyper-parameters for ",
                    group_args.size(), " param groups, but there are ", group_amsgrad_.size());
  for (size_t g = 0; g < group_args.size(); ++g) {
    TORCH_CHECK_VALUE(group_args[g].amsgrad == group_amsgrad_[g], "SwapOptimizer: param group ", g,
                      " now has amsgrad=", group_args[g].amsgrad ? "True" : "False",
                      " but its state was laid out with amsgrad=", group_amsgrad_[g] ? "True" : "False",
                      "; amsgrad cannot change after wrapping: create a new SwapOptimizer and load "
                      "the state dict into it");
    check_update_args(group_args[g]);
  }
  check_amp_scalar(grad_scale, "grad_scale", device_);
  check_amp_scalar(found_inf, "found_inf", device_);
  std::vector<at::Tensor> checked_grads(count);  // undefined where a param has no grad
  for (size_t i = 0; i < count; ++i) {
    const at::Tensor& param = params[i];
    TORCH_CHECK_VALUE(param.device() == device_ && param.scalar_type() == param_dtype_[i] &&
                          param.sizes() == c10::IntArrayRef(param_shape_[i]),
                      "SwapOptimizer: param ", i, " is now ", param.scalar_type(), " ",
                      param.sizes(), " on ", param.device(), " but was ", param_dtype_[i], " ",
                      c10::IntArrayRef(param_shape_[i]), " on ", device_,
                      " when SwapOptimizer was created; create a new SwapOptimizer after moving or "
                      "converting the model");
    if (!grads[i].has_value() || !grads[i]->defined()) continue;
    const at::Tensor& grad = *grads[i];
    TORCH_CHECK_VALUE(grad.layout() == at::kStrided, "SwapOptimizer: param ", i,
                      " has a sparse gradient; Adam/AdamW do not support sparse gradients (use "
                      "torch.optim.SparseAdam for those params)");
    TORCH_CHECK_TYPE(grad.scalar_type() == param.scalar_type(), "SwapOptimizer: param ", i, " is ",
                     param.scalar_type(), " but its grad is ", grad.scalar_type(),
                     "; grads must have the param's dtype");
    TORCH_CHECK_VALUE(grad.device() == device_ && grad.sizes() == param.sizes(),
                      "SwapOptimizer: param ", i, " is ", param.sizes(), " on ", device_,
                      " but its grad is ", grad.sizes(), " on ", grad.device());
    checked_grads[i] = grad;  // strided grads are copied where the op runs (Step::call_op)
  }

  params_ = params;
  const c10::DeviceGuard guard(device_);  // a no-op for CPU
  std::optional<at::Tensor> scale = grad_scale, inf = found_inf;
  if (deferred) {  // snapshots: GradScaler.update() rewrites its scale while the step may still read it
    if (scale.has_value()) scale = scale->clone();
    if (inf.has_value()) inf = inf->clone();
  }
  auto work = std::make_shared<Step>(*this, std::move(checked_grads), group_args, std::move(scale), std::move(inf),
                                     deferred ? std::function<void()>() : check_interrupt, deferred);
  transport_->stamp(Queue::kCaller, 0);
  if (deferred) {
    enqueue_deferred(work);
    step_pending_ = true;
    stats_.h2d_bytes = stats_.d2h_bytes = layout_.moved_bytes;
    return;
  }
  allocate_arenas();
  struct InStep {  // lets synchronize() on this thread (a signal handler) serve without the lock
    SwapRuntime& runtime;
    InStep(SwapRuntime& r, Step& w) : runtime(r) {
      runtime.current_step_ = &w;
      runtime.stepping_thread_ = std::this_thread::get_id();
    }
    ~InStep() {
      runtime.stepping_thread_ = std::thread::id();
      runtime.current_step_ = nullptr;
    }
  } in_step(*this, *work);
  try {
    run_pipeline(*transport_, *work, slot_of_batch_);
  } catch (...) {
    rethrow_failure(*work, std::current_exception());
  }
  step_pending_ = true;
  if (!options_.keep_arenas) release_arenas();  // in stream order: compute waited for every copy
  stats_.h2d_bytes = stats_.d2h_bytes = layout_.moved_bytes;
}

void SwapRuntime::rethrow_failure(const Step& work, std::exception_ptr failure) {
  release_arenas();  // the pipeline drained every queue before rethrowing
  const std::string torn = tear_report(work, work.found_inf());
  if (torn.empty()) std::rethrow_exception(failure);
  std::string error = "unknown error";
  try {
    std::rethrow_exception(failure);
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  } catch (const std::exception& e) {
    error = e.what();
  } catch (...) {
  }
  TORCH_CHECK(false, torn, "The error was: ", error);
}

}  // namespace swap_optimizer::runtime
