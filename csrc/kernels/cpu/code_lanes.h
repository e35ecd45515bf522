// 8-bit codes on lanes, with the gathers AVX2 and AVX-512 have: the twins of
// count_below (with the bucket table) and code_of_normalized in state_codec.h.
// Included by compact_lanes.h inside each capability's build, and by
// tests/cpp/code_search_exhaustive.cpp, which checks them against the scalar
// code for every float; needs no torch. Defines SWAP_OPTIMIZER_CODE_LANES
// where the capability has them (AVX2, AVX-512). Predicates are lanes of 0
// or 1.
#pragma once

#include "../state_codec.h"

#include <immintrin.h>

namespace swap_optimizer {
namespace CPU_CAPABILITY {
namespace {

#if defined(CPU_CAPABILITY_AVX512)
using IntLanes = __m512i;
using FloatLanes = __m512;
IntLanes int_lanes(int value) { return _mm512_set1_epi32(value); }
IntLanes add(IntLanes a, IntLanes b) { return _mm512_add_epi32(a, b); }
IntLanes bit_and(IntLanes a, IntLanes b) { return _mm512_and_si512(a, b); }
IntLanes bit_or(IntLanes a, IntLanes b) { return _mm512_or_si512(a, b); }
IntLanes mask_to_predicate(__mmask16 mask) { return _mm512_maskz_mov_epi32(mask, int_lanes(1)); }
IntLanes less(FloatLanes a, FloatLanes b) { return mask_to_predicate(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ)); }
IntLanes is_zero(IntLanes a) { return mask_to_predicate(_mm512_cmpeq_epi32_mask(a, int_lanes(0))); }
IntLanes where(IntLanes predicate, IntLanes if_one, IntLanes if_zero) {
  return _mm512_mask_mov_epi32(if_zero, _mm512_test_epi32_mask(predicate, predicate), if_one);
}
IntLanes greater(IntLanes a, IntLanes b) { return mask_to_predicate(_mm512_cmpgt_epi32_mask(a, b)); }
IntLanes shift_right(IntLanes a, unsigned bits) { return _mm512_srli_epi32(a, bits); }
IntLanes float_bits_lanes(FloatLanes x) { return _mm512_castps_si512(x); }
// bucket_key on lanes.
IntLanes bucket_key_lanes(IntLanes bits) {
  const IntLanes mask = int_lanes(kBucketKeyMask);
  return _mm512_xor_si512(bit_and(bits, mask), bit_and(_mm512_srai_epi32(bits, 31), mask));
}
// The masked gathers (all lanes on) name their fallback lanes, which GCC
// otherwise warns are uninitialised.
FloatLanes gather_floats(const float* base, IntLanes index) {
  return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), 0xffff, index, base, 4);
}
IntLanes gather_ints(const uint32_t* base, IntLanes index) {
  return _mm512_mask_i32gather_epi32(int_lanes(0), 0xffff, index, base, 4);
}
IntLanes load_codes(const uint8_t* codes) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
}
void store_codes(uint8_t* codes, IntLanes lanes) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(codes), _mm512_cvtepi32_epi8(lanes));
}
FloatLanes load_floats(const float* values) { return _mm512_loadu_ps(values); }
void store_floats(float* values, FloatLanes lanes) { _mm512_storeu_ps(values, lanes); }
FloatLanes float_lanes(float value) { return _mm512_set1_ps(value); }
FloatLanes multiply(FloatLanes a, FloatLanes b) { return _mm512_mul_ps(a, b); }
FloatLanes divide(FloatLanes a, FloatLanes b) { return _mm512_div_ps(a, b); }
#define SWAP_OPTIMIZER_CODE_LANES
#elif defined(CPU_CAPABILITY_AVX2)
using IntLanes = __m256i;
using FloatLanes = __m256;
IntLanes int_lanes(int value) { return _mm256_set1_epi32(value); }
IntLanes add(IntLanes a, IntLanes b) { return _mm256_add_epi32(a, b); }
IntLanes bit_and(IntLanes a, IntLanes b) { return _mm256_and_si256(a, b); }
IntLanes bit_or(IntLanes a, IntLanes b) { return _mm256_or_si256(a, b); }
IntLanes mask_to_predicate(IntLanes all_ones_or_zero) { return _mm256_srli_epi32(all_ones_or_zero, 31); }
IntLanes less(FloatLanes a, FloatLanes b) {
  return mask_to_predicate(_mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_LT_OQ)));
}
IntLanes is_zero(IntLanes a) { return mask_to_predicate(_mm256_cmpeq_epi32(a, int_lanes(0))); }
IntLanes where(IntLanes predicate, IntLanes if_one, IntLanes if_zero) {
  return _mm256_blendv_epi8(if_zero, if_one, _mm256_sub_epi32(int_lanes(0), predicate));
}
IntLanes greater(IntLanes a, IntLanes b) { return mask_to_predicate(_mm256_cmpgt_epi32(a, b)); }
IntLanes shift_right(IntLanes a, unsigned bits) { return _mm256_srli_epi32(a, bits); }
IntLanes float_bits_lanes(FloatLanes x) { return _mm256_castps_si256(x); }
// bucket_key on lanes.
IntLanes bucket_key_lanes(IntLanes bits) {
  const IntLanes mask = int_lanes(kBucketKeyMask);
  return _mm256_xor_si256(bit_and(bits, mask), bit_and(_mm256_srai_epi32(bits, 31), mask));
}
FloatLanes gather_floats(const float* base, IntLanes index) { return _mm256_i32gather_ps(base, index, 4); }
IntLanes gather_ints(const uint32_t* base, IntLanes index) {
  return _mm256_i32gather_epi32(reinterpret_cast<const int*>(base), index, 4);
}
IntLanes load_codes(const uint8_t* codes) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
}
void store_codes(uint8_t* codes, IntLanes lanes) {
  const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(lanes), _mm256_extracti128_si256(lanes, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(codes), _mm_packus_epi16(words, words));
}
FloatLanes load_floats(const float* values) { return _mm256_loadu_ps(values); }
void store_floats(float* values, FloatLanes lanes) { _mm256_storeu_ps(values, lanes); }
FloatLanes float_lanes(float value) { return _mm256_set1_ps(value); }
FloatLanes multiply(FloatLanes a, FloatLanes b) { return _mm256_mul_ps(a, b); }
FloatLanes divide(FloatLanes a, FloatLanes b) { return _mm256_div_ps(a, b); }
#define SWAP_OPTIMIZER_CODE_LANES
#endif

