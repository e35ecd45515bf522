// Python bindings of the swap runtime (swap_optimizer._C.SwapRuntime).
#pragma once

#include <torch/extension.h>

namespace swap_optimizer {

void bind_runtime(pybind11::module& module);

}  // namespace swap_optimizer
