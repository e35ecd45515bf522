// The codec ops (decode_blockwise_8bit, encode_blockwise_8bit,
// encode_bf16_stochastic; schemas in op_registry.h): one call converts a list
// of tensors between compact and plain forms. The host validates the call and
// describes it as entries (one per tensor) and chunks (pieces of an entry of
// kCodecChunkElements, counted from its first element, so quantization blocks
// never straddle two); the CPU loops and the CUDA kernels walk the same chunks
// and do the same per-element math (codec_elements below, state_codec.h).
#pragma once

#include "state_codec.h"

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <vector>

namespace swap_optimizer {

constexpr int64_t kCodecChunkElements = 16 * kQuantBlock;
static_assert(kCodecChunkElements % kQuantBlock == 0, "chunks hold whole quantization blocks");

// The dtype of an entry's values (the plain side).
enum CodecValueDtype : int32_t { kCodecFloat = 0, kCodecBFloat16 = 1, kCodecHalf = 2 };

// One tensor of a call. Decode: codes -> values; encode 8-bit: values ->
// codes + absmax; encode bf16: values (fp32) -> bf16 bits.
struct CodecEntry {
  const void* in;         // codes (decode) or values (encode)
  void* out;              // values (decode), codes or bf16 bits (encode)
  float* absmax;          // one per block: read (decode) or written (encode 8-bit); null for bf16
  int64_t numel;
  int64_t global_offset;  // bf16: the index of element 0 in the whole state
  uint64_t rounding_key;  // bf16: rounding_key(seed, param index, state index)
  int32_t value_dtype;    // CodecValueDtype
  int32_t map_kind;       // CodeMapKind (8-bit)
  int32_t rounding;       // CodeRounding (encode 8-bit)
  uint32_t step;          // bf16
};

struct CodecChunk {
  int32_t entry;
  int32_t chunk;  // elements [chunk * kCodecChunkElements, ...) of the entry
};

struct CodecBatch {
  std::vector<CodecEntry> entries;
  std::vector<CodecChunk> chunks;
  c10::Device device = c10::Device(c10::kCPU);
  bool empty() const { return chunks.empty(); }
};

// Each checks a whole call on the host before anything is written (counts,
// dtypes, one device, contiguity, sizes, flags) and throws with the tensor's
// index and the fix; `op` names the op (and backend) in messages.
CodecBatch plan_decode_8bit(const char* op, at::TensorList codes, at::TensorList absmax, at::TensorList out,
                            at::IntArrayRef code_map);
CodecBatch plan_encode_8bit(const char* op, at::TensorList values, at::TensorList codes, at::TensorList absmax,
                            at::IntArrayRef code_map, at::IntArrayRef rounding);
CodecBatch plan_encode_bf16(const char* op, at::TensorList values, at::TensorList out, int64_t seed,
                            at::IntArrayRef param_index, at::IntArrayRef state_index,
                            at::IntArrayRef global_offset, at::IntArrayRef step);

namespace {

// The element range [begin, end) of a chunk.
SWAP_HOST_DEVICE inline void chunk_range(const CodecEntry& e, const CodecChunk& c, int64_t& begin, int64_t& end) {
  begin = static_cast<int64_t>(c.chunk) * kCodecChunkElements;
  end = begin + kCodecChunkElements < e.numel ? begin + kCodecChunkElements : e.numel;
}

// Per-element pieces, the same on the CPU and CUDA (value_t: float,
// c10::BFloat16 or c10::Half; conversions round to nearest even on both).
template <typename value_t>
SWAP_HOST_DEVICE inline float codec_load(const CodecEntry& e, int64_t i) {
  return static_cast<float>(static_cast<const value_t*>(e.in)[i]);
}

// Decode: the dtype's rounding of map value * absmax (fp32 product).
template <typename value_t>
SWAP_HOST_DEVICE inline void codec_decode_element(const CodecEntry& e, const CodeMap& map, int64_t i) {
  const float value = decode(map, static_cast<const uint8_t*>(e.in)[i], e.absmax[i / kQuantBlock]);
  static_cast<value_t*>(e.out)[i] = static_cast<value_t>(value);
}

SWAP_HOST_DEVICE inline void codec_encode_code(const CodecEntry& e, const CodeMap& map, const uint32_t* buckets,
                                               int64_t i, float value, float absmax) {
  static_cast<uint8_t*>(e.out)[i] = encode_code(map, buckets, e.rounding, value, absmax);
}

SWAP_HOST_DEVICE inline void codec_encode_bf16_element(const CodecEntry& e, int64_t i) {
  static_cast<uint16_t*>(e.out)[i] =
      bf16_bits_stochastic_at(static_cast<const float*>(e.in)[i], e.rounding_key, e.global_offset + i, e.step);
}

SWAP_HOST_DEVICE inline float absmax_step(float absmax, float value) {
  const float magnitude = magnitude_for_absmax(value);
  return magnitude > absmax ? magnitude : absmax;
}

}  // namespace
}  // namespace swap_optimizer
