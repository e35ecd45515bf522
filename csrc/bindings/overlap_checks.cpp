#include "overlap_checks.h"

#include <algorithm>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_set>
#include <utility>
#include <vector>

#include <torch/csrc/autograd/python_variable.h>

#include "../runtime/swap_runtime.h"

namespace swap_optimizer {
namespace {

namespace py = pybind11;

// [first, last + 1) bytes a tensor's elements occupy; none where it has no
// storage to read (meta, sparse, empty, a subclass without one).
std::optional<std::pair<int64_t, int64_t>> byte_span(const at::Tensor& tensor) {
  try {  // (a tensor whose data or sizes cannot be read: functional, fake, symbolic)
    if (tensor.layout() != at::kStrided || tensor.is_meta() || tensor.numel() == 0 || !tensor.has_storage()) {
      return std::nullopt;
    }
    const int64_t begin = reinterpret_cast<int64_t>(tensor.data_ptr());
    int64_t extent = 1;
    const auto sizes = tensor.sizes();
    const auto strides = tensor.strides();
    for (size_t d = 0; d < sizes.size(); ++d) extent += (sizes[d] - 1) * strides[d];
    return std::make_pair(begin, begin + extent * static_cast<int64_t>(tensor.element_size()));
  } catch (const c10::Error&) {
    return std::nullopt;
  }
}

// Which of some tensors (tags, by their bytes on one device type) an op's
// tensors touch: spans sorted by their first byte, with the greatest end so
// far, so that a lookup is a bisection and a walk back over the overlapping ones.
class SpanIndex {
 public:
  SpanIndex(const std::vector<std::pair<at::Tensor, int64_t>>& tagged, c10::DeviceType device_type)
      : device_type_(device_type) {
    std::vector<std::tuple<int64_t, int64_t, int64_t>> spans;
    for (const auto& [tensor, tag] : tagged) {
      if (const auto span = byte_span(tensor)) spans.emplace_back(span->first, span->second, tag);
    }
    std::sort(spans.begin(), spans.end());
    for (const auto& [begin, end, tag] : spans) {
      begins_.push_back(begin);
      ends_.push_back(end);
      tags_.push_back(tag);
      reach_.push_back(reach_.empty() ? end : std::max(end, reach_.back()));
    }
  }

  // The tags whose spans the tensors among args and kwargs touch, also inside
  // lists and tuples (foreach ops, torch.cat, RNNs' flat weights) unless
  // `lists` is false (a test's knocked-out rule). In the order found; a tag
  // may repeat.
  // (args: a tuple or any iterable; kwargs: a dict, any mapping or None)
  std::vector<int64_t> touched(const py::handle& args, const py::handle& kwargs, bool lists) const {
    std::vector<int64_t> tags;
    if (begins_.empty()) return tags;
    auto visit = [&](PyObject* value) {
      if (THPVariable_Check(value)) {
        add(THPVariable_Unpack(value), tags);
      } else if (lists && (PyList_Check(value) || PyTuple_Check(value))) {
        const py::sequence items = py::reinterpret_borrow<py::sequence>(value);
        for (const py::handle item : items) {
          if (THPVariable_Check(item.ptr())) add(THPVariable_Unpack(item.ptr()), tags);
        }
      }
    };
    for (const py::handle value : py::reinterpret_borrow<py::iterable>(args)) visit(value.ptr());
    if (PyDict_Check(kwargs.ptr())) {
      for (const auto& [key, value] : py::reinterpret_borrow<py::dict>(kwargs)) visit(value.ptr());
    } else if (!kwargs.is_none()) {
      for (const py::handle value : kwargs.attr("values")()) visit(value.ptr());
    }
    return tags;
  }

 private:
  void add(const at::Tensor& tensor, std::vector<int64_t>& tags) const {
    if (tensor.device().type() != device_type_) return;
    const auto span = byte_span(tensor);
    if (!span) return;
    const auto [begin, end] = *span;
    int64_t i = static_cast<int64_t>(std::lower_bound(begins_.begin(), begins_.end(), end) - begins_.begin()) - 1;
    for (; i >= 0 && reach_[i] > begin; --i) {
      if (ends_[i] > begin) tags.push_back(tags_[i]);
    }
  }

