#include "step_checks.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <torch/csrc/autograd/python_variable.h>

namespace swap_optimizer {
namespace {

namespace py = pybind11;

py::bytes as_bytes(const std::vector<int64_t>& words) {
  return py::bytes(reinterpret_cast<const char*>(words.data()), words.size() * sizeof(int64_t));
}

// The items of a list, tuple or other iterable, held while they are read (a
// getter that runs Python may change the sequence meanwhile).
py::list items_of(const py::handle& sequence) {
  PyObject* items = PySequence_List(sequence.ptr());
  if (items == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::list>(items);
}

// Each tensor's dtype and shape, as bytes: two are equal while none changed
// (the dim count separates the shapes). None where an item is no tensor or
// has no plain sizes (nested, symbolic): the caller's Python reads those.
py::object tensor_signature(const py::handle& tensors) {
  const py::list items = items_of(tensors);
  std::vector<int64_t> words;
  words.reserve(items.size() * 4);
  for (const py::handle item : items) {
    if (!THPVariable_Check(item.ptr())) return py::none();
    const at::Tensor& tensor = THPVariable_Unpack(item.ptr());
    if (tensor.is_nested() || tensor.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return py::none();
    const auto sizes = tensor.sizes();
    words.push_back(static_cast<int64_t>(tensor.scalar_type()));
    words.push_back(static_cast<int64_t>(sizes.size()));
    words.insert(words.end(), sizes.begin(), sizes.end());
  }
  return as_bytes(words);
}

// Each tensor's data_ptr(), as bytes (equal while no .data was replaced).
py::bytes data_pointers(const py::handle& tensors) {
  const py::list items = items_of(tensors);
  std::vector<int64_t> words;
  words.reserve(items.size());
  for (const py::handle item : items) {
    TORCH_CHECK_TYPE(THPVariable_Check(item.ptr()), "data_pointers: expected tensors, got ",
                     Py_TYPE(item.ptr())->tp_name);
    words.push_back(reinterpret_cast<int64_t>(THPVariable_Unpack(item.ptr()).data_ptr()));
  }
  return as_bytes(words);
}

// Each param's .grad (read as Python reads it: a subclass's getter runs), and
// the index of the first sparse one (-1: none).
py::tuple grads_of(const py::handle& params) {
  static PyObject* const grad_name = PyUnicode_InternFromString("grad");  // (never freed)
  const py::list items = items_of(params);
  py::list grads(items.size());
  int64_t first_sparse = -1;
  for (size_t index = 0; index < items.size(); ++index) {
    py::object grad = py::reinterpret_steal<py::object>(PyObject_GetAttr(items[index].ptr(), grad_name));
    if (!grad) throw py::error_already_set();
    if (first_sparse < 0 && THPVariable_Check(grad.ptr()) && THPVariable_Unpack(grad.ptr()).is_sparse()) {
      first_sparse = static_cast<int64_t>(index);
    }
    grads[index] = std::move(grad);
  }
  return py::make_tuple(std::move(grads), first_sparse);
}

// What shows an in-place change of a value, appended to `out`: a tensor's
// identity and version; a list's or tuple's members, a dict's keys and
// values, a set's members (each by identity, a tensor by identity and
// version); any other object's identity. A str key is written by value (an
// equal dict rebuilt around the same values shows no change), any other key
// by identity (an equal key that is another object shows one: a refusal,
// never a missed change).
enum class Shown : int64_t { kObject, kTensor, kSequence, kMapping, kSet };

void append_word(std::string* out, int64_t word) { out->append(reinterpret_cast<const char*>(&word), sizeof(word)); }

// Writes `object`'s identity; where `held` is a list, appends the object to it
// too (a caller that keeps `held` while it compares keeps every identity it
// was shown from being reused by another object).
void append_identity(std::string* out, PyObject* held, PyObject* object) {
  append_word(out, reinterpret_cast<int64_t>(object));
  if (held != nullptr && PyList_Append(held, object) != 0) throw py::error_already_set();
}

void append_member(std::string* out, PyObject* held, PyObject* member) {
  if (THPVariable_Check(member)) {
    append_word(out, static_cast<int64_t>(Shown::kTensor));
    append_identity(out, held, member);
    append_word(out, static_cast<int64_t>(THPVariable_Unpack(member)._version()));
  } else {
    append_word(out, static_cast<int64_t>(Shown::kObject));
    append_identity(out, held, member);
  }
}

void append_fingerprint(std::string* out, PyObject* held, PyObject* value) {
  if (THPVariable_Check(value)) {
    append_member(out, held, value);
  } else if (PyList_Check(value) || PyTuple_Check(value)) {
    const py::list members = items_of(value);  // (held: a list may change while it is read)
    append_word(out, static_cast<int64_t>(Shown::kSequence));
    append_word(out, static_cast<int64_t>(members.size()));
    for (const py::handle member : members) append_member(out, held, member.ptr());
  } else if (PyDict_Check(value)) {
    const py::list items = py::reinterpret_steal<py::list>(PyDict_Items(value));
    if (!items) throw py::error_already_set();
    append_word(out, static_cast<int64_t>(Shown::kMapping));
    append_word(out, static_cast<int64_t>(items.size()));
    for (const py::handle item : items) {
      PyObject* key = PyTuple_GET_ITEM(item.ptr(), 0);
      Py_ssize_t size = 0;
      const char* text = PyUnicode_Check(key) ? PyUnicode_AsUTF8AndSize(key, &size) : nullptr;
      if (text == nullptr && PyUnicode_Check(key)) PyErr_Clear();  // (a lone surrogate: by identity, as below)
      if (text != nullptr) {
        append_word(out, static_cast<int64_t>(size));
        out->append(text, size);
      } else {
        append_word(out, -1);
        append_identity(out, held, key);
      }
      append_member(out, held, PyTuple_GET_ITEM(item.ptr(), 1));
    }
  } else if (PySet_Check(value)) {
    const py::list members = items_of(value);
    std::vector<PyObject*> identities;
    for (const py::handle member : members) identities.push_back(member.ptr());
    std::sort(identities.begin(), identities.end(), std::less<PyObject*>());  // (a set has no order)
    append_word(out, static_cast<int64_t>(Shown::kSet));
    append_word(out, static_cast<int64_t>(identities.size()));
    for (PyObject* identity : identities) append_identity(out, held, identity);
  } else {
    append_word(out, static_cast<int64_t>(Shown::kObject));
    append_identity(out, held, value);
  }
}

// `held`: None, or a list that gets every object a fingerprint names by identity.
PyObject* held_list(const py::handle& held) {
  if (held.is_none()) return nullptr;
  TORCH_CHECK_TYPE(PyList_Check(held.ptr()), "fingerprint: held must be a list or None, got ", Py_TYPE(held.ptr())->tp_name);
  return held.ptr();
}

py::bytes fingerprint(const py::handle& value, const py::handle& held) {
  std::string out;
  append_fingerprint(&out, held_list(held), value.ptr());
  return py::bytes(out);
}

// {key: fingerprint(value)} over a dict's items, but those under `excluded`
// (a container of keys).
py::dict fingerprints(const py::handle& mapping, const py::handle& excluded, const py::handle& held) {
  TORCH_CHECK_TYPE(PyDict_Check(mapping.ptr()), "fingerprints: expected a dict, got ", Py_TYPE(mapping.ptr())->tp_name);
  const py::list items = py::reinterpret_steal<py::list>(PyDict_Items(mapping.ptr()));
  if (!items) throw py::error_already_set();
  PyObject* const held_objects = held_list(held);
  py::dict shown;
  std::string out;
  for (const py::handle item : items) {
    PyObject* key = PyTuple_GET_ITEM(item.ptr(), 0);
    const int skipped = PySequence_Contains(excluded.ptr(), key);
    if (skipped < 0) throw py::error_already_set();
    if (skipped) continue;
    out.clear();
    append_fingerprint(&out, held_objects, PyTuple_GET_ITEM(item.ptr(), 1));
    shown[key] = py::bytes(out);
  }
  return shown;
}

// Whether `object` is a plain tensor or an nn.Parameter, and no tensor
// subclass: a subclass's detach() or .grad may run Python of its own, which
// only the Python walk runs as the class's step would see it.
bool plain_tensor(PyObject* object) {
  static PyObject* const parameter_class = [] {  // (never freed)
    py::object module = py::module_::import("torch.nn.parameter");
    return py::object(module.attr("Parameter")).release().ptr();
  }();
  const PyTypeObject* type = Py_TYPE(object);
  if (type != reinterpret_cast<PyTypeObject*>(THPVariableClass) &&
      type != reinterpret_cast<PyTypeObject*>(parameter_class)) {
    return false;
  }
  return !THPVariable_Unpack(object).unsafeGetTensorImpl()->is_python_dispatch();
}

// A batch's rows as torch's step takes them: each param detached (the
// caller's own param keeps its .grad), or the piece of it a row holds
// (`pieces`: per row None, or the (offset, count) of its flat elements), its
// staged grad (or the piece of it) set as .grad, and its state a new dict of
// its staged views, with its kept scalars where a row has a dict of them.
// None where a row has no grad or its param or grad is a tensor subclass:
// the caller's per-row walk decides those.
py::object staged_rows(const py::handle& params, const py::handle& grads, const py::handle& row_views,
                       const py::handle& row_scalars, const py::handle& pieces) {
  static PyObject* const grad_name = PyUnicode_InternFromString("grad");  // (never freed)
  const py::list param_items = items_of(params), grad_items = items_of(grads), view_items = items_of(row_views),
                 scalar_items = items_of(row_scalars), piece_items = items_of(pieces);
  const size_t rows = param_items.size();
  TORCH_CHECK_VALUE(grad_items.size() == rows && view_items.size() == rows && scalar_items.size() == rows &&
                        piece_items.size() == rows,
                    "staged_rows: one grad, one dict of views, one of scalars (or None) and one piece (or None) "
                    "per param");
  for (size_t row = 0; row < rows; ++row) {
    if (!plain_tensor(param_items[row].ptr()) || !plain_tensor(grad_items[row].ptr())) return py::none();
  }
  py::list targets(rows);
  py::dict state;
  for (size_t row = 0; row < rows; ++row) {
    at::Tensor param = THPVariable_Unpack(param_items[row].ptr()).detach();
    at::Tensor grad = THPVariable_Unpack(grad_items[row].ptr());
    if (!piece_items[row].is_none()) {  // (as Python's param.view(-1)[offset:offset + count])
      const auto [offset, count] = piece_items[row].cast<std::pair<int64_t, int64_t>>();
      param = param.view({-1}).slice(0, offset, offset + count);
      grad = grad.reshape({-1}).slice(0, offset, offset + count);
    }
    py::object target = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(param)));
    py::object target_grad = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(grad)));
    if (!target || !target_grad || PyObject_SetAttr(target.ptr(), grad_name, target_grad.ptr()) != 0) {
      throw py::error_already_set();
    }
    py::object entry = py::reinterpret_steal<py::object>(PyDict_Copy(view_items[row].ptr()));
    if (!entry || (!scalar_items[row].is_none() && PyDict_Update(entry.ptr(), scalar_items[row].ptr()) != 0)) {
      throw py::error_already_set();
    }
    state[target] = std::move(entry);
    targets[row] = std::move(target);
  }
  return py::make_tuple(std::move(targets), std::move(state));
}

