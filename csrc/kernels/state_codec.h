// Compact forms of the Adam moments, shared by the CPU and CUDA kernels so both
// produce the same bits:
//  - bf16 moments with stochastic rounding: a counter-based generator keyed by
//    (seed, param index, state key, global element index, step) picks the
//    rounding, so a result depends on no batching, split, device or rank;
//  - blockwise 8-bit moments: blocks of kQuantBlock elements, one fp32 absmax
//    per block, codes into bitsandbytes' dynamic maps (signed for exp_avg,
//    unsigned for exp_avg_sq and max_exp_avg_sq), rounded to the nearest code;
//    max_exp_avg_sq rounds up so it stays a true running maximum.
#pragma once

#include "adam_math.h"
#include "adam_vocabulary.h"

#include <cstdint>

namespace swap_optimizer {

constexpr int64_t kQuantBlock = 256;
constexpr int kCodes = 256;

// The dynamic maps (Dettmers, "8-Bit Approximations for Parallelism in Deep
// Learning"): seven decades 1e-6..1, each with more fraction codes than the one
// below, so relative precision is kept across the wide range of moment
// magnitudes in one block; exp_avg_sq is never negative, so its map spends the
// sign bit on magnitudes. Midpoints between neighbouring codes decide nearest
// rounding.
struct CodeMap {
  float values[kCodes];     // ascending
  float midpoints[kCodes];  // midpoints[c] between values[c] and values[c + 1]; the last unused
};
struct CodeMaps {
  CodeMap signed_map;    // exp_avg
  CodeMap unsigned_map;  // exp_avg_sq, max_exp_avg_sq
};

// Built once on the host (state_codec.cpp); the CUDA kernel gets a device copy.
const CodeMaps& code_maps();

// Host-only shortcut for count_below: floats that share their top
// kBucketBits bits (sign, exponent, 7 mantissa bits) form a bucket, and a
// bucket holds at most one entry of a sorted array's first 255 (code_search()
// checks, and throws otherwise). So one table entry per bucket gives a value's
// count: the count below the bucket's lowest value (bits 0-7), plus one if the
// value's bucket_key exceeds the key of that next sorted entry (bits 8-24;
// kNoStep where that entry lies above the bucket). One load, one compare: the
// CPU's vector loops gather it.
constexpr int kBucketBits = 16;
constexpr uint32_t kBucketKeyMask = (1u << (32 - kBucketBits)) - 1;
constexpr uint32_t kNoStep = kBucketKeyMask + 1;  // above every bucket_key
struct CodeSearch {
  uint32_t signed_midpoints[1 << kBucketBits];
  uint32_t unsigned_midpoints[1 << kBucketBits];
  uint32_t unsigned_values[1 << kBucketBits];
};
const CodeSearch& code_search();

namespace {

SWAP_HOST_DEVICE inline uint64_t mix64(uint64_t x) {  // splitmix64's finalizer
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

// The generator's key for one (seed, param, moment), computed once per row.
SWAP_HOST_DEVICE inline uint64_t rounding_key(uint64_t seed, int64_t param_index, int moment) {
  return mix64(mix64(seed + 0x9e3779b97f4a7c15ULL) ^ (static_cast<uint64_t>(param_index) * 4 + moment));
}

// A 32-bit finalizer (lowbias32, from Wellons' hash-prospector). The per-element
// bits are made of it: in 32-bit lanes it vectorises on every ISA, where
// mix64's 64-bit multiplies are emulated on AVX2 (they bounded bf16 steps there).
SWAP_HOST_DEVICE inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// The part of an element's rounding bits that all its moments share: its
// index (both halves: a state may hold more than 2^32 elements) and the step.
// In two parts, so that a CPU loop hashes the high half and the step once per
// run of 2^32 indices (index_high_hash) and each element's low half alone.
SWAP_HOST_DEVICE inline uint32_t index_high_hash(uint64_t index, uint32_t step) {
  return mix32(static_cast<uint32_t>(index >> 32) ^ mix32(step));
}

SWAP_HOST_DEVICE inline uint32_t element_hash_from(uint32_t index_low, uint32_t high_hash) {
  return mix32(index_low ^ high_hash);
}

SWAP_HOST_DEVICE inline uint32_t element_rounding_hash(int64_t global_index, uint32_t step) {
  const uint64_t index = static_cast<uint64_t>(global_index);
  return element_hash_from(static_cast<uint32_t>(index), index_high_hash(index, step));
}

// A row's rounding_key folded to the 32 bits the per-element hash takes.
SWAP_HOST_DEVICE inline uint32_t folded_key(uint64_t key) { return static_cast<uint32_t>(key ^ (key >> 32)); }

// 32 random bits for one element of the state whose folded key is `key_bits`.
SWAP_HOST_DEVICE inline uint32_t rounding_bits_folded(uint32_t key_bits, uint32_t element_hash) {
  return mix32(key_bits ^ element_hash);
}

// 32 random bits for one element of the state keyed `key` (rounding_key).
SWAP_HOST_DEVICE inline uint32_t rounding_bits_of(uint64_t key, uint32_t element_hash) {
  return rounding_bits_folded(folded_key(key), element_hash);
}

// 32 random bits for one element at one step.
SWAP_HOST_DEVICE inline uint32_t rounding_bits(uint64_t key, int64_t global_index, uint32_t step) {
  return rounding_bits_of(key, element_rounding_hash(global_index, step));
}

SWAP_HOST_DEVICE inline uint32_t float_bits(float x) {
  union { float f; uint32_t u; } v{x};
  return v.u;
}

SWAP_HOST_DEVICE inline float float_from_bits(uint32_t u) {
  union { uint32_t u; float f; } v{u};
  return v.f;
}

SWAP_HOST_DEVICE inline float bf16_bits_to_float(uint16_t bits) {
  return float_from_bits(static_cast<uint32_t>(bits) << 16);
}

// x rounded to bf16, up or down with probability proportional to the distance
// (the 16 dropped bits plus 16 random ones carry into the kept bits or not).
// NaN and infinities round to nearest.
SWAP_HOST_DEVICE inline uint16_t bf16_bits_stochastic(float x, uint32_t random) {
  const uint32_t bits = float_bits(x);
  if ((bits & 0x7f800000u) == 0x7f800000u) {  // inf or NaN: keep it (quiet NaN)
    return static_cast<uint16_t>((bits >> 16) | ((bits & 0x007fffffu) ? 0x0040u : 0u));
  }
  return static_cast<uint16_t>((bits + (random & 0xffffu)) >> 16);
}

// |x| (also of -0.0), 0 for NaN: the block max then ignores NaN and does not
// depend on the reduction's order. A NaN moment is stored as code 0.
SWAP_HOST_DEVICE inline float magnitude_for_absmax(float x) {
  return x == x ? fabsf(x) : 0.f;
}

// A float's rank among the floats of its bucket: its low bits, reversed for
// negative floats, whose bits grow as they fall.
SWAP_HOST_DEVICE inline uint32_t bucket_key(uint32_t bits) {
  return (bits & kBucketKeyMask) ^ ((bits >> 31) != 0 ? kBucketKeyMask : 0u);
}

// How many of sorted[0..254] are below x: a binary search of fixed depth, or,
// given the table of `sorted` (CodeSearch, host only), one entry and a
// compare. Above sorted[254] (+inf, which shares its bucket with NaNs) the
// count is 255 either way. No branch depends on x: the CPU loops run this on
// every element.
SWAP_HOST_DEVICE inline int count_below(const float* sorted, const uint32_t* buckets, float x) {
  if (buckets != nullptr) {
    const uint32_t bits = float_bits(x);
    const uint32_t entry = buckets[bits >> (32 - kBucketBits)];
    const int index = static_cast<int>((entry & 0xffu) + (bucket_key(bits) > (entry >> 8) ? 1u : 0u));
    return x > sorted[kCodes - 2] ? kCodes - 1 : index;
  }
  int index = 0;
  for (int step = kCodes / 2; step > 0; step /= 2) index += sorted[index + step - 1] < x ? step : 0;
  return index;
}

// x as a multiple of its block's absmax, which codes approximate; 0 when absmax is 0.
SWAP_HOST_DEVICE inline float normalized_for_code(float x, float absmax) { return absmax > 0.f ? x / absmax : 0.f; }

// How a state's value is rounded to a code (the codec ops' `rounding`):
// nearest (signed states: momentum, exp_avg), nearest but never 0 for a
// positive value (states in a denominator), up (running maxima). Only nearest
// rounds into the signed map: the other two are rules for states that are
// never negative.
enum CodeRounding : int { kRoundNearest = 0, kRoundNearestNonzero = 1, kRoundUp = 2 };
// Which map a code array uses (the codec ops' `code_map`).
enum CodeMapKind : int { kSignedMap = 0, kUnsignedMap = 1 };

// The code of x under `rounding`, given normalized_for_code(x, absmax);
// buckets (host only, may be null) as count_below's: midpoints for
// nearest, values for up.
//  - nearest: the nearest code to the normalized value (ties to the lower);
//  - nearest nonzero: the same, but never 0 for a positive x. A second moment
//    rounded to 0 beside a first moment that is not (a rarely used embedding
//    row in a block with busy ones) would step by lr * m / eps;
//  - up: the smallest code that decodes to at least x (x >= 0, absmax >= x).
SWAP_HOST_DEVICE inline uint8_t code_of_normalized(const CodeMap& map, const uint32_t* buckets, int rounding,
                                                   float x, float normalized, float absmax) {
  if (rounding == kRoundUp) {
    const int code = count_below(map.values, buckets, normalized);  // the first value >= normalized
    // +1 where the division rounded down.
    return static_cast<uint8_t>(code + static_cast<int>((code < kCodes - 1) & (map.values[code] * absmax < x)));
  }
  const int code = count_below(map.midpoints, buckets, normalized);
  if (rounding == kRoundNearestNonzero) return static_cast<uint8_t>(code | static_cast<int>((code == 0) & (x > 0.f)));
  return static_cast<uint8_t>(code);
}

// The code of x in a block of absmax `absmax` under `rounding`.
SWAP_HOST_DEVICE inline uint8_t encode_code(const CodeMap& map, const uint32_t* buckets, int rounding, float x,
                                            float absmax) {
  return code_of_normalized(map, buckets, rounding, x, normalized_for_code(x, absmax), absmax);
}

// The map a code array of kind `map_kind` (CodeMapKind) uses.
SWAP_HOST_DEVICE inline const CodeMap& code_map_of(const CodeMaps& maps, int map_kind) {
  return map_kind == kSignedMap ? maps.signed_map : maps.unsigned_map;
}

SWAP_HOST_DEVICE inline float decode(const CodeMap& map, uint8_t code, float absmax) {
  return map.values[code] * absmax;
}

// The CodeSearch table count_below wants for (map, rounding); signed
// round-up has none (and is not a rule any state uses).
SWAP_HOST_DEVICE inline const uint32_t* code_buckets_for(const CodeSearch& search, int map_kind, int rounding) {
  if (map_kind == kSignedMap) return search.signed_midpoints;
  return rounding == kRoundUp ? search.unsigned_values : search.unsigned_midpoints;
}

// x's stochastic bf16 rounding as element `global_index` of the state keyed
// `key` (rounding_key) at `step`: the same bits wherever and however the
// element is processed.
SWAP_HOST_DEVICE inline uint16_t bf16_bits_stochastic_at(float x, uint64_t key, int64_t global_index, uint32_t step) {
  return bf16_bits_stochastic(x, rounding_bits(key, global_index, step));
}

}  // namespace
}  // namespace swap_optimizer
