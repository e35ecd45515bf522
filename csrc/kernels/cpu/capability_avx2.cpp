// The CPU element loops built for AVX2 + FMA, chosen at run time only on CPUs
// that have them (at::native::get_cpu_capability). Every header that is not
// at::vec is included before the target switch, so only this file's own
// functions and at::vec's AVX2 namespace are compiled for AVX2.
#include "cpu_update.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/irange.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define CPU_CAPABILITY AVX2
// at::vec and Sleef select their code by the ISA macros that -m flags would
// set; the target pragma above enables the instructions, these the macros.
#ifndef __AVX__
#define __AVX__ 1
#endif
#ifndef __AVX2__
#define __AVX2__ 1
#endif
#ifndef __FMA__
#define __FMA__ 1
#endif
#ifndef __F16C__
#define __F16C__ 1
#endif
#define CPU_CAPABILITY_AVX2
#include "cpu_lanes.h"

namespace swap_optimizer {
void update_params_avx2(DtypePair pair, const std::vector<CpuParamWork>& work,
                        const AdamHyper& hyper, const float* grad_scale) {
  AVX2::update_params(pair, work, hyper, grad_scale);
}
}  // namespace swap_optimizer
#pragma GCC pop_options
#else
namespace swap_optimizer {
void update_params_avx2(DtypePair pair, const std::vector<CpuParamWork>& work,
                        const AdamHyper& hyper, const float* grad_scale) {
  update_params_default(pair, work, hyper, grad_scale);
}
}  // namespace swap_optimizer
#endif
