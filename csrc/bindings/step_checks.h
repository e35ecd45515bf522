// step()'s per-param checks in C++: what the torch-update rule reads of every
// param at each step (whether any changed dtype or shape, or had its .data
// replaced; the grads, and whether one is sparse). In Python these loops cost
// about 1 µs a param a step, a share of the host's time that grows with the
// param count (the "1000 x 64" rows of the --host-overhead bench). Also the
// rows of a whole batch that torch's step takes (detached params with their
// staged grads, their staged views as states) and what that step replaced:
// the per-row walk of a batch in Python costs about 3 µs a row.
#pragma once

#include <torch/extension.h>

namespace swap_optimizer {

void bind_step_checks(pybind11::module& module);

}  // namespace swap_optimizer