#ifdef SWAP_OPTIMIZER_CODE_LANES
constexpr int64_t kCodeLanes = sizeof(FloatLanes) / sizeof(float);
static_assert(kQuantBlock % kCodeLanes == 0, "blocks hold whole vectors of codes");

// count_below with the bucket table, on lanes.
IntLanes count_below_lanes(const float* sorted, const uint32_t* buckets, FloatLanes x) {
  const IntLanes bits = float_bits_lanes(x);
  const IntLanes entry = gather_ints(buckets, shift_right(bits, 32 - kBucketBits));
  const IntLanes index = add(bit_and(entry, int_lanes(0xff)), greater(bucket_key_lanes(bits), shift_right(entry, 8)));
  return where(less(float_lanes(sorted[kCodes - 2]), x), int_lanes(kCodes - 1), index);
}

// code_of_normalized on lanes.
template <int rounding>
IntLanes code_lanes(const CodeMap& map, const uint32_t* buckets, FloatLanes x, FloatLanes normalized,
                    FloatLanes absmax) {
  if constexpr (rounding == kRoundUp) {
    const IntLanes code = count_below_lanes(map.values, buckets, normalized);
    const IntLanes rounded_down = less(multiply(gather_floats(map.values, code), absmax), x);
    return add(code, bit_and(greater(int_lanes(kCodes - 1), code), rounded_down));
  }
  const IntLanes code = count_below_lanes(map.midpoints, buckets, normalized);
  if constexpr (rounding == kRoundNearestNonzero) {
    return bit_or(code, bit_and(is_zero(code), less(float_lanes(0.f), x)));
  }
  return code;
}
#endif

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace swap_optimizer
