// The CPU element loops built for AVX-512 (F, BW, VL, DQ) + FMA, chosen at run time only on CPUs
// that have it (see for_this_cpu in cpu_update.h). Every header that
// is not at::vec is included before the target switch, so only this file's own
// functions and at::vec's AVX512 namespace are compiled for AVX-512 (F, BW, VL, DQ) + FMA.
#include "compact_update_cpu.h"
#include "cpu_update.h"

#ifdef SWAP_OPTIMIZER_CPU_ISA_VARIANTS
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/irange.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
// at::vec and Sleef select their code by the ISA macros that -m flags would
// set; the pragma enables the instructions, these set the macros.
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
#ifndef __AVX512F__
#define __AVX512F__ 1
#endif
#ifndef __AVX512BW__
#define __AVX512BW__ 1
#endif
#ifndef __AVX512VL__
#define __AVX512VL__ 1
#endif
#ifndef __AVX512DQ__
#define __AVX512DQ__ 1
#endif
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#include "cpu_lanes.h"
#include "compact_lanes.h"

SWAP_OPTIMIZER_DEFINE_CPU_ENTRY(update_params_avx512)
SWAP_OPTIMIZER_DEFINE_COMPACT_ENTRY(update_compact_rows_avx512)
SWAP_OPTIMIZER_DEFINE_CODEC_LOOPS(codec_loops_avx512)
#pragma GCC pop_options
#endif
