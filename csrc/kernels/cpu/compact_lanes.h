// CPU loops for rows with compact states (compact_update.h): scalar code the
// compiler may vectorise, parallel over chunks of rows. An 8-bit row is updated
// a block at a time: the block's moments are decoded, updated and kept in fp32,
// then re-encoded against the block's new absmax. Included once per instruction
// set by capability_*.cpp, like cpu_lanes.h (hardware FMA where there is one).
#include "compact_update_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>

namespace swap_optimizer {
namespace CPU_CAPABILITY {
namespace {

constexpr int64_t kCompactChunkElements = 16384;
static_assert(kCompactChunkElements % kQuantBlock == 0, "chunks hold whole blocks");

template <typename param_t, typename state_t>
void update_values(const CompactRow& r, int64_t begin, int64_t end, const AdamHyper& hyper,
                   const StepScalars& s, const float* grad_scale) {
  for (int64_t i = begin; i < end; ++i) update_value_element<param_t, state_t>(r, i, hyper, s, grad_scale);
}

template <typename param_t>
void update_codes(const CompactRow& r, int64_t begin, int64_t end, const AdamHyper& hyper,
                  const StepScalars& s, const float* grad_scale) {
  const CodeMaps& maps = code_maps();
  const CodeSearch& search = code_search();
  const int moments = hyper.amsgrad ? 3 : 2;
  float value[kQuantBlock][3];
  for (int64_t block = begin; block < end; block += kQuantBlock) {
    const int64_t count = std::min(kQuantBlock, end - block);
    float absmax[3] = {0.f, 0.f, 0.f};
    for (int64_t j = 0; j < count; ++j) {
      update_code_element<param_t>(r, maps, block + j, hyper, s, grad_scale, value[j]);
      for (int k = 0; k < moments; ++k) {
        const float magnitude = magnitude_for_absmax(value[j][k]);
        if (magnitude > absmax[k]) absmax[k] = magnitude;
      }
    }
    for (int k = 0; k < moments; ++k) {
      r.absmax[k][block / kQuantBlock] = absmax[k];
      for (int64_t j = 0; j < count; ++j) store_code(r, maps, &search, k, block + j, value[j][k], absmax[k]);
    }
  }
}

using ChunkFn = void (*)(const CompactRow&, int64_t, int64_t, const AdamHyper&, const StepScalars&,
                         const float*);

template <typename param_t>
ChunkFn chunk_fn_for_state(c10::ScalarType state_dtype) {
  switch (state_dtype) {
    case c10::kByte: return &update_codes<param_t>;
    case c10::kBFloat16: return &update_values<param_t, c10::BFloat16>;
    case c10::kHalf: return &update_values<param_t, c10::Half>;
    default: return &update_values<param_t, float>;
  }
}

ChunkFn chunk_fn(c10::ScalarType param_dtype, c10::ScalarType state_dtype) {
  switch (param_dtype) {
    case c10::kBFloat16: return chunk_fn_for_state<c10::BFloat16>(state_dtype);
    case c10::kHalf: return chunk_fn_for_state<c10::Half>(state_dtype);
    default: return chunk_fn_for_state<float>(state_dtype);
  }
}

}  // namespace

inline void update_compact_rows(const std::vector<CompactWork>& work, const std::vector<StepScalars>& scalars,
                                const AdamHyper& hyper, const float* grad_scale) {
  struct Chunk {
    int64_t work_index;
    int64_t begin;
    int64_t end;
  };
  std::vector<Chunk> chunks;
  for (int64_t k = 0; k < static_cast<int64_t>(work.size()); ++k) {
    for (int64_t begin = 0; begin < work[k].row.numel; begin += kCompactChunkElements) {
      chunks.push_back({k, begin, std::min(begin + kCompactChunkElements, work[k].row.numel)});
    }
  }
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const CompactWork& w = work[chunks[c].work_index];
      chunk_fn(w.param_dtype, w.state_dtype)(w.row, chunks[c].begin, chunks[c].end, hyper,
                                             scalars[w.row.scalars_index], grad_scale);
    }
  });
}

}  // namespace CPU_CAPABILITY
}  // namespace swap_optimizer

// Defines the compact entry point named in compact_update_cpu.h for the capability being built.
#define SWAP_OPTIMIZER_DEFINE_COMPACT_ENTRY(entry)                                                       \
  namespace swap_optimizer {                                                                             \
  void entry(const std::vector<CompactWork>& work, const std::vector<StepScalars>& scalars,             \
             const AdamHyper& hyper, const float* grad_scale) {                                          \
    CPU_CAPABILITY::update_compact_rows(work, scalars, hyper, grad_scale);                               \
  }                                                                                                      \
  }
