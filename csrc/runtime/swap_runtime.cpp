#include "swap_runtime.h"

#include "../kernels/op_registry.h"
#include "host_memory.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <limits>
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

// A tensor over bytes [offset, offset + its size) of `base` with a storage of
// its own, which keeps `base` alive: torch.save then writes only these bytes,
// and views of one slab in different dtypes do not share a storage (which
// torch.save refuses).
at::Tensor own_storage_view(const at::Tensor& base, int64_t offset, c10::IntArrayRef shape, c10::ScalarType dtype) {
  void* data = static_cast<uint8_t*>(base.data_ptr()) + offset;
  return at::from_blob(data, shape, [keep = base](void*) {}, base.options().dtype(dtype));
}

}  // namespace

int64_t staging_bytes_of(const StorePlan& plan, int64_t num_arenas) {
  return std::min(num_arenas, plan.rotating_batches) * plan.staging_arena_bytes + plan.step_table_bytes;
}

int64_t smallest_swap_times_for_budget(const std::vector<SlotSpec>& specs, const KeyFlags& swap_keys,
                                       int64_t step_bytes, int64_t num_arenas, int64_t budget_bytes,
                                       int64_t* smallest_possible_bytes) {
  auto staging_bytes = [&](int64_t swap_times) {
    return staging_bytes_of(plan_store(specs, swap_keys, swap_times, step_bytes), num_arenas);
  };
  const int64_t most = finest_swap_times(specs);
  // Staging shrinks as batches are added until they come near a piece; among
  // the finest splits it wobbles by a piece or so. The least of those is the
  // smallest budget this search promises to meet.
  constexpr int64_t kFinestWindow = 8;
  int64_t smallest_at = most;
  *smallest_possible_bytes = staging_bytes(most);
  for (int64_t k = std::max<int64_t>(1, most - kFinestWindow); k < most; ++k) {
    const int64_t bytes = staging_bytes(k);
    if (bytes < *smallest_possible_bytes) {
      *smallest_possible_bytes = bytes;
      smallest_at = k;
    }
  }
  // Below num_arenas batches every extra batch adds an arena: try each count.
  const int64_t few = std::min(num_arenas, smallest_at);
  for (int64_t k = 1; k <= few; ++k) {
    if (staging_bytes(k) <= budget_bytes) return k;
  }
  if (*smallest_possible_bytes > budget_bytes) return -1;
  // From num_arenas batches on the arena count is fixed and the largest batch
  // shrinks as batches are added: bisect up to a count known to fit, then step
  // back while a smaller count still fits.
  int64_t low = few + 1, high = smallest_at;
  while (low < high) {
    const int64_t mid = low + (high - low) / 2;
    if (staging_bytes(mid) <= budget_bytes) high = mid; else low = mid + 1;
  }
  if (staging_bytes(low) > budget_bytes) low = smallest_at;  // the bisection met a wobble
  while (low > few + 1 && staging_bytes(low - 1) <= budget_bytes) --low;
  return low;
}

class SwapRuntime::Step final : public BatchWork {
 public:
  // Holds what the update reads (grads[i] undefined: param i has none), so a
  // deferred step outlives the caller's references.
  Step(SwapRuntime& runtime, std::vector<at::Tensor> grads, std::vector<PackedUpdateArgs> group_args,
       std::optional<at::Tensor> grad_scale, std::optional<at::Tensor> found_inf,
       std::function<void()> check_interrupt, bool deferred)
      : runtime_(runtime), grads_(std::move(grads)), group_args_(std::move(group_args)),
        grad_scale_(std::move(grad_scale)), found_inf_(std::move(found_inf)),
        check_interrupt_(std::move(check_interrupt)), deferred_(deferred) {
    has_grad_.reserve(grads_.size());
    for (const at::Tensor& grad : grads_) has_grad_.push_back(grad.defined());
  }

  std::exception_ptr failure;  // what stopped a deferred step on the update thread

  const std::optional<at::Tensor>& found_inf() const { return found_inf_; }
  // The position whose update rule (not the fused op) was running when the step failed, or -1.
  int64_t failed_rule_position() const { return inside_rule_; }

  // Bytes of the grads this step holds.
  int64_t grad_bytes() const {
    int64_t bytes = 0;
    for (const at::Tensor& grad : grads_) bytes += grad.defined() ? grad.numel() * grad.element_size() : 0;
    return bytes;
  }