  c10::DeviceType device_type_;
  std::vector<int64_t> begins_, ends_, tags_;
  std::vector<int64_t> reach_;  // the greatest end among spans [0, i]
};

// What a pass checks of each op on the stepping thread (the read watch,
// guard.py), decided without Python for the ops that need nothing: an op
// needs the watch's Python check when its name is one that check decides
// (attribute access, backward), or it touches a span of the pass, or the
// pending step is updated (the check then ends the pass). Metadata reads and
// ops on other tensors run at once: the bulk of another model's forward.
class PassChecks {
 public:
  PassChecks(py::object metadata_names, py::object checked_names)
      : metadata_names_(std::move(metadata_names)), checked_names_(std::move(checked_names)) {
    TORCH_CHECK_TYPE(PyAnySet_Check(metadata_names_.ptr()) && PyAnySet_Check(checked_names_.ptr()),
                     "PassChecks: the names must be sets");
  }

  bool needs_check(const py::handle& func, const py::handle& args, const py::handle& kwargs) const {
    static PyObject* const name_key = PyUnicode_InternFromString("__name__");  // (never freed)
    const py::object name = py::reinterpret_steal<py::object>(PyObject_GetAttr(func.ptr(), name_key));
    if (!name) {
      PyErr_Clear();  // (no name: an op like any other, as getattr(func, "__name__", "") reads it)
    } else if (PyUnicode_Check(name.ptr())) {
      if (contains(metadata_names_, name)) return false;
      if (contains(checked_names_, name)) return true;
    }
    // (held here: the lookup may run Python, a signal handler's or another
    // thread's, which may end the pass and let go of its spans and runtime)
    const py::object spans = spans_, runtime = runtime_object_;
    if (spans.is_none()) return false;
    if (!spans.cast<const SpanIndex*>()->touched(args, kwargs, lists).empty()) return true;
    return !runtime.is_none() && !keep_watching && runtime.cast<runtime::SwapRuntime*>()->deferred_step_updated();
  }

  py::object spans() const { return spans_; }
  void set_spans(const py::object& spans) {
    if (!spans.is_none()) (void)spans.cast<const SpanIndex*>();  // (a wrong type is refused here, not at an op)
    spans_ = spans;
  }
  py::object runtime() const { return runtime_object_; }
  void set_runtime(const py::object& runtime) {
    if (!runtime.is_none()) (void)runtime.cast<runtime::SwapRuntime*>();
    runtime_object_ = runtime;
  }

  bool lists = true;           // a test's knocked-out rule: false looks at no list's tensors
  bool keep_watching = false;  // a test hook: an updated step does not end the pass

 private:
  static bool contains(const py::object& names, const py::object& name) {
    const int found = PySet_Contains(names.ptr(), name.ptr());
    if (found < 0) throw py::error_already_set();
    return found == 1;
  }

  py::object metadata_names_, checked_names_;
  py::object spans_ = py::none();  // the pass's SpanIndex, or None (no pass: only the names above are checked)
  py::object runtime_object_ = py::none();  // the pending step's runtime, or None
};

// One read watch's __torch_function__ body: runs each op, first through the
// watch's Python check where its pass's checks say it needs one, and counts
// per thread the watch's calls in progress (torch holds a mode off its stack
// during its own call, so it can be neither taken off nor pushed then).
class WatchCalls {
 public:
  explicit WatchCalls(py::object checks) : checks_(std::move(checks)) {}

