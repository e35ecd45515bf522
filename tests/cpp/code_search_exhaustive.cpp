// Checks the host's bucket search for 8-bit codes (CodeSearch, count_below
// with bucket starts) against the binary search the CUDA kernels use, for
// every one of the 2^32 float bit patterns and each of the three tables.
// Run by tests/kernels/test_compact_codec.py (slow tier); exits 1 at the
// first difference, printing it.
#include "kernels/state_codec.h"

#include <cstdio>

int main() {
  using namespace swap_optimizer;
  const CodeMaps& maps = code_maps();
  const CodeSearch& search = code_search();
  const struct {
    const char* name;
    const float* sorted;
    const uint8_t* starts;
  } tables[] = {{"signed midpoints", maps.signed_map.midpoints, search.signed_midpoints},
                {"unsigned midpoints", maps.unsigned_map.midpoints, search.unsigned_midpoints},
                {"unsigned values", maps.unsigned_map.values, search.unsigned_values}};
  for (const auto& table : tables) {
    uint32_t bits = 0;
    do {
      const float x = float_from_bits(bits);
      const int bucketed = count_below(table.sorted, table.starts, x);
      const int searched = count_below(table.sorted, nullptr, x);
      if (bucketed != searched) {
        std::printf("%s: x bits 0x%08x: bucket search %d, binary search %d\n", table.name, bits, bucketed, searched);
        return 1;
      }
    } while (++bits != 0);
    std::printf("%s: all 2^32 floats agree\n", table.name);
  }
  return 0;
}
