// overlap_forward's checks that run per op or per pass, in C++: in Python
// they were a large share of what a pending pass costs a forward.
// - SpanIndex: "is this op's tensor one of ours?" (the read watch,
//   swap_optimizer/overlap/guard.py), asked by each op on the stepping thread
//   while a step is pending (in Python about 17 µs an op);
// - PassChecks and WatchCalls: whether an op needs the watch's Python check
//   at all, and the op's call (in Python about 10 µs an op);
// - module_structure: the model's modules and their own params, by identity,
//   compared at each pass's first call with what the probe saw (in Python
//   about 3 µs a module).
#pragma once

#include <torch/extension.h>

namespace swap_optimizer {

void bind_overlap_checks(pybind11::module& module);

}  // namespace swap_optimizer