  py::object call(const py::handle& func, const py::handle& args, const py::handle& kwargs,
                  const py::handle& check) {
    TORCH_CHECK_TYPE(kwargs.is_none() || PyDict_Check(kwargs.ptr()), "WatchCalls.call: kwargs must be a dict or None");
    const py::tuple positional = PyTuple_Check(args.ptr()) ? py::reinterpret_borrow<py::tuple>(args)
                                                           : py::tuple(py::reinterpret_borrow<py::object>(args));
    PyObject* const named = kwargs.is_none() ? nullptr : kwargs.ptr();
    const py::object held_checks = checks_;  // (retire() may run during the check)
    const bool checked = !held_checks.is_none() &&
                         held_checks.cast<const PassChecks*>()->needs_check(func, positional, kwargs);
    const InCall in_call(*this);
    if (checked) check(func, positional, kwargs);
    PyObject* result = PyObject_Call(func.ptr(), positional.ptr(), named);
    if (result == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(result);
  }

  bool running_here() const {
    const auto here = std::this_thread::get_id();
    return std::any_of(depths_.begin(), depths_.end(), [&](const auto& entry) { return entry.first == here; });
  }

  void retire() { checks_ = py::none(); }  // inert: every op runs at once

 private:
  // (the GIL guards depths_: every call runs with it held)
  struct InCall {
    explicit InCall(WatchCalls& calls) : calls_(calls) {
      const auto here = std::this_thread::get_id();
      for (auto& [thread, depth] : calls_.depths_) {
        if (thread == here) {
          ++depth;
          return;
        }
      }
      calls_.depths_.emplace_back(here, 1);
    }
    ~InCall() {
      const auto here = std::this_thread::get_id();
      for (auto entry = calls_.depths_.begin(); entry != calls_.depths_.end(); ++entry) {
        if (entry->first != here) continue;
        if (--entry->second == 0) calls_.depths_.erase(entry);
        return;
      }
    }
    WatchCalls& calls_;
  };

  py::object checks_;  // its pass's PassChecks, None once retired
  std::vector<std::pair<std::thread::id, int>> depths_;  // threads with a call in progress
};

// The module tree below `module`, each module once in the order
// nn.Module.modules() visits it: per module its identity, whether it is
// compiled in place (`_compiled_call_impl` set) and the identities of the
// params it holds itself (`_parameters`), then a separator. Read from the
// module's __dict__ as torch_internals.py names it (torch 2.11-2.14).
// The attribute names, made once (a lookup by a C string makes a Python string each time).
struct StructureKeys {
  py::str compiled = py::str("_compiled_call_impl");
  py::str parameters = py::str("_parameters");
  py::str modules = py::str("_modules");
};

// The values of a module's mapping `name`: a dict's, or those of the mapping a
// scripted module (torch.jit.script) keeps there instead. A module without it
// is refused, naming it, rather than walked as if it had none.
py::list module_values(const py::dict& attributes, const py::str& name) {
  PyObject* value = PyDict_GetItem(attributes.ptr(), name.ptr());  // borrowed
  if (value == nullptr) {
    throw py::type_error("swap_optimizer: an nn.Module without `" + std::string(name) + "` (torch changed its " +
                         "internals; overlap_forward relies on them: use overlap_forward=False)");
  }
  if (PyDict_Check(value)) return py::reinterpret_steal<py::list>(PyDict_Values(value));
  return py::list(py::reinterpret_borrow<py::object>(value).attr("values")());
}

void append_structure(PyObject* module, const StructureKeys& keys, std::vector<int64_t>& out,
                      std::unordered_set<PyObject*>& seen) {
  if (!seen.insert(module).second) return;
  const py::dict attributes = py::reinterpret_steal<py::dict>(PyObject_GenericGetDict(module, nullptr));
  if (!attributes) throw py::error_already_set();
  out.push_back(reinterpret_cast<int64_t>(module));
  PyObject* compiled = PyDict_GetItem(attributes.ptr(), keys.compiled.ptr());  // absent: not compiled
  out.push_back(compiled != nullptr && compiled != Py_None ? 1 : 0);
  for (const py::handle param : module_values(attributes, keys.parameters)) {
    if (!param.is_none()) out.push_back(reinterpret_cast<int64_t>(param.ptr()));
  }
  out.push_back(0);  // (no object lies at address 0)
  for (const py::handle child : module_values(attributes, keys.modules)) {
    if (!child.is_none()) append_structure(child.ptr(), keys, out, seen);
  }
}

// A torch function mode's __torch_function__ (bound to the mode by
// types.MethodType) that only calls the op: (mode, func, types, args=(),
// kwargs=None). The bench's floor for any read watch (bench/host_overhead.py):
// torch's dispatch to a mode, with no Python frame of the mode's own.
PyObject* torch_function_call_through(PyObject* /*self*/, PyObject* const* args, Py_ssize_t count) {
  if (count < 3 || count > 5) {
    PyErr_SetString(PyExc_TypeError, "torch_function_call_through(mode, func, types, args=(), kwargs=None)");
    return nullptr;
  }
  PyObject* func = args[1];
  PyObject* kwargs = count == 5 && args[4] != Py_None ? args[4] : nullptr;
  if ((count >= 4 && !PyTuple_Check(args[3])) || (kwargs != nullptr && !PyDict_Check(kwargs))) {
    PyErr_SetString(PyExc_TypeError, "torch_function_call_through: args must be a tuple and kwargs a dict or None");
    return nullptr;
  }
  if (count < 4) return PyObject_Call(func, py::tuple().ptr(), kwargs);
  return PyObject_Call(func, args[3], kwargs);
}

PyMethodDef kCallThrough = {
    "torch_function_call_through",
    reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&torch_function_call_through)), METH_FASTCALL,
    "(mode, func, types, args=(), kwargs=None) -> func(*args, **kwargs): a torch function mode's __torch_function__ "
    "in C that only calls the op (bind it with types.MethodType), the floor of any read watch."};

}  // namespace

