// Interface between the CPU ops (fused_adam_cpu.cpp, state_codec_cpu.cpp) and
// the loops for compact states (compact_lanes.h, built per instruction set by
// capability_*.cpp).
#pragma once

#include "../codec_batch.h"
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

// The codec ops' loops over elements [begin, end) of an entry whose values
// are fp32 (begin: a multiple of kQuantBlock); other value dtypes take the
// per-element code in state_codec_cpu.cpp.
struct CodecLoops {
  void (*decode_8bit)(const CodecEntry& e, int64_t begin, int64_t end);
  void (*encode_8bit)(const CodecEntry& e, int64_t begin, int64_t end);
  void (*encode_bf16)(const CodecEntry& e, int64_t begin, int64_t end);
};
CodecLoops codec_loops_default();
#ifdef SWAP_OPTIMIZER_CPU_ISA_VARIANTS
CodecLoops codec_loops_avx2();
CodecLoops codec_loops_avx512();
#endif

}  // namespace swap_optimizer