  // Drops the grads of the params whose last batch is at a position up to
  // `position`, and at the last position the AMP snapshots; returns the grad
  // bytes dropped. Only for what the update has finished reading: on the host
  // the update thread is still running later positions, which read other
  // elements of grads_ (and has_grad_, never changed, for the row checks).
  int64_t release_through(int64_t position) {
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
  int64_t released_through() const { return released_through_; }

  void stage_in_step_table() override {
    const int64_t bytes = runtime_.plan_.host_region_bytes[kStepTableRegion];
    if (bytes == 0) return;
    runtime_.transport_->copy_to_device({runtime_.device_steps_.data_ptr(), bytes,
                                         runtime_.host_slabs_[kStepTableRegion].data_ptr(), bytes, bytes, 1});
  }

  void stage_out_step_table() override {
    const int64_t bytes = runtime_.plan_.host_region_bytes[kStepTableRegion];
    if (bytes == 0) return;
    runtime_.transport_->copy_to_host({runtime_.host_slabs_[kStepTableRegion].data_ptr(), bytes,
                                       runtime_.device_steps_.data_ptr(), bytes, bytes, 1});
  }

  // The pipeline calls these by position; runtime_.order_ gives the plan's batch.
  void stage_in(int64_t position, int slot) override {
    inject(FaultPoint::kStageIn, position, "copy in");
    const int64_t batch = runtime_.order_[position];
    Transport& transport = *runtime_.transport_;
    transport.stamp(Queue::kHostToDevice, stamp_index(position, kCopyInStamp));
    auto* arena = static_cast<uint8_t*>(runtime_.arena_for(batch, slot).data_ptr());
    for (const RegionCopy& copy : runtime_.plan_.batches[batch].host_copies) {
      transport.copy_to_device({arena + copy.arena_offset, copy.arena_pitch, host_at(copy), copy.pitch,
                                copy.width, copy.rows});
    }
    transport.stamp(Queue::kHostToDevice, stamp_index(position, kCopyInStamp) + 1);
  }

  void stage_out(int64_t position, int slot) override {
    const int64_t batch = runtime_.order_[position];
    Transport& transport = *runtime_.transport_;
    transport.stamp(Queue::kDeviceToHost, stamp_index(position, kCopyOutStamp));
    const auto* arena = static_cast<const uint8_t*>(runtime_.arena_for(batch, slot).data_ptr());
    for (const RegionCopy& copy : runtime_.plan_.batches[batch].host_copies) {
      transport.copy_to_host({host_at(copy), copy.pitch, arena + copy.arena_offset, copy.arena_pitch,
                              copy.width, copy.rows});
    }
    transport.stamp(Queue::kDeviceToHost, stamp_index(position, kCopyOutStamp) + 1);
  }

  // Interrupts are taken only where no param is cut, so an interrupted step
  // leaves every param wholly old or wholly new.
  void between_batches(int64_t next_position) override {
    if (runtime_.hooks_.fault == FaultPoint::kInterrupt && runtime_.hooks_.fault_batch == next_position) {
      // Delivered to Python by check_interrupt, like a real Ctrl-C; in a
      // deferred step (which has none) Python raises it on the main thread.
      std::raise(SIGINT);
    }
    const int64_t batch = runtime_.order_[next_position];
    const bool cuts_a_param = runtime_.plan_.batches[batch].rows.front().element_offset > 0;
    if (check_interrupt_ && !cuts_a_param) check_interrupt_();
  }

  void update(int64_t position, int slot) override {
    progress_ = {position, 0};
    inject(FaultPoint::kUpdate, position, "update");
    Transport& transport = *runtime_.transport_;
    transport.delay_compute();  // test hook
    transport.stamp(Queue::kCompute, stamp_index(position, kUpdateStamp));
    const int64_t batch = runtime_.order_[position];
    const BatchPlan& plan = runtime_.plan_.batches[batch];
    const at::Tensor arena = runtime_.arena_for(batch, slot);
    // States kept on the device join the arena for the update and go back after it.
    // Row by row: each a contiguous copy (a strided uint8 copy_ would run
    // TensorIterator's elementwise kernel instead of a memcpy).
    auto join = [&](bool into_arena) {
      for (const RegionCopy& copy : plan.resident_copies) {
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

  // Whether the update of `row` of plan batch `batch` has run (its param has a grad and its op call returned).
  bool row_updated(int64_t batch, int64_t row) const {
    if (!has_grad_[runtime_.plan_.batches[batch].rows[row].slot]) return false;
    const int64_t position = runtime_.position_of_[batch];
    return position < progress_.first || (position == progress_.first && row < progress_.second);
  }

  // Timeline stamps: 0 is the step's start, then per position the start and
  // end of its copies in, update and copies out.
  static constexpr int kCopyInStamp = 0, kUpdateStamp = 2, kCopyOutStamp = 4, kStampsPerBatch = 6;
  static int stamp_index(int64_t position, int lane) {
    return static_cast<int>(1 + kStampsPerBatch * position + lane);
  }

 private:
  void inject(FaultPoint point, int64_t position, const char* what) const {
    const TestHooks& hooks = runtime_.hooks_;
    TORCH_CHECK(!(hooks.fault == point && hooks.fault_batch == position),
                "SwapOptimizer: injected test fault at the ", what, " of batch ", position);
  }

  void* host_at(const RegionCopy& copy) const {
    return static_cast<uint8_t*>(runtime_.host_slabs_[copy.region].data_ptr()) + copy.offset;
  }

  // One op call per run of consecutive rows of one group that have grads;
  // another optimizer's rule: one call for the batch.
  void update_rows(int64_t position, int64_t batch, const at::Tensor& arena) {
    const BatchPlan& plan = runtime_.plan_.batches[batch];
    const int64_t count = static_cast<int64_t>(plan.rows.size());
    if (runtime_.batch_update_) {
      inject(FaultPoint::kUpdateLastCall, position, "last op call");
      // As for the fused op: the update bumps no param's version counter.
      const at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::vector<at::Tensor> params, grads;
      for (const PieceRow& row : plan.rows) {
        params.push_back(runtime_.params_[row.slot]);
        grads.push_back(grads_[row.slot]);
      }
      // Not atomic like the fused op: if it throws, any of its rows may be
      // partly written (tear_report then marks them all torn).
      inside_rule_ = position;
      runtime_.batch_update_(batch, arena, params, grads);
      inside_rule_ = -1;
      progress_.second = count;
      return;
    }
    std::vector<std::pair<int64_t, int64_t>> runs;
    for (int64_t begin = 0; begin < count;) {
      const int64_t first = plan.rows[begin].slot;
      int64_t end = begin + 1;
      if (has_grad_[first]) {
        while (end < count && has_grad_[plan.rows[end].slot] &&
               runtime_.group_of_param_[plan.rows[end].slot] == runtime_.group_of_param_[first]) {
          ++end;
        }
        runs.emplace_back(begin, end);
      }
      begin = end;
    }
    const at::Tensor& layout = runtime_.layouts_[batch];
    for (size_t r = 0; r < runs.size(); ++r) {
      const auto [begin, end] = runs[r];
      if (r + 1 == runs.size()) inject(FaultPoint::kUpdateLastCall, position, "last op call");
      call_op(plan, begin, end, arena, layout.narrow(0, begin, end - begin),
              group_args_[runtime_.group_of_param_[plan.rows[begin].slot]]);
      progress_.second = end;
    }
  }

  void call_op(const BatchPlan& plan, int64_t begin, int64_t end, const at::Tensor& arena,
               const at::Tensor& layout, const PackedUpdateArgs& args) {
    // Below autograd and ADInplaceOrView: the step bumps no param's version
    // counter (the op never did; the write-back of a strided param would), so
    // the Python layer can take any bump for a write made outside step(),
    // also while a deferred step runs.
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    std::vector<at::Tensor> params, grads;
    std::vector<std::pair<at::Tensor, at::Tensor>> write_back;  // (param, contiguous copy)
    for (int64_t k = begin; k < end; ++k) {
      const int64_t slot = plan.rows[k].slot;
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

SwapRuntime::SwapRuntime(std::vector<at::Tensor> params, std::vector<int64_t> group_of_param,
                         const std::vector<bool>& group_amsgrad, const std::vector<bool>& swappable,
                         const RuntimeOptions& options)
    : params_(std::move(params)),
      group_of_param_(std::move(group_of_param)),
      group_amsgrad_(group_amsgrad),
      device_(at::kCPU),
      options_(options) {
  TORCH_CHECK_VALUE(!params_.empty(), "SwapOptimizer: the optimizer has no params");
  TORCH_CHECK_VALUE(options_.global_offsets.empty() || options_.global_offsets.size() == params_.size(),
                    "SwapRuntime: one global offset per param, or none");
  TORCH_CHECK_VALUE(options_.quantized_params.empty() || options_.quantized_params.size() == params_.size(),
                    "SwapRuntime: one quantized flag per param, or none");
  TORCH_CHECK_VALUE(!options_.kahan_summation || !options_.master_weights,
                    "SwapOptimizer: kahan_summation and master_weights both keep the rounding error of 16-bit "
                    "params; choose one");
  TORCH_CHECK_VALUE(options_.swap_keys.size() == kAdamKeyCount, "SwapRuntime: swap_keys needs one flag per state key");
  specs_ = make_slot_specs(params_, group_of_param_, group_amsgrad_, swappable, options_);
  descriptions_ = adam_state_descriptions(params_, specs_, options_);
  set_up();
}

SwapRuntime::SwapRuntime(std::vector<at::Tensor> params, std::vector<SlotSpec> specs,
                         std::vector<std::vector<StateDescription>> descriptions, BatchUpdate update,
                         const RuntimeOptions& options)
    : params_(std::move(params)),
      device_(at::kCPU),
      options_(options),
      specs_(std::move(specs)),
      descriptions_(std::move(descriptions)),
      step_bytes_(0),
      batch_update_(std::move(update)) {
  TORCH_CHECK_VALUE(!params_.empty(), "SwapOptimizer: the optimizer has no params");
  TORCH_CHECK_VALUE(batch_update_, "SwapRuntime: an update rule is needed");
  TORCH_CHECK_VALUE(specs_.size() == params_.size() && descriptions_.size() == params_.size(),
                    "SwapRuntime: one slot spec and one list of state descriptions per param");
  group_of_param_.assign(params_.size(), 0);
  for (size_t i = 0; i < params_.size(); ++i) {
    TORCH_CHECK_VALUE(specs_[i].numel == params_[i].numel() && specs_[i].states.size() == options_.swap_keys.size() &&
                          descriptions_[i].size() == options_.swap_keys.size(),
                      "SwapRuntime: param ", i, "'s spec does not match it or the ", options_.swap_keys.size(),
                      " state keys");
  }
  set_up();
}

void SwapRuntime::set_up() {
  TORCH_CHECK_VALUE(options_.swap_times >= 1, "SwapOptimizer: swap_times must be >= 1, got ",
                    options_.swap_times);
  TORCH_CHECK_VALUE(options_.num_arenas >= 2, "SwapOptimizer: num_arenas must be >= 2, got ",
                    options_.num_arenas);
  device_ = params_.front().device();
  for (size_t i = 0; i < params_.size(); ++i) {
    TORCH_CHECK_VALUE(params_[i].device() == device_, "SwapOptimizer: param ", i, " is on ",
                      params_[i].device(), " but param 0 is on ", device_,
                      "; all params must be on one device");
    param_dtype_.push_back(params_[i].scalar_type());
    param_shape_.push_back(params_[i].sizes().vec());
  }
  TORCH_CHECK_VALUE(options_.resident_groups.empty() || options_.resident_groups.size() == params_.size(),
                    "SwapRuntime: one resident group per param, or none");
  for (size_t i = 0; i < options_.resident_groups.size(); ++i) specs_[i].resident_group = options_.resident_groups[i];
  plan_ = plan_store(specs_, options_.swap_keys, options_.swap_times, step_bytes_);
  // Streams, events, pinned slabs and the resident store belong to the params' device.
  const c10::DeviceGuard guard(device_);  // a no-op for CPU

  arena_count_ = static_cast<int>(std::min(options_.num_arenas, plan_.rotating_batches));
  // One marker slot per arena and one per resident batch (so that no resident
  // batch waits for another's markers); copies in and out get their own queues
  // once there are three arenas to rotate.
  const bool separate_copy_queues = arena_count_ >= 3;
  const int64_t resident_batches = static_cast<int64_t>(plan_.batches.size()) - plan_.rotating_batches;
  transport_ = make_transport(device_, arena_count_ + static_cast<int>(std::max<int64_t>(resident_batches, 1)),
                              separate_copy_queues);
  std::vector<int64_t> plan_order(plan_.batches.size());
  for (size_t b = 0; b < plan_order.size(); ++b) plan_order[b] = static_cast<int64_t>(b);
  adopt_order(std::move(plan_order));

  // Host slabs: one exact-size allocation per host region of the plan.
  const bool pin = device_.is_cuda() && options_.pin_memory;
  pinned_ = pin;
  for (const int64_t bytes : plan_.host_region_bytes) {
    bool pinned = false;
    host_slabs_.push_back(allocate_host_slab(bytes, pin, &pinned));
    if (pin && !pinned && bytes > 0) {  // an empty region has nothing to pin
      pinned_ = false;
      unpinned_bytes_ += bytes;
    }
  }
  if (plan_.resident_store_bytes > 0) {
    resident_store_ = at::zeros({plan_.resident_store_bytes}, at::TensorOptions().dtype(at::kByte).device(device_));
  }

  // The fused Adam op's layout tables: one row per whole param or piece, offsets from the arena's start.
  for (const BatchPlan& batch : plan_.batches) {
    if (batch_update_) break;
    const int64_t count = static_cast<int64_t>(batch.rows.size());
    at::Tensor layout = at::empty({count, kLayoutColumns}, at::TensorOptions().dtype(at::kLong));
    int64_t* rows = layout.data_ptr<int64_t>();
    for (int64_t k = 0; k < count; ++k) {
      const PieceRow& piece = batch.rows[k];
      int64_t* row = rows + k * kLayoutColumns;
      for (int key = 0; key < kAdamKeyCount; ++key) {
        row[kAdamKeyColumn[key]] = piece.arena_offset[key] == kNoOffset ? kAbsent : piece.arena_offset[key];
      }
      row[kNumel] = piece.count;
      row[kParamOffset] = piece.element_offset;
      row[kStepIndex] = piece.step_index;
      row[kAdvanceStep] = piece.advances_step ? 1 : 0;
      row[kRandomKey] = piece.slot;
      row[kGlobalOffset] = global_offset(piece.slot) + piece.element_offset;
    }
    layouts_.push_back(layout);
  }
}

SwapRuntime::~SwapRuntime() {
  const c10::DeviceGuard guard(device_);  // a no-op for CPU
  if (update_thread_) update_thread_->wait_for(update_thread_->submitted());  // a deferred step's failure is dropped
  if (transport_) transport_->drain();
}

void SwapRuntime::adopt_order(std::vector<int64_t> order) {
  order_ = std::move(order);
  position_of_.assign(order_.size(), 0);
  slot_of_batch_.clear();
  // Rotating batch r (in pipeline order) uses arena r mod N; resident batch k
  // (in plan order) has slot N + k of its own.
  int64_t rotating = 0;
  std::vector<int64_t> last_position(params_.size(), -1);
  for (size_t position = 0; position < order_.size(); ++position) {
    position_of_[order_[position]] = static_cast<int64_t>(position);
    const BatchPlan& batch = plan_.batches[order_[position]];
    slot_of_batch_.push_back(batch.resident ? arena_count_ + static_cast<int>(order_[position])
                                            : static_cast<int>(rotating++ % arena_count_));
    for (const PieceRow& row : batch.rows) last_position[row.slot] = static_cast<int64_t>(position);
  }
  last_read_at_.assign(order_.size(), {});
  for (size_t slot = 0; slot < last_position.size(); ++slot) {
    if (last_position[slot] >= 0) last_read_at_[last_position[slot]].push_back(static_cast<int64_t>(slot));
  }
}

void SwapRuntime::set_batch_order(const std::vector<int64_t>& rank_of_param) {
  const std::lock_guard<std::mutex> lock(step_mutex_);
  finish_deferred();
  TORCH_CHECK_VALUE(rank_of_param.size() == params_.size(), "SwapRuntime: one rank per param, got ",
                    rank_of_param.size(), " for ", params_.size(), " params");
  // Chains: runs of batches each of which (after the first) continues a param
  // cut by the one before; a chain moves whole, so pieces keep their order.
  struct Chain {
    int64_t rank;
    int64_t first, end;
  };
  std::vector<Chain> chains;
  for (int64_t b = 0; b < static_cast<int64_t>(plan_.batches.size()); ++b) {
    const BatchPlan& batch = plan_.batches[b];
    const bool continues = !batch.rows.empty() && batch.rows.front().element_offset > 0;
    if (!continues || chains.empty()) chains.push_back({std::numeric_limits<int64_t>::max(), b, b});
    Chain& chain = chains.back();
    chain.end = b + 1;
    for (const PieceRow& row : batch.rows) chain.rank = std::min(chain.rank, rank_of_param[row.slot]);
  }
  std::stable_sort(chains.begin(), chains.end(), [](const Chain& a, const Chain& b) { return a.rank < b.rank; });
  std::vector<int64_t> order;
  for (const Chain& chain : chains) {
    for (int64_t b = chain.first; b < chain.end; ++b) order.push_back(b);
  }
  adopt_order(std::move(order));
}

std::vector<int64_t> SwapRuntime::pipeline_order() const {
  const std::lock_guard<std::mutex> lock(step_mutex_);
  return order_;
}

at::Tensor SwapRuntime::arena_for(int64_t batch, int slot) const {
  const BatchPlan& plan = plan_.batches[batch];
  if (plan.resident) {  // params whose states (if any: SGD without momentum keeps none) stay on the device
    return resident_store_.defined() ? resident_store_.narrow(0, 0, plan.arena_bytes)
                                     : at::empty({0}, at::TensorOptions().dtype(at::kByte).device(device_));
  }
  return arenas_[slot].narrow(0, 0, plan.arena_bytes);
}

std::vector<int64_t> SwapRuntime::torn_params() const {
  const std::lock_guard<std::mutex> lock(step_mutex_);
  return torn_;
}

void SwapRuntime::clear_torn() {
  const std::lock_guard<std::mutex> lock(step_mutex_);
  finish_deferred();
  torn_.clear();
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
    const std::vector<PieceRow>& rows = plan_.batches[batch].rows;
    for (size_t r = 0; r < rows.size(); ++r) {
      if (rows[r].slot == slot) return static_cast<int64_t>(r);
    }
    return int64_t{-1};
  };
  std::string report;
  if (work.failed_rule_position() >= 0) {
    // An update rule that threw may have written any of its rows in part.
    for (const PieceRow& row : plan_.batches[order_[work.failed_rule_position()]].rows) {
      if (std::find(torn_.begin(), torn_.end(), row.slot) != torn_.end()) continue;
      torn_.push_back(row.slot);
      std::ostringstream line;
      line << "SwapOptimizer: param " << row.slot << " (shape " << c10::IntArrayRef(param_shape_[row.slot])
           << ") may be partly updated: the optimizer's own step failed while it updated the batch holding it. "
              "step() now refuses to run until you load_state_dict a checkpoint.\n";
      report += line.str();
    }
  }
  for (int64_t i = 0; i < static_cast<int64_t>(plan_.slots.size()); ++i) {
    const SlotPlacement& slot = plan_.slots[i];
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

void SwapRuntime::allocate_arenas() {
  if (device_steps_.defined()) return;
  const int64_t bytes = plan_.staging_arena_bytes;
  const int64_t total = staging_bytes_of(plan_, options_.num_arenas);
  const int64_t simulated_free = hooks_.simulated_free_bytes;
  try {
    TORCH_CHECK_WITH(OutOfMemoryError, simulated_free < 0 || total <= simulated_free,
                     "test hook: the device has ", simulated_free, " bytes free");
    for (int i = 0; i < arena_count_; ++i) {
      arenas_.push_back(at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(device_)));
    }
    // Adam's n floats (none for other rules); staging counts them as
    // plan_.step_table_bytes (256-byte aligned, as allocators round).
    device_steps_ = at::empty({plan_.host_region_bytes[kStepTableRegion] / kAdamStepBytes},
                              at::TensorOptions().dtype(at::kFloat).device(device_));
  } catch (const c10::OutOfMemoryError& error) {
    arenas_.clear();
    device_steps_ = at::Tensor();
    // Advice from what is free now: the smallest split whose two arenas fit.
    const int64_t free = simulated_free >= 0 ? simulated_free : free_device_bytes(device_);
    int64_t smallest = 0;
    const int64_t fits = smallest_swap_times_for_budget(specs_, options_.swap_keys, step_bytes_, 2, free, &smallest);
    const std::string advice =
        fits > 0 ? "swap_times=" + std::to_string(fits) + " with num_arenas=2 fits (or set staging_budget_bytes)"
                 : "even the finest split needs " + std::to_string(smallest) +
                       " bytes of staging: free device memory, or keep more params resident with a larger min_numel";
    TORCH_CHECK_WITH(OutOfMemoryError, false, "SwapOptimizer: no room on ", device_, " for ", arena_count_,
                     " staging arenas of ", bytes, " bytes and the step table (", total, " bytes in all, ", free,
                     " bytes free) with swap_times=", options_.swap_times, " and num_arenas=", options_.num_arenas,
                     "; ", advice, ". The optimizer state is unchanged. (", error.what_without_backtrace(), ")");
  }
  stats_.staging_bytes = total;
  stats_.peak_staging_bytes = std::max(stats_.peak_staging_bytes, stats_.staging_bytes);
}

void SwapRuntime::release_arenas() {
  arenas_.clear();
  device_steps_ = at::Tensor();
  stats_.staging_bytes = 0;
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
    stats_.h2d_bytes = stats_.d2h_bytes = plan_.moved_bytes;
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
  stats_.h2d_bytes = stats_.d2h_bytes = plan_.moved_bytes;
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

void SwapRuntime::enqueue_deferred(const std::shared_ptr<Step>& work) {
  const int64_t grad_bytes = work->grad_bytes();  // before the update thread may read the grads
  if (device_.is_cpu()) {
    allocate_arenas();  // held until the step is finished (finish_deferred)
    transport_->open_ready(static_cast<int64_t>(order_.size()));
    if (!update_thread_) {
      update_thread_ = std::make_unique<WorkerQueue>();
      update_thread_id_ = update_thread_->thread_id();
    }
    // The pipeline runs on the update thread with this thread's thread-local
    // state (grad mode, dispatch keys), below Python's dispatch keys: a
    // Python mode active here must not make the update thread need the GIL,
    // which a waiting caller may hold. Its failure is kept for the next wait.
    // The caller's intra-op thread count too (OpenMP's is per thread).
    auto job = [this, work = std::shared_ptr<Step>(work), state = at::ThreadLocalState(),
                threads = at::get_num_threads()]() mutable {
      const at::ThreadLocalStateGuard guard(state);
      const c10::impl::ExcludeDispatchKeyGuard no_python(
          c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
      if (at::get_num_threads() != threads) at::set_num_threads(threads);
      try {
        run_pipeline(*transport_, *work, slot_of_batch_);
      } catch (...) {
        work->failure = std::current_exception();
      }
      // deferred_ is then the last owner: the step, and any grad it still
      // holds, is freed on a caller's thread, never here (freeing a tensor
      // whose Python object outlived its last Python reference takes the GIL,
      // which a thread waiting for this one may hold).
      work.reset();
      transport_->release_ready();  // wakes every waiter, also after a failure
    };
    try {
      deferred_ticket_ = update_thread_->submit(std::move(job));
    } catch (...) {
      transport_->release_ready();
      release_arenas();
      throw;
    }
    deferred_ = work;
    held_grad_bytes_ = grad_bytes;
    return;
  }
  // CUDA: enqueued now on the update stream, which waits for the caller's
  // stream first; a failure to enqueue shows here. The grads and snapshots
  // stay the caller stream's: the step holds them until a wait has ordered
  // that stream after their last reader (release_deferred_through).
  transport_->enter_update_queue();
  struct Leave {
    Transport& transport;
    ~Leave() { transport.leave_update_queue(); }
  } leave{*transport_};
  // Allocated on the update stream, which is current: the caching allocator
  // hands their blocks out again only to later work on that stream.
  allocate_arenas();
  transport_->open_ready(static_cast<int64_t>(order_.size()));
  try {
    run_pipeline(*transport_, *work, slot_of_batch_);
  } catch (...) {
    rethrow_failure(*work, std::current_exception());
  }
  if (!options_.keep_arenas) {
    // The update stream waited for every copy before the step's end, so
    // freeing them now is in its order: the next deferred step's arenas are
    // these blocks, however far the host runs ahead.
    const int64_t live = stats_.staging_bytes;
    release_arenas();
    stats_.staging_bytes = live;  // still in use until the step is waited for
  }
  deferred_ = work;
  held_grad_bytes_ = grad_bytes;
}

void SwapRuntime::release_deferred_through(int64_t position) {
  if (position <= deferred_->released_through()) return;
  transport_->order_release(position);
  held_grad_bytes_ -= deferred_->release_through(position);
}

void SwapRuntime::finish_deferred() {
  if (!deferred_) return;
  if (update_thread_) update_thread_->wait_for(deferred_ticket_);
  if (!deferred_->failure) release_deferred_through(static_cast<int64_t>(order_.size()) - 1);
  const std::shared_ptr<Step> work = std::move(deferred_);
  deferred_.reset();
  held_grad_bytes_ = 0;
  if (work->failure) rethrow_failure(*work, work->failure);
  if (!options_.keep_arenas) release_arenas();
}

void SwapRuntime::wait_ready(int64_t position) {
  if (stepping_thread_ == std::this_thread::get_id() || on_update_thread()) return;  // see wait_step
  const std::lock_guard<std::mutex> lock(step_mutex_);
  TORCH_CHECK_INDEX(position >= 0 && position < static_cast<int64_t>(order_.size()), "SwapRuntime: no batch at ",
                    "position ", position, " of ", order_.size());
  const c10::DeviceGuard guard(device_);
  if (!deferred_) {
    // Finished by a wait on another stream: on CUDA this one must still wait
    // for the step's end (a no-op on the host, where finishing joined it).
    if (step_pending_) transport_->wait(Queue::kCaller, kStepEndMarker);
    return;
  }
  if (transport_->wait_ready(position)) {
    finish_deferred();  // the step stopped short of it: raise why
    return;
  }
  release_deferred_through(position);
}

bool SwapRuntime::has_deferred_step() const {
  if (stepping_thread_ == std::this_thread::get_id() || on_update_thread()) return false;  // see wait_step
  const std::lock_guard<std::mutex> lock(step_mutex_);
  return deferred_ != nullptr;
}

void SwapRuntime::wait_step() {
  // A signal handler inside this thread's own whole step (check_interrupt):
  // that step began by finishing any deferred one, so nothing is deferred, and
  // waiting for the step lock it holds would never end. Nor can the update
  // thread wait for the step it runs (Python code in its update rule).
  if (stepping_thread_ == std::this_thread::get_id() || on_update_thread()) return;
  const std::lock_guard<std::mutex> lock(step_mutex_);
  const c10::DeviceGuard guard(device_);
  finish_deferred();
  // CUDA: a stream wait, also when another stream's wait finished the step;
  // host: the step has run.
  if (step_pending_) transport_->wait(Queue::kCaller, kStepEndMarker);
}

void SwapRuntime::enable_timeline(bool enabled) {
  const std::lock_guard<std::mutex> lock(step_mutex_);
  finish_deferred();
  const c10::DeviceGuard guard(device_);
  transport_->enable_stamps(enabled ? Step::stamp_index(static_cast<int64_t>(order_.size()), 0) : 0);
  timeline_ = enabled;
}

std::vector<std::tuple<std::string, int64_t, double, double>> SwapRuntime::timeline() {
  const std::lock_guard<std::mutex> lock(step_mutex_);
  finish_deferred();
  const c10::DeviceGuard guard(device_);
  std::vector<std::tuple<std::string, int64_t, double, double>> spans;
  if (!timeline_) return spans;
  const std::vector<double> seconds = transport_->stamp_seconds();
  constexpr std::pair<const char*, int> kLanes[] = {
      {"copy in", Step::kCopyInStamp}, {"update", Step::kUpdateStamp}, {"copy out", Step::kCopyOutStamp}};
  for (int64_t position = 0; position < static_cast<int64_t>(order_.size()); ++position) {
    for (const auto& [lane, offset] : kLanes) {
      const int start = Step::stamp_index(position, offset);
      if (!std::isnan(seconds[start]) && !std::isnan(seconds[start + 1])) {
        spans.emplace_back(lane, position, seconds[start], seconds[start + 1]);
      }
    }
  }
  return spans;
}

void SwapRuntime::order_writes() {
  const std::lock_guard<std::mutex> lock(step_mutex_);
  finish_deferred();
  const c10::DeviceGuard guard(device_);
  // The next step's compute stream waits for the step-end marker before
  // anything, and synchronize() waits for it: it must follow the last step too.
  transport_->begin_step();
  transport_->wait(Queue::kCompute, kStepEndMarker);
  transport_->record(Queue::kCompute, kStepEndMarker);
}

void SwapRuntime::synchronize() {
  if (stepping_thread_ == std::this_thread::get_id()) {
    stage_out_step_table(*transport_, *current_step_);
    transport_->drain();
    return;
  }
  const std::lock_guard<std::mutex> lock(step_mutex_);
  finish_deferred();
  if (!step_pending_) return;
  const c10::DeviceGuard guard(device_);
  transport_->host_wait(kStepEndMarker);
  step_pending_ = false;
}

void SwapRuntime::set_rounding_seed(int64_t seed) {
  const std::lock_guard<std::mutex> lock(step_mutex_);
  finish_deferred();
  TORCH_CHECK_VALUE(options_.rounding_seed.has_value(), "SwapRuntime: stochastic rounding is off (state_dtype is "
                    "not bfloat16); there is no seed to set");
  options_.rounding_seed = seed;
}

MemoryStats SwapRuntime::memory_stats() const {
  MemoryStats stats = stats_;
  stats.host_state_bytes = plan_.host_bytes;
  stats.step_table_bytes = plan_.step_table_bytes;
  stats.split_params = plan_.split_params;
  stats.pinned = pinned_;
  stats.unpinned_host_bytes = unpinned_bytes_;
  stats.resident_state_bytes = plan_.resident_store_bytes;
  for (const SlotSpec& spec : specs_) stats.swapped_elements += spec.swappable ? spec.numel : 0;
  stats.batches = plan_.rotating_batches;
  stats.num_arenas = arena_count_;
  stats.held_grad_bytes = held_grad_bytes_;
  return stats;
}

void SwapRuntime::set_test_hooks(const TestHooks& hooks) {
  const std::lock_guard<std::mutex> lock(step_mutex_);
  finish_deferred();
  hooks_ = hooks;
  transport_->set_copy_delay(hooks.copy_delay_us, hooks.seed);
  transport_->set_compute_delay(hooks.compute_delay_us, hooks.seed);
}

int64_t SwapRuntime::global_offset(int64_t param) const {
  return options_.global_offsets.empty() ? 0 : options_.global_offsets[param];
}

at::Tensor SwapRuntime::state_view(int64_t param, int key) const {
  const StateHome& home = plan_.slots[param].home[key];
  if (home.offset == kNoOffset) return at::Tensor();
  const StateDescription& description = descriptions_[param][key];
  const int64_t bytes = key_bytes(specs_[param], key, specs_[param].numel);
  if (bytes == 0) {  // an empty param: nothing to share (the resident store may not even exist)
    return at::empty(description.shape, at::TensorOptions().dtype(description.dtype).device(
                                            home.region == kResidentStore ? device_ : c10::Device(at::kCPU)));
  }
  const at::Tensor& base = home.region == kResidentStore ? resident_store_ : host_slabs_[home.region];
  return own_storage_view(base, home.offset, description.shape, description.dtype);
}

std::vector<std::pair<std::string, at::Tensor>> SwapRuntime::state_views(int64_t param) const {
  TORCH_CHECK_INDEX(param >= 0 && param < static_cast<int64_t>(params_.size()),
                    "SwapRuntime: no param ", param);
  std::vector<std::pair<std::string, at::Tensor>> views;
  if (step_bytes_ > 0) {
    views.emplace_back("step", own_storage_view(host_slabs_[kStepTableRegion], param * step_bytes_, {}, at::kFloat));
  }
  for (int key = 0; key < static_cast<int>(descriptions_[param].size()); ++key) {
    at::Tensor view = state_view(param, key);
    if (view.defined()) views.emplace_back(descriptions_[param][key].name, std::move(view));
  }
  return views;
}

}  // namespace swap_optimizer::runtime