void bind_overlap_checks(py::module& module) {
  PyObject* call_through = PyCFunction_NewEx(&kCallThrough, nullptr, nullptr);
  if (call_through == nullptr) throw py::error_already_set();
  module.add_object("torch_function_call_through", py::reinterpret_steal<py::object>(call_through));
  module.def(
      "module_structure",
      [](const py::handle& model) {
        static const StructureKeys* keys = new StructureKeys();  // (never freed: it outlives the interpreter's end)
        std::vector<int64_t> out;
        std::unordered_set<PyObject*> seen;
        append_structure(model.ptr(), *keys, out, seen);
        return py::bytes(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(int64_t));
      },
      py::arg("model"),
      "The model's modules (each once, as modules() visits them), whether each is compiled in place and the params "
      "it holds itself, by identity, as bytes: two are equal while none of it changed.");
  py::class_<SpanIndex>(module, "SpanIndex",
                        "Which of some tensors (by their bytes on one device type) an op's tensors touch.")
      .def(py::init([](const std::vector<std::pair<at::Tensor, int64_t>>& tagged, const c10::Device& device) {
             return SpanIndex(tagged, device.type());
           }),
           py::arg("tagged"), py::arg("device"), "tagged: (tensor, tag) pairs; device: the only device type looked at.")
      .def("touched", &SpanIndex::touched, py::arg("args"), py::arg("kwargs"), py::arg("lists") = true,
           "The tags whose bytes the tensors among args and kwargs touch (inside lists and tuples too, unless "
           "lists=False).");
  py::class_<PassChecks>(module, "PassChecks",
                         "What an overlap pass checks of each op on the stepping thread: which ops need the read "
                         "watch's Python check.")
      .def(py::init<py::object, py::object>(), py::arg("metadata_names"), py::arg("checked_names"),
           "metadata_names: ops that never need a check; checked_names: ops whose check only Python decides.")
      .def_property("spans", &PassChecks::spans, &PassChecks::set_spans, "The pass's SpanIndex, or None.")
      .def_property("runtime", &PassChecks::runtime, &PassChecks::set_runtime,
                    "The pending step's SwapRuntime, or None: once its step is updated, an op needs the check.")
      .def_readwrite("lists", &PassChecks::lists)
      .def_readwrite("keep_watching", &PassChecks::keep_watching)
      .def("needs_check", &PassChecks::needs_check, py::arg("func"), py::arg("args"), py::arg("kwargs"),
           "Whether the op needs the watch's Python check.");
  py::class_<WatchCalls>(module, "WatchCalls", "A read watch's __torch_function__ body.")
      .def(py::init<py::object>(), py::arg("checks"))
      .def("call", &WatchCalls::call, py::arg("func"), py::arg("args"), py::arg("kwargs"), py::arg("check"),
           "func(*args, **kwargs), after check(func, args, kwargs) where the checks say the op needs it.")
      .def("running_here", &WatchCalls::running_here, "Whether a call of this watch is in progress on this thread.")
      .def("retire", &WatchCalls::retire, "From now on every op runs at once.");
}

}  // namespace swap_optimizer
