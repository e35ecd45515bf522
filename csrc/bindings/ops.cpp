// Operator schemas (defined once, here) and the Python module swap_optimizer._C.
// The runtime's bindings live in runtime_bindings.cpp.
// Backend implementations register themselves in csrc/kernels/{cpu,cuda}.
#include "../kernels/adam_vocabulary.h"
#include "../kernels/op_registry.h"
#include "runtime_bindings.h"
#include "overlap_checks.h"
#include "step_checks.h"

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
  // Adam's vocabulary (adam_vocabulary.h), which the Python layer reads instead of spelling it.
  namespace so = swap_optimizer;
  auto names = [](const char* const* first, int count) {
    pybind11::tuple names(count);
    for (int i = 0; i < count; ++i) names[i] = pybind11::str(first[i]);
    return names;
  };
  module.attr("adam_runtime_keys") = names(so::kAdamKeyNames, so::kAdamKeyCount);
  const char* owners[so::kAdamKeyCount];
  for (int key = 0; key < so::kAdamKeyCount; ++key) owners[key] = so::kAdamKeyNames[so::kAdamKeyOwner[key]];
  module.attr("adam_runtime_key_owners") = names(owners, so::kAdamKeyCount);
  module.attr("adam_moment_keys") = names(so::kAdamKeyNames + so::kMomentExpAvg, so::kMomentCount);
  module.attr("layout_columns") = names(so::kLayoutColumnNames, so::kLayoutColumns);
  swap_optimizer::bind_runtime(module);
  swap_optimizer::bind_overlap_checks(module);
  swap_optimizer::bind_step_checks(module);
}