// After torch's step over staged_rows' rows: the first row whose state's
// keys are not its `kept` names (-1: none), and each (row, name) of its
// `exact` names whose state is no longer its staged view (created or
// replaced by the step: the caller copies it into the view).
py::tuple replaced_states(const py::handle& targets, const py::handle& state, const py::handle& row_views,
                          const py::handle& kept, const py::handle& exact) {
  const py::list target_items = items_of(targets), view_items = items_of(row_views), kept_items = items_of(kept),
                 exact_items = items_of(exact);
  const size_t rows = target_items.size();
  TORCH_CHECK_VALUE(PyDict_Check(state.ptr()) && view_items.size() == rows && kept_items.size() == rows &&
                        exact_items.size() == rows,
                    "replaced_states: the state dict, and one dict of views, one set of kept names and one tuple "
                    "of exact names per row");
  py::list replaced;
  for (size_t row = 0; row < rows; ++row) {
    // (held: a key's __eq__ or an allocation may run Python that drops it from the dict)
    const py::object held_entry = py::reinterpret_borrow<py::object>(
        PyDict_GetItemWithError(state.ptr(), target_items[row].ptr()));
    if (!held_entry && PyErr_Occurred()) throw py::error_already_set();
    PyObject* entry = held_entry.ptr();
    PyObject* names = kept_items[row].ptr();
    bool same_keys = entry != nullptr && PyDict_Check(entry) && PyAnySet_Check(names) &&
                     PyDict_Size(entry) == PySet_Size(names);
    PyObject* key = nullptr;
    PyObject* value = nullptr;
    for (Py_ssize_t position = 0; same_keys && PyDict_Next(entry, &position, &key, &value);) {
      const int contained = PySet_Contains(names, key);
      if (contained < 0) throw py::error_already_set();
      same_keys = contained == 1;
    }
    if (!same_keys) return py::make_tuple(static_cast<int64_t>(row), std::move(replaced));
    for (const py::handle name : items_of(exact_items[row])) {
      PyObject* now = PyDict_GetItemWithError(entry, name.ptr());  // borrowed
      if (now == nullptr) {
        if (PyErr_Occurred()) throw py::error_already_set();
        return py::make_tuple(static_cast<int64_t>(row), std::move(replaced));  // (an exact name not kept)
      }
      PyObject* view = PyDict_GetItemWithError(view_items[row].ptr(), name.ptr());
      if (view == nullptr && PyErr_Occurred()) throw py::error_already_set();
      if (now != view) replaced.append(py::make_tuple(static_cast<int64_t>(row), name));
    }
  }
  return py::make_tuple(static_cast<int64_t>(-1), std::move(replaced));
}

}  // namespace

