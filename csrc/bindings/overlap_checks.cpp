#include "overlap_checks.h"

#include <algorithm>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_set>
#include <utility>
#include <vector>

#include <torch/csrc/autograd/python_variable.h>

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
}

}  // namespace swap_optimizer
