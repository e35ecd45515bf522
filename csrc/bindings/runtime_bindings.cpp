#include "runtime_bindings.h"

#include "../kernels/state_codec.h"
#include "../runtime/host_memory.h"
#include "../runtime/swap_runtime.h"

#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <ATen/ops/tensor.h>

#include <pthread.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <type_traits>
#include <tuple>

namespace swap_optimizer {
namespace {

namespace py = pybind11;
using runtime::FaultPoint;
using runtime::KeyFlags;
using runtime::RuntimeOptions;
using runtime::SwapRuntime;

// (lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled_weight_decay)
using GroupArgs = std::tuple<double, double, double, double, double, bool, bool, bool>;

// The optional settings of the compact state forms.
struct CompactOptions {
  bool kahan_summation = false;
  std::optional<int64_t> rounding_seed;
  std::vector<int64_t> global_offsets;
  std::vector<bool> quantized_params;
};

RuntimeOptions make_options(int64_t swap_times, int64_t num_arenas,
                            std::optional<c10::ScalarType> state_dtype, bool master_weights,
                            bool pin_memory, bool keep_arenas, const std::vector<bool>& swap_keys,
                            CompactOptions compact = {}) {
  RuntimeOptions options;
  options.swap_times = swap_times;
  options.num_arenas = num_arenas;
  options.state_dtype = state_dtype;
  options.master_weights = master_weights;
  options.pin_memory = pin_memory;
  options.keep_arenas = keep_arenas;
  options.kahan_summation = compact.kahan_summation;
  options.rounding_seed = compact.rounding_seed;
  options.global_offsets = std::move(compact.global_offsets);
  options.quantized_params = std::move(compact.quantized_params);
  options.swap_keys = swap_keys;
  return options;
}

FaultPoint parse_fault(const std::optional<std::string>& name) {
  if (!name) return FaultPoint::kNone;
  if (*name == "stage_in") return FaultPoint::kStageIn;
  if (*name == "update") return FaultPoint::kUpdate;
  if (*name == "update_last_call") return FaultPoint::kUpdateLastCall;
  if (*name == "interrupt") return FaultPoint::kInterrupt;
  TORCH_CHECK_VALUE(false, "fault must be None, 'stage_in', 'update', 'update_last_call' or 'interrupt', got '", *name, "'");
}

py::list batch_layout(const runtime::StoreLayout& layout) {
  py::list batches;
  for (const runtime::BatchLayout& b : layout.batches) {
    py::list params, pieces, arena_offsets;
    for (const runtime::PieceRow& row : b.rows) {
      params.append(row.slot);
      pieces.append(py::make_tuple(row.slot, row.element_offset, row.count));
      arena_offsets.append(row.arena_offset);
    }
    py::dict batch;
    batch["params"] = params;
    batch["pieces"] = pieces;
    batch["arena_offsets"] = arena_offsets;  // per piece, per key: its byte offset in the arena (-1: not kept)
    batch["resident"] = b.resident;
    batch["host_bytes"] = b.host_bytes;
    batch["arena_bytes"] = b.arena_bytes;
    batch["host_copies"] = b.host_copies.size();
    batches.append(batch);
  }
  return batches;
}

// What summarize_staging and summarize_rule_staging report of a store layout:
// the device and host bytes it lays out, its batches, and each param's state
// bytes (every key it keeps, swapped or resident), from which the budget search
// chooses the params to keep resident, and the state bytes that go to host memory.
// Every field is declared here, once, update_temporary_bytes too, which the
// Python layer sets (with_update_temporary_bytes) for the update it runs.
#define SWAP_STAGING_SUMMARY_FIELDS(X)                                                           \
  X(int64_t, host_state_bytes)                                                                  \
  X(int64_t, staging_bytes)        /* min(num_arenas, batches) arenas and the step table */     \
  X(int64_t, largest_arena_bytes)                                                               \
  X(int64_t, step_table_bytes)                                                                  \
  X(int64_t, resident_state_bytes)                                                              \
  X(int64_t, batches)              /* batches through the staging arenas */                     \
  X(int64_t, split_params)                                                                      \
  X(int64_t, moved_bytes)          /* each way, per step */                                     \
  X(int64_t, finest_swap_times)                                                                 \
  X(std::vector<int64_t>, param_state_bytes)  /* per param, every key it keeps */              \
  X(int64_t, swapped_state_bytes)  /* exact, without the regions' alignment or the step table */ \
  X(py::tuple, batch_layout)       /* per batch, as SwapRuntime.batch_layout() lists it */      \
  X(int64_t, update_temporary_bytes)  /* device bytes the update allocates beside the arenas */

struct StagingSummary {
#define SWAP_DECLARE_FIELD(type, name) type name{};
  SWAP_STAGING_SUMMARY_FIELDS(SWAP_DECLARE_FIELD)
#undef SWAP_DECLARE_FIELD

