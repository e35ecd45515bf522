// Interface between the CPU op (fused_adam_cpu.cpp) and the loops for rows
// with compact states (compact_update_cpu.cpp).
#pragma once

#include "../compact_update.h"

#include <c10/core/ScalarType.h>

#include <vector>

namespace swap_optimizer {

struct CompactWork {
  CompactRow row;
  c10::ScalarType param_dtype;
  c10::ScalarType state_dtype;  // kByte: 8-bit codes
};

// Updates every row; scalars[row.scalars_index] are its step scalars.
void update_compact_rows_cpu(const std::vector<CompactWork>& work, const std::vector<StepScalars>& scalars,
                             const AdamHyper& hyper, const float* grad_scale);

}  // namespace swap_optimizer
