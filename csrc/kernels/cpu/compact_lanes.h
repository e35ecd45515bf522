// CPU loops for rows with compact states (compact_update.h), parallel over
// chunks of rows. Included once per instruction set by capability_*.cpp after
// cpu_lanes.h, whose lanes it uses (FloatVec pairs, load_pair, store_pair):
// the Adam math runs on at::vec lanes as the default state's loops do; the
// integer work (the stochastic rounding's hash, 8-bit codes) is plain loops
// over a vector's worth of lanes that the compiler vectorises for the target.
// Every element gets the bits of the per-element code in compact_update.h
// (the tail here, the baseline build, the CUDA kernel): the float work is the
// same operations each rounded once, the integer work is exact.
//
// An 8-bit row goes a block at a time: the block's moments are decoded into
// fp32, updated, and re-encoded against the block's new absmax.
#include "code_lanes.h"
#include "compact_update_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>

namespace swap_optimizer {
namespace CPU_CAPABILITY {
namespace {

constexpr int64_t kCompactChunkElements = 16384;
static_assert(kCompactChunkElements % kQuantBlock == 0, "chunks hold whole blocks");
static_assert(kQuantBlock % kStep == 0, "blocks hold whole vector iterations");

#if !defined(CPU_CAPABILITY_DEFAULT)
// load_start on one vector iteration's lanes.
template <typename param_t>
void load_start_lanes(const CompactRow& r, int64_t i, FloatVec (&p)[2]) {
  const param_t* param = static_cast<const param_t*>(r.param) + i;
  if (r.master != nullptr) {
    load_pair(r.master + i, p[0], p[1]);
    adopt_written_param(p, param);
    return;
  }
  load_pair(param, p[0], p[1]);
  if (r.compensation != nullptr) {
    FloatVec compensation[2];
    load_pair(static_cast<const param_t*>(r.compensation) + i, compensation[0], compensation[1]);
    for (int k = 0; k < 2; ++k) p[k] = p[k] + compensation[k];
  }
}

// store_result on one vector iteration's lanes.
template <typename param_t>
void store_result_lanes(const CompactRow& r, int64_t i, const FloatVec (&p)[2]) {
  param_t* param = static_cast<param_t*>(r.param) + i;
  store_pair(param, p[0], p[1]);
  if (r.master != nullptr) store_pair(r.master + i, p[0], p[1]);
  if (r.compensation != nullptr) {
    FloatVec rounded[2];
    load_pair(param, rounded[0], rounded[1]);
    store_pair(static_cast<param_t*>(r.compensation) + i, p[0] - rounded[0], p[1] - rounded[1]);
  }
}

// update_param_element on one vector iteration's lanes.
template <typename param_t>
void update_param_lanes(const CompactRow& r, int64_t i, const AdamHyper& hyper, const StepScalars& s,
                        const float* grad_scale, FloatVec (&exp_avg)[2], FloatVec (&exp_avg_sq)[2],
                        FloatVec (&max_exp_avg_sq)[2]) {
  FloatVec p[2], g[2];
  load_start_lanes<param_t>(r, i, p);
  load_pair(static_cast<const param_t*>(r.grad) + i, g[0], g[1]);
  for (int k = 0; k < 2; ++k) {
    if (grad_scale != nullptr) g[k] = g[k] / FloatVec(*grad_scale);
    adam_update(p[k], g[k], exp_avg[k], exp_avg_sq[k], max_exp_avg_sq[k], hyper, s);
  }
  store_result_lanes<param_t>(r, i, p);
}

// store_moment on one vector iteration's lanes; `element_hash` holds the
// lanes' element_rounding_hash when bf16 moments round stochastically.
template <typename state_t>
void store_moment_lanes(const CompactRow& r, int k, int64_t i, const FloatVec (&x)[2],
                        const uint32_t (&element_hash)[kStep]) {
  if constexpr (std::is_same_v<state_t, c10::BFloat16>) {
    if (r.stochastic) {
      float values[kStep];
      x[0].store(values);
      x[1].store(values + kLanes);
      uint16_t* out = static_cast<uint16_t*>(r.moment[k]) + i;
      const uint64_t key = r.rounding_key[k];
      for (int64_t j = 0; j < kStep; ++j) out[j] = bf16_bits_stochastic(values[j], rounding_bits_of(key, element_hash[j]));
      return;
    }
  }
  store_pair(static_cast<state_t*>(r.moment[k]) + i, x[0], x[1]);
}

// magnitude_for_absmax on lanes.
FloatVec magnitude_lanes(const FloatVec& x) { return FloatVec::blendv(x.abs(), FloatVec(0.f), x != x); }

// The largest of lanes of magnitudes: they hold no NaN, so the order of the max does not matter.
float largest_lane(const FloatVec& magnitudes) {
  float lanes[kLanes];
  magnitudes.store(lanes);
  return *std::max_element(lanes, lanes + kLanes);
}
#endif

template <typename param_t, typename state_t>
__attribute__((flatten)) void update_values(const CompactRow& shared_row, int64_t begin, int64_t end,
                                            const AdamHyper& shared_hyper, const StepScalars& shared_scalars,
                                            const float* grad_scale) {
  // Local copies: the stores could alias anything behind a reference.
  const CompactRow r = shared_row;
  const AdamHyper hyper = shared_hyper;
  const StepScalars s = shared_scalars;
  int64_t i = begin;
#if !defined(CPU_CAPABILITY_DEFAULT)
  const bool stochastic = std::is_same_v<state_t, c10::BFloat16> && r.stochastic;
  uint32_t element_hash[kStep] = {};
  for (; i + kStep <= end; i += kStep) {
    FloatVec m[2], v[2], v_max[2] = {FloatVec(0.f), FloatVec(0.f)};
    load_pair(static_cast<const state_t*>(r.moment[kMomentExpAvg]) + i, m[0], m[1]);
    load_pair(static_cast<const state_t*>(r.moment[kMomentExpAvgSq]) + i, v[0], v[1]);
    if (hyper.amsgrad) load_pair(static_cast<const state_t*>(r.moment[kMomentMaxExpAvgSq]) + i, v_max[0], v_max[1]);
    update_param_lanes<param_t>(r, i, hyper, s, grad_scale, m, v, v_max);
    if (stochastic) {
      const uint64_t first = static_cast<uint64_t>(r.global_offset + i);
      const uint32_t first_low = static_cast<uint32_t>(first);
      if (first_low <= UINT32_MAX - (kStep - 1)) {  // the lanes share the index's high half
        const uint32_t high_hash = index_high_hash(first, s.step);
        for (int64_t j = 0; j < kStep; ++j)
          element_hash[j] = element_hash_from(first_low + static_cast<uint32_t>(j), high_hash);
      } else {
        for (int64_t j = 0; j < kStep; ++j) element_hash[j] = element_rounding_hash(r.global_offset + i + j, s.step);
      }
    }
    store_moment_lanes<state_t>(r, kMomentExpAvg, i, m, element_hash);
    store_moment_lanes<state_t>(r, kMomentExpAvgSq, i, v, element_hash);
    if (hyper.amsgrad) store_moment_lanes<state_t>(r, kMomentMaxExpAvgSq, i, v_max, element_hash);
  }
#endif
  for (; i < end; ++i) update_value_element<param_t, state_t>(r, i, hyper, s, grad_scale);
}

// The first `count` elements of an 8-bit block from `block`: the moments in
// `moments` (decoded) are updated in place, the params written, and
// `absmax` gets each updated moment's block absmax.
template <typename param_t>
void update_block(const CompactRow& r, int64_t block, int64_t count, const AdamHyper& hyper, const StepScalars& s,
                  const float* grad_scale, int moments, float (&value)[3][kQuantBlock], float (&absmax)[3]) {
  int64_t j = 0;
  std::fill(absmax, absmax + 3, 0.f);
#if !defined(CPU_CAPABILITY_DEFAULT)
  FloatVec lanes_absmax[3] = {FloatVec(0.f), FloatVec(0.f), FloatVec(0.f)};
  for (; j + kStep <= count; j += kStep) {
    FloatVec updated[3][2] = {{}, {}, {FloatVec(0.f), FloatVec(0.f)}};
    for (int k = 0; k < moments; ++k) load_pair(value[k] + j, updated[k][0], updated[k][1]);
    update_param_lanes<param_t>(r, block + j, hyper, s, grad_scale, updated[0], updated[1], updated[2]);
    for (int k = 0; k < moments; ++k) {
      store_pair(value[k] + j, updated[k][0], updated[k][1]);
      lanes_absmax[k] = at::vec::maximum(lanes_absmax[k], at::vec::maximum(magnitude_lanes(updated[k][0]),
                                                                           magnitude_lanes(updated[k][1])));
    }
  }
  for (int k = 0; k < moments; ++k) absmax[k] = largest_lane(lanes_absmax[k]);
#endif
  for (; j < count; ++j) {
    update_param_element<param_t>(r, block + j, hyper, s, grad_scale, value[0][j], value[1][j], value[2][j]);
    for (int k = 0; k < moments; ++k) absmax[k] = absmax_step(absmax[k], value[k][j]);
  }
}

// Moment k's `count` codes from `codes`, decoded into `values`.
void decode_block(const CodeMap& map, const uint8_t* codes, int64_t count, float absmax, float* values) {
  int64_t j = 0;
#ifdef SWAP_OPTIMIZER_CODE_LANES
  for (; j + kCodeLanes <= count; j += kCodeLanes) {
    store_floats(values + j, multiply(gather_floats(map.values, load_codes(codes + j)), float_lanes(absmax)));
  }
#endif
  for (; j < count; ++j) values[j] = decode(map, codes[j], absmax);
}

// store_code's rule over a block's `count` values, with the host's bucket
// search. `rounding` is a template argument so the loops carry no branch on it.
template <int rounding>
void encode_block(const CodeMap& map, const uint32_t* buckets, const float* values, int64_t count,
                  float absmax, uint8_t* codes) {
  int64_t j = 0;
#ifdef SWAP_OPTIMIZER_CODE_LANES
  const FloatLanes absmax_lanes = float_lanes(absmax);
  for (; j + kCodeLanes <= count; j += kCodeLanes) {
    const FloatLanes x = load_floats(values + j);
    // normalized_for_code
    const FloatLanes normalized = absmax > 0.f ? divide(x, absmax_lanes) : float_lanes(0.f);
    store_codes(codes + j, code_lanes<rounding>(map, buckets, x, normalized, absmax_lanes));
  }
#endif
  for (; j < count; ++j) {
    codes[j] = code_of_normalized(map, buckets, rounding, values[j], normalized_for_code(values[j], absmax), absmax);
  }
}

void encode_block_as(int rounding, const CodeMap& map, const uint32_t* buckets, const float* values,
                     int64_t count, float absmax, uint8_t* codes) {
  switch (rounding) {
    case kRoundUp: return encode_block<kRoundUp>(map, buckets, values, count, absmax, codes);
    case kRoundNearestNonzero: return encode_block<kRoundNearestNonzero>(map, buckets, values, count, absmax, codes);
    default: return encode_block<kRoundNearest>(map, buckets, values, count, absmax, codes);
  }
}

template <typename param_t>
__attribute__((flatten)) void update_codes(const CompactRow& shared_row, int64_t begin, int64_t end,
                                           const AdamHyper& shared_hyper, const StepScalars& shared_scalars,
                                           const float* grad_scale) {
  const CompactRow r = shared_row;
  const AdamHyper hyper = shared_hyper;
  const StepScalars s = shared_scalars;
  const CodeMaps& maps = code_maps();
  const CodeSearch& search = code_search();
  const int moments = hyper.amsgrad ? 3 : 2;
  alignas(64) float value[3][kQuantBlock];
  float absmax[3];
  for (int64_t block = begin; block < end; block += kQuantBlock) {
    const int64_t count = std::min(kQuantBlock, end - block);
    for (int k = 0; k < moments; ++k) {
      decode_block(moment_map(maps, k), static_cast<const uint8_t*>(r.moment[k]) + block, count,
                   r.absmax[k][block / kQuantBlock], value[k]);
    }
    update_block<param_t>(r, block, count, hyper, s, grad_scale, moments, value, absmax);
    for (int k = 0; k < moments; ++k) {
      r.absmax[k][block / kQuantBlock] = absmax[k];
      encode_block_as(moment_rounding(k), moment_map(maps, k),
                      code_buckets_for(search, moment_map_kind(k), moment_rounding(k)), value[k], count, absmax[k],
                      static_cast<uint8_t*>(r.moment[k]) + block);
    }
  }
}

// The codec ops' loops (CodecLoops in compact_update_cpu.h).
__attribute__((flatten)) void codec_decode_floats(const CodecEntry& e, int64_t begin, int64_t end) {
  const CodeMap& map = code_map_of(code_maps(), e.map_kind);
  for (int64_t block = begin; block < end; block += kQuantBlock) {
    decode_block(map, static_cast<const uint8_t*>(e.in) + block, std::min(kQuantBlock, end - block),
                 e.absmax[block / kQuantBlock], static_cast<float*>(e.out) + block);
  }
}

// magnitude_for_absmax's largest over `count` values.
float block_absmax(const float* values, int64_t count) {
  float absmax = 0.f;
  int64_t j = 0;
#if !defined(CPU_CAPABILITY_DEFAULT)
  FloatVec lanes_absmax(0.f);
  for (; j + kLanes <= count; j += kLanes) {
    lanes_absmax = at::vec::maximum(lanes_absmax, magnitude_lanes(FloatVec::loadu(values + j)));
  }
  absmax = largest_lane(lanes_absmax);
#endif
  for (; j < count; ++j) absmax = absmax_step(absmax, values[j]);
  return absmax;
}

__attribute__((flatten)) void codec_encode_floats(const CodecEntry& e, int64_t begin, int64_t end) {
  const CodeMap& map = code_map_of(code_maps(), e.map_kind);
  const uint32_t* buckets = code_buckets_for(code_search(), e.map_kind, e.rounding);
  for (int64_t block = begin; block < end; block += kQuantBlock) {
    const int64_t count = std::min(kQuantBlock, end - block);
    const float* values = static_cast<const float*>(e.in) + block;
    const float absmax = block_absmax(values, count);
    e.absmax[block / kQuantBlock] = absmax;
    encode_block_as(e.rounding, map, buckets, values, count, absmax, static_cast<uint8_t*>(e.out) + block);
  }
}

// codec_encode_bf16_element's bits, in a loop the compiler vectorises for the
// target: the index's high half and the step are hashed once per run of
// elements whose global indices share that half, so each element takes two
// 32-bit finalisers in 32-bit lanes (element_hash_from, rounding_bits_folded).
void codec_encode_bf16_floats(const CodecEntry& e, int64_t begin, int64_t end) {
  const float* in = static_cast<const float*>(e.in);
  uint16_t* out = static_cast<uint16_t*>(e.out);
  const uint32_t key_bits = folded_key(e.rounding_key);
  const uint32_t step = e.step;
  for (int64_t i = begin; i < end;) {
    const uint64_t first = static_cast<uint64_t>(e.global_offset + i);
    const uint32_t first_low = static_cast<uint32_t>(first);
    // the run ends where the low half wraps (2^32 - first_low elements on) or at `end`
    const int64_t run_end = std::min<int64_t>(end, i + static_cast<int64_t>((uint64_t{1} << 32) - first_low));
    const uint32_t high_hash = index_high_hash(first, step);
    const int64_t count = run_end - i;
    for (int64_t j = 0; j < count; ++j) {
      const uint32_t element_hash = element_hash_from(first_low + static_cast<uint32_t>(j), high_hash);
      out[i + j] = bf16_bits_stochastic(in[i + j], rounding_bits_folded(key_bits, element_hash));
    }
    i = run_end;
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
#define SWAP_OPTIMIZER_DEFINE_CODEC_LOOPS(entry)                                                      \
  namespace swap_optimizer {                                                                          \
  CodecLoops entry() {                                                                                \
    return {&CPU_CAPABILITY::codec_decode_floats, &CPU_CAPABILITY::codec_encode_floats,                \
            &CPU_CAPABILITY::codec_encode_bf16_floats};                                               \
  }                                                                                                   \
  }