  // The fields by name: for output that needs a dict (JSON), and the repr.
  py::dict as_dict() const {
    py::dict fields;
#define SWAP_FIELD_TO_DICT(type, name) fields[#name] = name;
    SWAP_STAGING_SUMMARY_FIELDS(SWAP_FIELD_TO_DICT)
#undef SWAP_FIELD_TO_DICT
    return fields;
  }

  // From keyword arguments, one per field (update_temporary_bytes may be left
  // out: 0); the batch layout may be any sequence.
  static StagingSummary from_fields(const py::kwargs& fields) {
    StagingSummary summary;
    size_t read = 0;
#define SWAP_FIELD_FROM_KWARGS(type, name)                                                              \
    if (fields.contains(#name)) {                                                                      \
      summary.name = field_from<type>(fields[#name]);                                                  \
      ++read;                                                                                          \
    } else {                                                                                           \
      TORCH_CHECK_VALUE(std::string(#name) == "update_temporary_bytes", "StagingSummary: no " #name); \
    }
    SWAP_STAGING_SUMMARY_FIELDS(SWAP_FIELD_FROM_KWARGS)
#undef SWAP_FIELD_FROM_KWARGS
    TORCH_CHECK_VALUE(read == fields.size(), "StagingSummary: unknown field(s) among ",
                      py::str(fields).cast<std::string>(), "; the fields are ",
                      py::str(summary.as_dict().attr("keys")()).cast<std::string>());
    return summary;
  }

 private:
  template <typename T>
  static T field_from(const py::handle& value) {
    if constexpr (std::is_same_v<T, py::tuple>) {
      return py::tuple(py::reinterpret_borrow<py::object>(value));
    } else {
      return value.cast<T>();
    }
  }
};

StagingSummary summary_of(const runtime::StoreLayout& layout, const std::vector<runtime::SlotSpec>& specs,
                          const KeyFlags& swap_keys, int64_t num_arenas) {
  StagingSummary summary;
  summary.host_state_bytes = layout.host_bytes;
  summary.staging_bytes = runtime::staging_bytes_of(layout, num_arenas);
  summary.largest_arena_bytes = layout.staging_arena_bytes;
  summary.step_table_bytes = layout.step_table_bytes;
  summary.resident_state_bytes = layout.resident_store_bytes;
  summary.batches = layout.rotating_batches;
  summary.split_params = layout.split_params;
  summary.moved_bytes = layout.moved_bytes;
  summary.finest_swap_times = runtime::finest_swap_times(specs);
  for (const runtime::SlotSpec& spec : specs) {
    int64_t bytes = 0;
    for (int key = 0; key < static_cast<int>(spec.states.size()); ++key) {
      if (!runtime::key_kept(spec, key)) continue;
      const int64_t key_bytes = runtime::key_bytes(spec, key, spec.numel);
      bytes += key_bytes;
      if (spec.swappable && swap_keys[key]) summary.swapped_state_bytes += key_bytes;
    }
    summary.param_state_bytes.push_back(bytes);
  }
  summary.batch_layout = py::tuple(batch_layout(layout));
  return summary;
}

// One state key of a param as Python declares it: (name, kind, unit bytes,
// dtype, shape); kind "absent", "element" (unit bytes per element), "block"
// (unit bytes per started block of kSplitGranule elements: an 8-bit state's
// scales, which a cut, on a granule boundary, shares out block by block) or
// "whole" (unit bytes in all).
using StateDeclaration = std::tuple<std::string, std::string, int64_t, c10::ScalarType, std::vector<int64_t>>;

runtime::StateLayout state_layout(const StateDeclaration& state) {
  const auto& [name, kind, unit_bytes, dtype, shape] = state;
  if (kind == "absent") return {};
  TORCH_CHECK_VALUE(unit_bytes >= 0, "SwapRuntime: state '", name, "' has negative bytes");
  if (kind == "element") return {runtime::StateKind::kPerElement, unit_bytes, 1};
  if (kind == "block") return {runtime::StateKind::kPerBlock, unit_bytes, runtime::kSplitGranule};
  TORCH_CHECK_VALUE(kind == "whole", "SwapRuntime: state kind must be 'absent', 'element', 'block' or 'whole', got '",
                    kind, "'");
  return {runtime::StateKind::kWhole, unit_bytes, 1};
}

// Another optimizer's slots as the store layout sees them, and the names,
// dtypes and shapes of their views.
std::vector<runtime::SlotSpec> rule_slot_specs(const std::vector<at::Tensor>& params,
                                               const std::vector<std::vector<StateDeclaration>>& states,
                                               const std::vector<bool>& swappable,
                                               const std::vector<bool>& splittable,
                                               std::vector<std::vector<runtime::StateDescription>>* descriptions) {
  TORCH_CHECK_VALUE(states.size() == params.size() && swappable.size() == params.size() &&
                        splittable.size() == params.size(),
                    "SwapRuntime: one list of states, one swappable and one splittable flag per param");
  std::vector<runtime::SlotSpec> specs;
  for (size_t i = 0; i < params.size(); ++i) {
    runtime::SlotSpec& spec = specs.emplace_back(
        runtime::SlotSpec{params[i].numel(), static_cast<bool>(swappable[i]), {}, static_cast<bool>(splittable[i])});
    std::vector<runtime::StateDescription>* described =
        descriptions != nullptr ? &descriptions->emplace_back() : nullptr;
    for (const StateDeclaration& state : states[i]) {
      spec.states.push_back(state_layout(state));
      if (described != nullptr) described->push_back({std::get<0>(state), std::get<3>(state), std::get<4>(state)});
    }
  }
  return specs;
}

// A Python update rule as the runtime calls it: it takes the GIL (the host
// backend's update thread calls it too), and what it raises fails the batch
// as a C++ error, so no Python object outlives the call. The function itself
// is released under the GIL, wherever the runtime drops it.
runtime::BatchUpdate python_batch_update(py::function update) {
  std::shared_ptr<py::function> held(new py::function(std::move(update)), [](py::function* function) {
    py::gil_scoped_acquire gil;
    delete function;
  });
  return [held](int64_t batch, const at::Tensor& arena, const std::vector<at::Tensor>& params,
                const std::vector<at::Tensor>& grads, const std::vector<runtime::RowViews>& views) {
    py::gil_scoped_acquire gil;
    py::list grad_list, view_list;
    for (const at::Tensor& grad : grads) grad_list.append(grad.defined() ? py::cast(grad) : py::none());
    for (const runtime::RowViews& row : views) {
      py::dict row_views;
      for (const auto& [key, view] : row) row_views[py::str(key)] = view;
      view_list.append(std::move(row_views));
    }
    try {
      (*held)(batch, arena, params, grad_list, view_list);
    } catch (py::error_already_set& error) {
      const std::string what = error.what();
      TORCH_CHECK(false, "SwapOptimizer: the update of batch ", batch, " failed: ", what);
    }
  };
}

// Runtimes being destroyed on threads of their own (DeleteWithoutGil). The
// interpreter's exit waits for them (wait_for_dropped_runtimes, which the
// Python layer runs at exit): destroying one takes the GIL to free its Python
// update rule, and a thread that takes the GIL once the interpreter is
// finalizing is ended in the middle of that destructor (std::terminate).
class DroppedRuntimes {
 public:
  static DroppedRuntimes& instance() {
    // A forked child has none of the parent's threads: it starts a fresh count.
    static std::once_flag fork_handler;
    std::call_once(fork_handler, [] { pthread_atfork(nullptr, nullptr, [] { current_ = new DroppedRuntimes(); }); });
    return *current_;
  }
  void destroy_on_own_thread(SwapRuntime* runtime) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++being_destroyed_;
    }
    std::thread([this, runtime] {
      delete runtime;
      std::lock_guard<std::mutex> lock(mutex_);
      if (--being_destroyed_ == 0) all_destroyed_.notify_all();
    }).detach();
  }
  void wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    all_destroyed_.wait(lock, [this] { return being_destroyed_ == 0; });
  }

 private:
  static DroppedRuntimes* current_;
  std::mutex mutex_;
  std::condition_variable all_destroyed_;
  int64_t being_destroyed_ = 0;
};
DroppedRuntimes* DroppedRuntimes::current_ = new DroppedRuntimes();  // never destroyed: threads use it at exit

// The runtime may hold a Python update rule that its update thread runs with
// the GIL: it is destroyed (which waits for that thread) without the GIL. Its
// last reference may go on that very thread (a garbage collection run by the
// rule's Python code): the deferred step it is running still needs it, so
// another thread destroys it once that step is done.
struct DeleteWithoutGil {
  void operator()(SwapRuntime* runtime) const {
    if (runtime->on_update_thread()) {
      DroppedRuntimes::instance().destroy_on_own_thread(runtime);
      return;
    }
    if (PyGILState_Check()) {
      py::gil_scoped_release no_gil;
      delete runtime;
    } else {
      delete runtime;
    }
  }
};
using RuntimeHolder = std::unique_ptr<SwapRuntime, DeleteWithoutGil>;

}  // namespace

void bind_runtime(py::module& module) {
  py::class_<StagingSummary> staging_summary(
      module, "StagingSummary",
      "What summarize_staging and summarize_rule_staging report of a store layout, read-only: host, staging and "
      "resident bytes, batches, split params, bytes moved each way, the finest swap_times, each param's state bytes, "
      "the swapped state bytes, the batch layout, and the device bytes the update allocates beside the arenas. "
      "StagingSummary(**fields) makes one (update_temporary_bytes may be left out).");
#define SWAP_BIND_FIELD(type, name) staging_summary.def_readonly(#name, &StagingSummary::name);
  SWAP_STAGING_SUMMARY_FIELDS(SWAP_BIND_FIELD)
#undef SWAP_BIND_FIELD
  staging_summary.def(py::init(&StagingSummary::from_fields))
      .def(
          "with_update_temporary_bytes",
          [](const StagingSummary& self, int64_t bytes) {
            StagingSummary summary = self;
            summary.update_temporary_bytes = bytes;
            return summary;
          },
          py::arg("bytes"), "A copy with update_temporary_bytes set.")
      .def("as_dict", &StagingSummary::as_dict, "The fields by name (for JSON output).")
      .def("__repr__", [](const StagingSummary& self) {
        return "StagingSummary(" + py::str(self.as_dict()).cast<std::string>() + ")";
      });

  py::class_<SwapRuntime, RuntimeHolder>(module, "SwapRuntime",
                          "Host store, staging arenas and packed pipeline of one SwapOptimizer.")
      .def(py::init([](std::vector<at::Tensor> params, std::vector<int64_t> group_of_param,
                       const std::vector<bool>& group_amsgrad, const std::vector<bool>& swappable,
                       int64_t swap_times, int64_t num_arenas,
                       std::optional<c10::ScalarType> state_dtype, bool master_weights,
                       bool pin_memory, bool keep_arenas, const std::vector<bool>& swap_keys,
                       bool kahan_summation, std::optional<int64_t> rounding_seed,
                       std::vector<int64_t> global_offsets, std::vector<bool> quantized_params,
                       std::vector<int64_t> resident_groups) {
             RuntimeOptions options = make_options(swap_times, num_arenas, state_dtype, master_weights, pin_memory,
                                                   keep_arenas, swap_keys,
                                                   {kahan_summation, rounding_seed, std::move(global_offsets),
                                                    std::move(quantized_params)});
             options.resident_groups = std::move(resident_groups);
             return RuntimeHolder(new SwapRuntime(std::move(params), std::move(group_of_param), group_amsgrad,
                                                  swappable, options));
           }),
           py::arg("params"), py::arg("group_of_param"), py::arg("group_amsgrad"),
           py::arg("swappable"), py::kw_only(), py::arg("swap_times"), py::arg("num_arenas"),
           py::arg("state_dtype"), py::arg("master_weights"), py::arg("pin_memory"),
           py::arg("keep_arenas"), py::arg("swap_keys"), py::arg("kahan_summation") = false,
           py::arg("rounding_seed") = py::none(), py::arg("global_offsets") = std::vector<int64_t>{},
           py::arg("quantized_params") = std::vector<bool>{}, py::arg("resident_groups") = std::vector<int64_t>{})
      .def(py::init([](std::vector<at::Tensor> params, const std::vector<std::vector<StateDeclaration>>& states,
                       const std::vector<bool>& swappable, const std::vector<bool>& splittable,
                       py::function update, int64_t swap_times, int64_t num_arenas, bool pin_memory,
                       bool keep_arenas, const std::vector<bool>& swap_keys, std::vector<int64_t> resident_groups) {
             std::vector<std::vector<runtime::StateDescription>> descriptions;
             std::vector<runtime::SlotSpec> specs =
                 rule_slot_specs(params, states, swappable, splittable, &descriptions);
             RuntimeOptions options =
                 make_options(swap_times, num_arenas, std::nullopt, false, pin_memory, keep_arenas, swap_keys);
             options.resident_groups = std::move(resident_groups);
             return RuntimeHolder(new SwapRuntime(std::move(params), std::move(specs), std::move(descriptions),
                                                  python_batch_update(std::move(update)), options));
           }),
           py::arg("params"), py::arg("states"), py::arg("swappable"), py::arg("splittable"), py::arg("update"),
           py::kw_only(), py::arg("swap_times"), py::arg("num_arenas"), py::arg("pin_memory"),
           py::arg("keep_arenas"), py::arg("swap_keys"), py::arg("resident_groups") = std::vector<int64_t>{},
           "Another optimizer's states: per param, one (name, kind, unit bytes, dtype, shape) per state key, "
           "and update(batch, arena, params, grads, views) runs each batch's update (views: per row, its states' "
           "views in the arena by store key; none for a row without a grad).")
      .def("state_views",
           [](const SwapRuntime& self, int64_t param) {
             py::dict views;
             for (auto& [name, tensor] : self.state_views(param)) views[py::str(name)] = tensor;
             return views;
           },
           py::arg("param"))
      .def("step",
           [](SwapRuntime& self, const std::vector<at::Tensor>& params,
              const std::vector<std::optional<at::Tensor>>& grads,
              const std::vector<GroupArgs>& groups, const std::optional<at::Tensor>& grad_scale,
              const std::optional<at::Tensor>& found_inf, bool deferred) {
             std::vector<PackedUpdateArgs> group_args;
             for (const auto& [lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled] : groups) {
               group_args.push_back({lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled});
             }
             // The batches run without the GIL; between batches it is taken back
             // to let a pending Ctrl-C stop the step.
             const std::function<void()> check_interrupt = [] {
               py::gil_scoped_acquire gil;
               if (PyErr_CheckSignals() != 0) throw py::error_already_set();
             };
             py::gil_scoped_release no_gil;
             self.step(params, grads, group_args, grad_scale, found_inf, check_interrupt, deferred);
           },
           py::arg("params"), py::arg("grads"), py::arg("groups"), py::arg("grad_scale") = py::none(),
           py::arg("found_inf") = py::none(), py::arg("deferred") = false)
      // Waits release the GIL (the host backend's update thread needs none, but
      // other Python threads may run); a Ctrl-C that came meanwhile is raised
      // here, once the wait is over.
      .def("wait_ready",
           [](SwapRuntime& self, int64_t position) {
             {
               py::gil_scoped_release no_gil;
               self.wait_ready(position);
             }
             if (PyErr_CheckSignals() != 0) throw py::error_already_set();
           },
           py::arg("position"),
           "The current stream waits for the batch at this pipeline position of the deferred step (CUDA: no host "
           "sync; CPU: blocks); raises what stopped the step.")
      .def("deferred_step_updated", &SwapRuntime::deferred_step_updated,
           "Whether every batch of the deferred step (True: none) has been updated, without waiting (CUDA: an event "
           "query, no host sync; False while another thread holds the runtime).")
      .def("wait_step",
           [](SwapRuntime& self) {
             {
               py::gil_scoped_release no_gil;
               self.wait_step();
             }
             if (PyErr_CheckSignals() != 0) throw py::error_already_set();
           },
           "The current stream waits for the whole deferred step; raises what stopped it.")
      .def("set_batch_order", &SwapRuntime::set_batch_order, py::arg("rank_of_param"),
           py::call_guard<py::gil_scoped_release>(),
           "Runs batches in the order of their params' ranks (chains of cut params move whole).")
      .def("on_update_thread", &SwapRuntime::on_update_thread,
           "Whether the caller is the thread that runs deferred steps' updates (host backend), which cannot "
           "wait for them.")
      .def("has_deferred_step", &SwapRuntime::has_deferred_step, py::call_guard<py::gil_scoped_release>(),
           "Whether a deferred step has not been waited for yet.")
      .def("pipeline_order", &SwapRuntime::pipeline_order, py::call_guard<py::gil_scoped_release>(),
           "The layout index of the batch at each pipeline position.")
      .def("enable_timeline", &SwapRuntime::enable_timeline, py::arg("enabled"),
           py::call_guard<py::gil_scoped_release>(), "Benchmark only: note each batch's copy and update times.")
      .def("timeline", &SwapRuntime::timeline, py::call_guard<py::gil_scoped_release>(),
           "Benchmark only: (lane, position, start, end) seconds after the last step began.")
      .def("synchronize",
           [](SwapRuntime& self) {
             py::gil_scoped_release no_gil;
             self.synchronize();
           },
           "Blocks until the host store holds the last step's results.")
      .def("memory_stats",
           [](const SwapRuntime& self) {
             const runtime::MemoryStats s = self.memory_stats();
             py::dict stats;
             stats["host_state_bytes"] = s.host_state_bytes;
             stats["pinned"] = s.pinned;
             stats["staging_bytes"] = s.staging_bytes;
             stats["peak_staging_bytes"] = s.peak_staging_bytes;
             stats["step_table_bytes"] = s.step_table_bytes;
             stats["resident_state_bytes"] = s.resident_state_bytes;
             stats["h2d_bytes"] = s.h2d_bytes;
             stats["d2h_bytes"] = s.d2h_bytes;
             stats["batches"] = s.batches;
             stats["num_arenas"] = s.num_arenas;
             stats["split_params"] = s.split_params;
             stats["unpinned_host_bytes"] = s.unpinned_host_bytes;
             stats["held_grad_bytes"] = s.held_grad_bytes;
             // What one swapped param element costs the link, states, scales and step table included.
             stats["bytes_per_param_each_way"] =
                 s.swapped_elements > 0 ? static_cast<double>(self.layout().moved_bytes) / s.swapped_elements : 0.0;
             return stats;
           })
      .def("set_rounding_seed", &SwapRuntime::set_rounding_seed, py::arg("seed"),
           py::call_guard<py::gil_scoped_release>(),
           "Reseeds the stochastic rounding of bf16 moments (a loaded checkpoint's seed).")
      .def("batch_layout", [](const SwapRuntime& self) { return batch_layout(self.layout()); },
           "The batches in pipeline order: param indices, pieces (param, element offset, count), the bytes "
           "each moves each way and its arena bytes.")
      .def("order_writes", &SwapRuntime::order_writes, py::call_guard<py::gil_scoped_release>(),
           "Orders writes made to the stores on the current stream before the next step, on any stream.")
      .def("torn_params", &SwapRuntime::torn_params, py::call_guard<py::gil_scoped_release>(),
           "Params a failed step left partly updated; step() refuses to run while there are any.")
      .def(
          "clear_torn",
          [](SwapRuntime& self) {
            py::gil_scoped_release no_gil;
            self.clear_torn();
          },
          "Forgets torn params once their state has been rewritten (a loaded checkpoint).")
      .def("set_test_hooks",
           [](SwapRuntime& self, int64_t copy_delay_us, uint64_t seed,
              const std::optional<std::string>& fault, int64_t fault_batch, int64_t simulated_free_bytes,
              int64_t compute_delay_us) {
             const runtime::TestHooks hooks{copy_delay_us, seed, parse_fault(fault), fault_batch, simulated_free_bytes,
                                            compute_delay_us};
             py::gil_scoped_release no_gil;  // it may wait for a deferred step
             self.set_test_hooks(hooks);
           },
           py::arg("copy_delay_us") = 0, py::arg("seed") = 0, py::arg("fault") = py::none(),
           py::arg("fault_batch") = -1, py::arg("simulated_free_bytes") = -1, py::arg("compute_delay_us") = 0,
           "Test only: random delays of up to copy_delay_us before each copy and of up to compute_delay_us on the "
           "compute queue before each batch's update (both backends, seeded by seed), one injected failure, and "
           "arenas allocated as if the device had simulated_free_bytes free.");

  module.def(
      "wait_for_dropped_runtimes",
      [] {
        py::gil_scoped_release no_gil;
        DroppedRuntimes::instance().wait();
      },
      "Waits until every runtime whose last reference went on its own update thread is destroyed (the Python "
      "layer runs it at exit, before the interpreter finalizes).");

  module.def("_simulate_pin_failure", &runtime::simulate_pin_failure, py::arg("enabled"),
             "Test only: while enabled, pinning host memory fails as if the driver refused it.");

  module.def(
      "free_device_bytes",
      [](const c10::Device& device) {
        py::gil_scoped_release no_gil;
        return runtime::free_device_bytes(device);
      },
      py::arg("device"),
      "Bytes a new allocation could take on `device`: on CUDA the driver's free memory plus the caching "
      "allocator's cached free blocks; on the CPU the free physical memory.");

  module.def(
      "measure_copy_bandwidth",
      [](const c10::Device& device, int64_t bytes, int repeats) {
        py::gil_scoped_release no_gil;
        const runtime::CopyBandwidth bandwidth = runtime::measure_copy_bandwidth(device, bytes, repeats);
        return std::make_tuple(bandwidth.host_to_device, bandwidth.device_to_host, bandwidth.both_directions);
      },
      py::arg("device"), py::arg("bytes"), py::arg("repeats"),
      "(host to device, device to host, both at once) in bytes per second through the runtime's own "
      "transport and host memory, median of `repeats` copies of `bytes`.");

  module.def(
      "summarize_staging",
      [](const std::vector<at::Tensor>& params, const std::vector<int64_t>& group_of_param,
         const std::vector<bool>& group_amsgrad, const std::vector<bool>& swappable, int64_t swap_times,
         int64_t num_arenas, std::optional<c10::ScalarType> state_dtype, bool master_weights,
         const std::vector<bool>& swap_keys, bool kahan_summation, const std::vector<bool>& quantized_params) {
        const RuntimeOptions options = make_options(swap_times, num_arenas, state_dtype, master_weights, true,
                                                    false, swap_keys,
                                                    {kahan_summation, std::nullopt, {}, quantized_params});
        const std::vector<runtime::SlotSpec> specs =
            runtime::make_slot_specs(params, group_of_param, group_amsgrad, swappable, options);
        return summary_of(runtime::lay_out_store(specs, options.swap_keys, swap_times, runtime::kAdamStepBytes), specs,
                          options.swap_keys, num_arenas);
      },
      py::arg("params"), py::arg("group_of_param"), py::arg("group_amsgrad"), py::arg("swappable"),
      py::kw_only(), py::arg("swap_times"), py::arg("num_arenas"), py::arg("state_dtype"),
      py::arg("master_weights"), py::arg("swap_keys"), py::arg("kahan_summation") = false,
      py::arg("quantized_params") = std::vector<bool>{},
      "The layout a SwapRuntime would use, without allocating it: host, staging and resident bytes, batches, "
      "split params, bytes moved each way, the finest swap_times, each param's state bytes and the batch layout. "
      "Params may be meta tensors (only numel and dtype are read); quantized_params as for SwapRuntime.");

  module.def(
      "summarize_rule_staging",
      [](const std::vector<at::Tensor>& params, const std::vector<std::vector<StateDeclaration>>& states,
         const std::vector<bool>& swappable, const std::vector<bool>& splittable, const std::vector<bool>& swap_keys,
         int64_t swap_times, int64_t num_arenas) {
        const RuntimeOptions options = make_options(swap_times, num_arenas, std::nullopt, false, true, false,
                                                    swap_keys);
        const std::vector<runtime::SlotSpec> specs = rule_slot_specs(params, states, swappable, splittable, nullptr);
        return summary_of(runtime::lay_out_store(specs, options.swap_keys, swap_times, 0), specs, options.swap_keys,
                          num_arenas);
      },
      py::arg("params"), py::arg("states"), py::arg("swappable"), py::arg("splittable"), py::arg("swap_keys"),
      py::kw_only(), py::arg("swap_times"), py::arg("num_arenas"),
      "As summarize_staging, for another optimizer's states (declared as for SwapRuntime's second constructor), "
      "nothing allocated.");

  module.def(
      "smallest_swap_times_for_budget",
      [](const std::vector<at::Tensor>& params, const std::vector<int64_t>& group_of_param,
         const std::vector<bool>& group_amsgrad, const std::vector<bool>& swappable,
         std::optional<c10::ScalarType> state_dtype, bool master_weights,
         const std::vector<bool>& swap_keys, int64_t num_arenas, int64_t budget_bytes, bool kahan_summation) {
        const RuntimeOptions options = make_options(1, num_arenas, state_dtype, master_weights, true, false,
                                                    swap_keys, {kahan_summation, std::nullopt, {}, {}});
        int64_t smallest_possible = 0;
        const int64_t swap_times = runtime::smallest_swap_times_for_budget(
            runtime::make_slot_specs(params, group_of_param, group_amsgrad, swappable, options),
            options.swap_keys, runtime::kAdamStepBytes, num_arenas, budget_bytes, &smallest_possible);
        return std::make_tuple(swap_times, smallest_possible);
      },
      py::arg("params"), py::arg("group_of_param"), py::arg("group_amsgrad"), py::arg("swappable"),
      py::kw_only(), py::arg("state_dtype"), py::arg("master_weights"), py::arg("swap_keys"),
      py::arg("num_arenas"), py::arg("budget_bytes"), py::arg("kahan_summation") = false,
      "(swap_times, smallest staging bytes possible): swap_times is -1 when nothing fits.");

  module.def(
      "code_maps",
      [] {
        const CodeMaps& maps = code_maps();
        auto values = [](const CodeMap& map) {
          return at::tensor(c10::ArrayRef<float>(map.values, kCodes)).clone();
        };
        return std::make_tuple(values(maps.signed_map), values(maps.unsigned_map));
      },
      "(signed, unsigned): the 256 values of the 8-bit code maps (exp_avg; exp_avg_sq and max_exp_avg_sq).");
}

}  // namespace swap_optimizer
