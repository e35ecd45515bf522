// Operator schemas (defined once, here) and the Python module swap_optimizer._C.
// The runtime's bindings live in runtime_bindings.cpp.
// Backend implementations register themselves in csrc/kernels/{cpu,cuda}.
#include "../kernels/op_registry.h"
#include "runtime_bindings.h"

#include <torch/extension.h>
#include <torch/library.h>

TORCH_LIBRARY(swap_optimizer, m) {
  m.def(swap_optimizer::kFusedAdamPackedSchema);
  m.def(swap_optimizer::kDecodeBlockwise8bitSchema);
  m.def(swap_optimizer::kEncodeBlockwise8bitSchema);
  m.def(swap_optimizer::kEncodeBf16StochasticSchema);
}

namespace {

constexpr bool kBuiltWithCuda =
#ifdef SWAP_OPTIMIZER_WITH_CUDA
    true;
#else
    false;
#endif

}  // namespace

PYBIND11_MODULE(_C, module) {
  module.doc() = "swap_optimizer native extension: fused packed AdamW kernels and runtime";
  module.def("built_with_cuda", [] { return kBuiltWithCuda; },
             "True when the CUDA kernels were compiled into this build.");
  swap_optimizer::bind_runtime(module);
}
