#include "swap_runtime.h"

#include "host_memory.h"
#include "runtime_step.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace swap_optimizer::runtime {
namespace {

// A tensor over bytes [offset, offset + its size) of `base` with a storage of
// its own, which keeps `base` alive: torch.save then writes only these bytes,
// and views of one slab in different dtypes do not share a storage (which
// torch.save refuses).
at::Tensor own_storage_view(const at::Tensor& base, int64_t offset, c10::IntArrayRef shape, c10::ScalarType dtype) {
  void* data = static_cast<uint8_t*>(base.data_ptr()) + offset;
  return at::from_blob(data, shape, [keep = base](void*) {}, base.options().dtype(dtype));
}

}  // namespace

int64_t staging_bytes_of(const StoreLayout& layout, int64_t num_arenas) {
  return std::min(num_arenas, layout.rotating_batches) * layout.staging_arena_bytes + layout.step_table_bytes;
}

int64_t smallest_swap_times_for_budget(const std::vector<SlotSpec>& specs, const KeyFlags& swap_keys,
                                       int64_t step_bytes, int64_t num_arenas, int64_t budget_bytes,
                                       int64_t* smallest_possible_bytes) {
  auto staging_bytes = [&](int64_t swap_times) {
    return staging_bytes_of(lay_out_store(specs, swap_keys, swap_times, step_bytes), num_arenas);
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
  layout_ = lay_out_store(specs_, options_.swap_keys, options_.swap_times, step_bytes_);
  // Streams, events, pinned slabs and the resident store belong to the params' device.
  const c10::DeviceGuard guard(device_);  // a no-op for CPU

  arena_count_ = static_cast<int>(std::min(options_.num_arenas, layout_.rotating_batches));
  // One marker slot per arena and one per resident batch (so that no resident
  // batch waits for another's markers); copies in and out get their own queues
  // once there are three arenas to rotate.
  const bool separate_copy_queues = arena_count_ >= 3;
  const int64_t resident_batches = static_cast<int64_t>(layout_.batches.size()) - layout_.rotating_batches;
  transport_ = make_transport(device_, arena_count_ + static_cast<int>(std::max<int64_t>(resident_batches, 1)),
                              separate_copy_queues);
  std::vector<int64_t> plan_order(layout_.batches.size());
  for (size_t b = 0; b < plan_order.size(); ++b) plan_order[b] = static_cast<int64_t>(b);
  adopt_order(std::move(plan_order));

  // Host slabs: one exact-size allocation per host region of the layout.
  const bool pin = device_.is_cuda() && options_.pin_memory;
  pinned_ = pin;
  for (const int64_t bytes : layout_.host_region_bytes) {
    bool pinned = false;
    host_slabs_.push_back(allocate_host_slab(bytes, pin, &pinned));
    if (pin && !pinned && bytes > 0) {  // an empty region has nothing to pin
      pinned_ = false;
      unpinned_bytes_ += bytes;
    }
  }
  if (layout_.resident_store_bytes > 0) {
    resident_store_ = at::zeros({layout_.resident_store_bytes}, at::TensorOptions().dtype(at::kByte).device(device_));
  }

  // The fused Adam op's layout tables: one row per whole param or piece, offsets from the arena's start.
  for (const BatchLayout& batch : layout_.batches) {
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
    op_layout_tables_.push_back(layout);
  }
}

SwapRuntime::~SwapRuntime() {
  const c10::DeviceGuard guard(device_);  // a no-op for CPU
  if (update_thread_.joinable()) update_thread_.join();  // a deferred step's failure is dropped
  if (transport_) transport_->drain();
}

void SwapRuntime::adopt_order(std::vector<int64_t> order) {
  order_ = std::move(order);
  position_of_.assign(order_.size(), 0);
  slot_of_batch_.clear();
  // Rotating batch r (in pipeline order) uses arena r mod N; resident batch k
  // (in layout order) has slot N + k of its own.
  int64_t rotating = 0;
  std::vector<int64_t> last_position(params_.size(), -1);
  for (size_t position = 0; position < order_.size(); ++position) {
    position_of_[order_[position]] = static_cast<int64_t>(position);
    const BatchLayout& batch = layout_.batches[order_[position]];
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
  for (int64_t b = 0; b < static_cast<int64_t>(layout_.batches.size()); ++b) {
    const BatchLayout& batch = layout_.batches[b];
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
  const BatchLayout& batch_layout = layout_.batches[batch];
  if (batch_layout.resident) {  // params whose states (if any: SGD without momentum keeps none) stay on the device
    return resident_store_.defined() ? resident_store_.narrow(0, 0, batch_layout.arena_bytes)
                                     : at::empty({0}, at::TensorOptions().dtype(at::kByte).device(device_));
  }
  return arenas_[slot].narrow(0, 0, batch_layout.arena_bytes);
}

std::vector<RowViews> SwapRuntime::arena_views(int64_t batch, const at::Tensor& arena,
                                               const std::vector<bool>& has_grad) const {
  const BatchLayout& batch_layout = layout_.batches[batch];
  // One alias of the arena per dtype: each view is a window of it (as_strided
  // checks the window against the arena's storage).
  std::vector<std::pair<c10::ScalarType, at::Tensor>> typed_arenas;
  auto typed_arena = [&](c10::ScalarType dtype) -> at::Tensor {
    for (const auto& [typed_dtype, typed] : typed_arenas) {
      if (typed_dtype == dtype) return typed;
    }
    const int64_t element = static_cast<int64_t>(c10::elementSize(dtype));
    TORCH_CHECK(arena.storage_offset() % element == 0, "SwapRuntime: a misaligned arena");
    at::Tensor typed = at::empty({0}, arena.options().dtype(dtype));
    typed.set_(arena.storage(), arena.storage_offset() / element, {arena.numel() / element}, {1});
    typed_arenas.emplace_back(dtype, typed);
    return typed;
  };
  std::vector<RowViews> views(batch_layout.rows.size());
  for (size_t r = 0; r < batch_layout.rows.size(); ++r) {
    const PieceRow& row = batch_layout.rows[r];
    if (!has_grad[row.slot]) continue;
    const SlotSpec& spec = specs_[row.slot];
    const bool whole = row.element_offset == 0 && row.count == spec.numel;
    for (int key = 0; key < static_cast<int>(row.arena_offset.size()); ++key) {
      const int64_t offset = row.arena_offset[key];
      if (offset == kNoOffset) continue;
      const StateDescription& description = descriptions_[row.slot][key];
      const int64_t bytes = key_bytes(spec, key, row.count);
      const int64_t element = static_cast<int64_t>(c10::elementSize(description.dtype));
      // (as_strided checks against the arena's storage, which a rotating arena shares with the others)
      TORCH_CHECK(offset % element == 0 && offset + bytes <= arena.numel(),
                  "SwapRuntime: state '", description.name, "' of batch ", batch, " lies outside its arena or is misaligned");
      // A piece's view is flat: its elements, or the blocks they start (cuts fall on whole blocks).
      const std::vector<int64_t> shape = whole ? description.shape : std::vector<int64_t>{bytes / element};
      std::vector<int64_t> strides(shape.size(), 1);
      for (int64_t d = static_cast<int64_t>(shape.size()) - 2; d >= 0; --d) strides[d] = strides[d + 1] * shape[d + 1];
      const at::Tensor typed = typed_arena(description.dtype);
      views[r].emplace_back(description.name, typed.as_strided(shape, strides, typed.storage_offset() + offset / element));
    }
  }
  return views;
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

void SwapRuntime::allocate_arenas() {
  if (device_steps_.defined()) return;
  const int64_t bytes = layout_.staging_arena_bytes;
  const int64_t total = staging_bytes_of(layout_, options_.num_arenas);
  const int64_t simulated_free = hooks_.simulated_free_bytes;
  try {
    TORCH_CHECK_WITH(OutOfMemoryError, simulated_free < 0 || total <= simulated_free,
                     "test hook: the device has ", simulated_free, " bytes free");
    for (int i = 0; i < arena_count_; ++i) {
      arenas_.push_back(at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(device_)));
    }
    // Adam's n floats (none for other rules); staging counts them as
    // layout_.step_table_bytes (256-byte aligned, as allocators round).
    device_steps_ = at::empty({layout_.host_region_bytes[kStepTableRegion] / kAdamStepBytes},
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
  stats.host_state_bytes = layout_.host_bytes;
  stats.step_table_bytes = layout_.step_table_bytes;
  stats.split_params = layout_.split_params;
  stats.pinned = pinned_;
  stats.unpinned_host_bytes = unpinned_bytes_;
  stats.resident_state_bytes = layout_.resident_store_bytes;
  for (const SlotSpec& spec : specs_) stats.swapped_elements += spec.swappable ? spec.numel : 0;
  stats.batches = layout_.rotating_batches;
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
  const StateHome& home = layout_.slots[param].home[key];
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
