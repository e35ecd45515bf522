// Checks the host's searches for 8-bit codes for every one of the 2^32 float
// bit patterns and each of the three bucket tables. Built once per
// capability by tests/kernels/test_compact_codec.py (slow tier), with
// CPU_CAPABILITY and CPU_CAPABILITY_<NAME> defined as capability_*.cpp do:
//  - DEFAULT: count_below with the bucket table against the binary search
//    the CUDA kernels use;
//  - AVX2, AVX512 (built with the matching -m flags): count_below_lanes
//    (cpu/code_lanes.h) against count_below with the table. Prints that the
//    CPU lacks the instructions, and passes, where it does.
// Exits 1 at the first difference, printing it.
#include "kernels/cpu/code_lanes.h"

#include <cstdio>

namespace {

using namespace swap_optimizer;
using namespace swap_optimizer::CPU_CAPABILITY;

struct Table {
  const char* name;
  const float* sorted;
  const uint32_t* buckets;
};

#ifdef SWAP_OPTIMIZER_CODE_LANES
bool cpu_has_lanes() {
#if defined(CPU_CAPABILITY_AVX512)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
}

// The first difference in kCodeLanes floats from `first`, or -1.
int64_t first_difference(const Table& table, uint32_t first) {
  uint32_t bits[kCodeLanes];
  int32_t counts[kCodeLanes];
  for (int64_t j = 0; j < kCodeLanes; ++j) bits[j] = first + static_cast<uint32_t>(j);
  FloatLanes x;
  __builtin_memcpy(&x, bits, sizeof(x));
  const IntLanes lanes = count_below_lanes(table.sorted, table.buckets, x);
  __builtin_memcpy(counts, &lanes, sizeof(counts));
  for (int64_t j = 0; j < kCodeLanes; ++j) {
    const int expected = count_below(table.sorted, table.buckets, float_from_bits(bits[j]));
    if (counts[j] != expected) {
      std::printf("%s: x bits 0x%08x: lanes %d, count_below %d\n", table.name, bits[j], counts[j], expected);
      return j;
    }
  }
  return -1;
}
#endif

}  // namespace

int main() {
#ifdef SWAP_OPTIMIZER_CODE_LANES
  // First: the tables' build is compiled for the lanes' ISA too.
  if (!cpu_has_lanes()) {
    std::printf("this CPU lacks the instructions of these lanes\n");
    return 0;
  }
#endif
  const CodeMaps& maps = code_maps();
  const CodeSearch& search = code_search();
  const Table tables[] = {{"signed midpoints", maps.signed_map.midpoints, search.signed_midpoints},
                          {"unsigned midpoints", maps.unsigned_map.midpoints, search.unsigned_midpoints},
                          {"unsigned values", maps.unsigned_map.values, search.unsigned_values}};
#ifdef SWAP_OPTIMIZER_CODE_LANES
  for (const Table& table : tables) {
    uint32_t first = 0;
    do {
      if (first_difference(table, first) >= 0) return 1;
      first += kCodeLanes;
    } while (first != 0);
    std::printf("%s: lanes agree for all 2^32 floats\n", table.name);
  }
#else
  for (const Table& table : tables) {
    uint32_t bits = 0;
    do {
      const float x = float_from_bits(bits);
      const int bucketed = count_below(table.sorted, table.buckets, x);
      const int searched = count_below(table.sorted, nullptr, x);
      if (bucketed != searched) {
        std::printf("%s: x bits 0x%08x: bucket search %d, binary search %d\n", table.name, bits, bucketed, searched);
        return 1;
      }
    } while (++bits != 0);
    std::printf("%s: all 2^32 floats agree\n", table.name);
  }
#endif
  return 0;
}
