// overlap_forward's "is this op's tensor one of ours?" test, in C++ (the
// read watch, swap_optimizer/overlap/guard.py): each op on the stepping
// thread while a step is pending asks it, and in Python the walk over the
// op's arguments and each tensor's byte span cost about 17 µs an op.
#pragma once

#include <torch/extension.h>

namespace swap_optimizer {

void bind_span_index(pybind11::module& module);

}  // namespace swap_optimizer
