#include "state_codec.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

namespace swap_optimizer {
namespace {

// Seven decades; decade i (values 10^(i-6) * [0.1, 1]) gets 2^i fraction codes
// per sign (signed) or 2^(i+1) (unsigned): the means of equal steps from 0.1
// to 1. With 0 and 1 that is 256 codes either way. Computed in double, rounded
// once to float.
CodeMap make_dynamic_map(bool is_signed) {
  std::vector<double> values;
  constexpr int kDecades = 7;
  for (int i = 0; i < kDecades; ++i) {
    const int fractions = is_signed ? (1 << i) : (1 << (i + 1));
    const double scale = std::pow(10.0, i - (kDecades - 1));
    for (int k = 0; k < fractions; ++k) {
      const double low = 0.1 + 0.9 * k / fractions;
      const double high = 0.1 + 0.9 * (k + 1) / fractions;
      values.push_back(scale * (low + high) / 2);
      if (is_signed) values.push_back(-scale * (low + high) / 2);
    }
  }
  values.push_back(0.0);
  values.push_back(1.0);
  std::sort(values.begin(), values.end());
  CodeMap map{};
  for (int c = 0; c < kCodes; ++c) map.values[c] = static_cast<float>(values[c]);
  for (int c = 0; c + 1 < kCodes; ++c) map.midpoints[c] = (map.values[c] + map.values[c + 1]) / 2.f;
  map.midpoints[kCodes - 1] = map.values[kCodes - 1];
  return map;
}

// Bucket b holds the floats whose top bits are b; its lowest value is its
// smallest bit pattern when positive, its largest when negative. Buckets of
// infinities and NaNs (which compare below nothing) count 0 and never step:
// count_below takes +inf, the one value there that is not, out. Throws if a
// bucket holds two sorted entries at or below sorted[254] (above it
// count_below needs no entry).
void fill_buckets(const float* sorted, uint32_t* buckets) {
  constexpr int kLowBits = 32 - kBucketBits;
  for (uint32_t bucket = 0; bucket < (1u << kBucketBits); ++bucket) {
    const uint32_t top = bucket << kLowBits;
    if ((top & 0x7f800000u) == 0x7f800000u) {
      buckets[bucket] = kNoStep << 8;
      continue;
    }
    const bool negative = (bucket >> (kBucketBits - 1)) != 0;
    const int start = count_below(sorted, nullptr, float_from_bits(negative ? top | kBucketKeyMask : top));
    const float highest = std::min(float_from_bits(negative ? top : top | kBucketKeyMask), sorted[kCodes - 2]);
    if (count_below(sorted, nullptr, highest) - start > 1) {
      throw std::logic_error("state_codec: a code search bucket holds two code boundaries; raise kBucketBits");
    }
    // The next entry's key if it lies in this bucket (sorted[255] is read, never counted).
    const uint32_t next = float_bits(sorted[start]);
    const uint32_t key = (next >> kLowBits) == bucket ? bucket_key(next) : kNoStep;
    buckets[bucket] = static_cast<uint32_t>(start) | key << 8;
  }
}

}  // namespace

const CodeSearch& code_search() {
  static const CodeSearch search = [] {
    CodeSearch s{};
    const CodeMaps& maps = code_maps();
    fill_buckets(maps.signed_map.midpoints, s.signed_midpoints);
    fill_buckets(maps.unsigned_map.midpoints, s.unsigned_midpoints);
    fill_buckets(maps.unsigned_map.values, s.unsigned_values);
    return s;
  }();
  return search;
}

const CodeMaps& code_maps() {
  static const CodeMaps maps{make_dynamic_map(true), make_dynamic_map(false)};
  return maps;
}

}  // namespace swap_optimizer
