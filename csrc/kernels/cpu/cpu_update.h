// Interface between the CPU op (fused_adam_cpu.cpp) and its per-instruction-set
// element loops (capability_*.cpp, each compiled for one ISA).
#pragma once

#include "../adam_math.h"
#include "../packed_layout.h"

#include <cstdint>
#include <vector>

namespace swap_optimizer {

// Pointers and scalars of one param; states and master live in the arena.
struct CpuParamWork {
  void* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  void* max_exp_avg_sq;  // null unless amsgrad
  float* master;         // null unless a master copy is kept
  int64_t numel;
  StepScalars scalars;
};

// Updates every param of one dtype pair; grad_scale may be null.
using CpuUpdateFn = void (*)(DtypePair pair, const std::vector<CpuParamWork>& work,
                             const AdamHyper& hyper, const float* grad_scale);

// AVX2 and AVX-512 builds of the loops exist where GCC can switch the target
// per file (capability_avx2.cpp, capability_avx512.cpp).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SWAP_OPTIMIZER_CPU_ISA_VARIANTS 1
#endif

void update_params_default(DtypePair, const std::vector<CpuParamWork>&, const AdamHyper&, const float*);
#ifdef SWAP_OPTIMIZER_CPU_ISA_VARIANTS
void update_params_avx2(DtypePair, const std::vector<CpuParamWork>&, const AdamHyper&, const float*);
void update_params_avx512(DtypePair, const std::vector<CpuParamWork>&, const AdamHyper&, const float*);
#endif

}  // namespace swap_optimizer
