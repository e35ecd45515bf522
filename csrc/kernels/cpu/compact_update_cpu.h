// Interface between the CPU op (fused_adam_cpu.cpp) and the loops for rows
// with compact states (compact_lanes.h, built per instruction set by
// capability_*.cpp).
#pragma once

#include "../compact_update.h"
#include "cpu_update.h"

#include <c10/core/ScalarType.h>

#include <vector>

namespace swap_optimizer {

struct CompactWork {
  CompactRow row;
  c10::ScalarType param_dtype;
  c10::ScalarType state_dtype;  // kByte: 8-bit codes
};

// Updates every row; scalars[row.scalars_index] are its step scalars.
using CompactUpdateFn = void (*)(const std::vector<CompactWork>& work, const std::vector<StepScalars>& scalars,
                                 const AdamHyper& hyper, const float* grad_scale);
void update_compact_rows_default(const std::vector<CompactWork>&, const std::vector<StepScalars>&,
                                 const AdamHyper&, const float*);
#ifdef SWAP_OPTIMIZER_CPU_ISA_VARIANTS
void update_compact_rows_avx2(const std::vector<CompactWork>&, const std::vector<StepScalars>&,
                              const AdamHyper&, const float*);
void update_compact_rows_avx512(const std::vector<CompactWork>&, const std::vector<StepScalars>&,
                                const AdamHyper&, const float*);
#endif

}  // namespace swap_optimizer
