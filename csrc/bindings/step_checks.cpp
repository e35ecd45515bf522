#include "step_checks.h"

#include <cstdint>
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

}  // namespace

void bind_step_checks(py::module& module) {
  module.def("tensor_signature", &tensor_signature, py::arg("tensors"),
             "Each tensor's dtype and shape as bytes (equal while none changed); None where an item is no tensor "
             "or has no plain sizes (nested, symbolic).");
  module.def("data_pointers", &data_pointers, py::arg("tensors"),
             "Each tensor's data_ptr() as bytes (equal while no tensor's data moved).");
  module.def("grads_of", &grads_of, py::arg("params"),
             "(each param's .grad as a list, the index of the first sparse grad or -1).");
}

}  // namespace swap_optimizer
