// Interface between the CPU op (fused_adam_cpu.cpp) and its per-instruction-set
// element loops (capability_*.cpp, each compiled for one ISA).
#pragma once

#include "../adam_math.h"
#include "../packed_layout.h"

#include <ATen/Version.h>

#include <cstdint>
#include <string>
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

// The build of a loop for the instruction set torch itself picked for this
// CPU; honours the ATEN_CPU_CAPABILITY environment variable as torch's own
// kernels do, but never above what the CPU runs (torch reports "AVX512" for
// ATEN_CPU_CAPABILITY=avx512 on a CPU without it, and those loops would stop
// the process on an illegal instruction). The features are each build's
// target (capability_avx2.cpp, capability_avx512.cpp). (Without ISA variants
// only the default build exists.)
#ifdef SWAP_OPTIMIZER_CPU_ISA_VARIANTS
inline bool cpu_runs_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
inline bool cpu_runs_avx512() {
  return cpu_runs_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
template <typename Fn>
Fn for_this_cpu(Fn default_build, Fn avx2_build, Fn avx512_build) {
  const std::string capability = at::get_cpu_capability();
  if (capability == "AVX512" && cpu_runs_avx512()) return avx512_build;
  if ((capability == "AVX512" || capability == "AVX2") && cpu_runs_avx2()) return avx2_build;
  return default_build;
}
#define SWAP_OPTIMIZER_FOR_THIS_CPU(name) for_this_cpu(&name##_default, &name##_avx2, &name##_avx512)
#else
#define SWAP_OPTIMIZER_FOR_THIS_CPU(name) (&name##_default)
#endif

void update_params_default(DtypePair, const std::vector<CpuParamWork>&, const AdamHyper&, const float*);
#ifdef SWAP_OPTIMIZER_CPU_ISA_VARIANTS
void update_params_avx2(DtypePair, const std::vector<CpuParamWork>&, const AdamHyper&, const float*);
void update_params_avx512(DtypePair, const std::vector<CpuParamWork>&, const AdamHyper&, const float*);
#endif

}  // namespace swap_optimizer