void bind_step_checks(py::module& module) {
  module.def("tensor_signature", &tensor_signature, py::arg("tensors"),
             "Each tensor's dtype and shape as bytes (equal while none changed); None where an item is no tensor "
             "or has no plain sizes (nested, symbolic).");
  module.def("data_pointers", &data_pointers, py::arg("tensors"),
             "Each tensor's data_ptr() as bytes (equal while no tensor's data moved).");
  module.def("grads_of", &grads_of, py::arg("params"),
             "(each param's .grad as a list, the index of the first sparse grad or -1).");
  module.def("fingerprint", &fingerprint, py::arg("value"), py::arg("held") = py::none(),
             "What shows an in-place change of a value, as bytes: a tensor's identity and version, a container's "
             "members (by identity, tensors by version), any other object's identity. held: a list that gets each "
             "object named by identity (keep it while comparing: no identity shown is reused meanwhile).");
  module.def("fingerprints", &fingerprints, py::arg("mapping"), py::arg("excluded"), py::arg("held") = py::none(),
             "{key: fingerprint(value)} over a dict's items, but those whose key is in `excluded`; held as "
             "fingerprint's.");
  module.def("staged_rows", &staged_rows, py::arg("params"), py::arg("grads"), py::arg("row_views"),
             py::arg("row_scalars"), py::arg("pieces"),
             "(each param or piece detached with its grad as .grad, {detached: its views and scalars}) for "
             "torch's step over a batch; None where a grad is missing or a param or grad is a tensor subclass.");
  module.def("replaced_states", &replaced_states, py::arg("targets"), py::arg("state"), py::arg("row_views"),
             py::arg("kept"), py::arg("exact"),
             "(the first row whose state keys are not its kept names or -1, the (row, name) pairs whose state "
             "is no longer its staged view).");
}

}  // namespace swap_optimizer
