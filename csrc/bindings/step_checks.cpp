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

// Each tensor's dtype and shape, as bytes: two are equal while none changed
// (the dim count separates the shapes). None where an item is no tensor.
py::object tensor_signature(const py::sequence& tensors) {
  std::vector<int64_t> words;
  words.reserve(tensors.size() * 4);
  for (const py::handle item : tensors) {
    if (!THPVariable_Check(item.ptr())) return py::none();
    const at::Tensor& tensor = THPVariable_Unpack(item.ptr());
    const auto sizes = tensor.sizes();
    words.push_back(static_cast<int64_t>(tensor.scalar_type()));
    words.push_back(static_cast<int64_t>(sizes.size()));
    words.insert(words.end(), sizes.begin(), sizes.end());
  }
  return as_bytes(words);
}

// Each tensor's data_ptr(), as bytes (equal while no .data was replaced).
py::bytes data_pointers(const py::sequence& tensors) {
  std::vector<int64_t> words;
  words.reserve(tensors.size());
  for (const py::handle item : tensors) {
    TORCH_CHECK_TYPE(THPVariable_Check(item.ptr()), "data_pointers: expected tensors, got ",
                     Py_TYPE(item.ptr())->tp_name);
    words.push_back(reinterpret_cast<int64_t>(THPVariable_Unpack(item.ptr()).data_ptr()));
  }
  return as_bytes(words);
}

// Each param's .grad (read as Python reads it: a subclass's getter runs), and
// the index of the first sparse one (-1: none).
py::tuple grads_of(const py::sequence& params) {
  static const py::handle grad_name = py::str("grad").release();  // (interned once, never freed)
  py::list grads(params.size());
  int64_t first_sparse = -1;
  size_t index = 0;
  for (const py::handle param : params) {
    py::object grad = py::reinterpret_steal<py::object>(PyObject_GetAttr(param.ptr(), grad_name.ptr()));
    if (!grad) throw py::error_already_set();
    if (first_sparse < 0 && THPVariable_Check(grad.ptr()) && THPVariable_Unpack(grad.ptr()).is_sparse()) {
      first_sparse = static_cast<int64_t>(index);
    }
    grads[index++] = std::move(grad);
  }
  return py::make_tuple(std::move(grads), first_sparse);
}

}  // namespace

void bind_step_checks(py::module& module) {
  module.def("tensor_signature", &tensor_signature, py::arg("tensors"),
             "Each tensor's dtype and shape as bytes (equal while none changed); None where an item is no tensor.");
  module.def("data_pointers", &data_pointers, py::arg("tensors"),
             "Each tensor's data_ptr() as bytes (equal while no tensor's data moved).");
  module.def("grads_of", &grads_of, py::arg("params"),
             "(each param's .grad as a list, the index of the first sparse grad or -1).");
}

}  // namespace swap_optimizer
