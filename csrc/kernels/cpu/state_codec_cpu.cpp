// CPU implementations of the codec ops (codec_batch.h): the call's chunks in
// parallel; fp32 values take the loops of the best instruction set this CPU
// offers (CodecLoops, compact_lanes.h), other dtypes a loop over the
// per-element math shared with CUDA. 8-bit encoding goes a quantization block
// at a time: the block's absmax (NaN as 0, so the order of the max does not
// matter), then its codes, found with the host's bucket tables (state_codec.h:
// the same codes as the search).
#include "../codec_batch.h"
#include "../op_registry.h"
#include "compact_update_cpu.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

namespace swap_optimizer {
namespace {

const CodecLoops& codec_loops() {
  static const CodecLoops loops = SWAP_OPTIMIZER_FOR_THIS_CPU(codec_loops)();
  return loops;
}

// Runs fn(entry, begin, end) over every chunk of the batch, in parallel.
template <typename Fn>
void for_each_chunk(const CodecBatch& batch, const char* op, Fn fn) {
  TORCH_CHECK_VALUE(batch.device.is_cpu(), op, ": tensors are on ", batch.device, ", not the CPU");
  at::parallel_for(0, static_cast<int64_t>(batch.chunks.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const CodecEntry& e = batch.entries[batch.chunks[c].entry];
      int64_t begin = 0, end = 0;
      chunk_range(e, batch.chunks[c], begin, end);
      fn(e, begin, end);
    }
  });
}

// Calls fn with a value of the entry's value dtype (a tag for templates).
template <typename Fn>
void with_value_type(const CodecEntry& e, Fn fn) {
  switch (e.value_dtype) {
    case kCodecBFloat16: fn(c10::BFloat16{}); break;
    case kCodecHalf: fn(c10::Half{}); break;
    default: fn(float{}); break;
  }
}

void decode_blockwise_8bit_cpu(at::TensorList codes, at::TensorList absmax, at::TensorList out,
                               at::IntArrayRef code_map) {
  constexpr const char* op = "decode_blockwise_8bit (CPU)";
  const CodecBatch batch = plan_decode_8bit(op, codes, absmax, out, code_map);
  const CodeMaps& maps = code_maps();
  for_each_chunk(batch, op, [&](const CodecEntry& e, int64_t begin, int64_t end) {
    if (e.value_dtype == kCodecFloat) return codec_loops().decode_8bit(e, begin, end);
    const CodeMap& map = code_map_of(maps, e.map_kind);
    with_value_type(e, [&](auto tag) {
      using value_t = decltype(tag);
      for (int64_t i = begin; i < end; ++i) codec_decode_element<value_t>(e, map, i);
    });
  });
}

void encode_blockwise_8bit_cpu(at::TensorList values, at::TensorList codes, at::TensorList absmax,
                               at::IntArrayRef code_map, at::IntArrayRef rounding) {
  constexpr const char* op = "encode_blockwise_8bit (CPU)";
  const CodecBatch batch = plan_encode_8bit(op, values, codes, absmax, code_map, rounding);
  const CodeMaps& maps = code_maps();
  const CodeSearch& search = code_search();
  for_each_chunk(batch, op, [&](const CodecEntry& e, int64_t begin, int64_t end) {
    if (e.value_dtype == kCodecFloat) return codec_loops().encode_8bit(e, begin, end);
    const CodeMap& map = code_map_of(maps, e.map_kind);
    const uint32_t* buckets = code_buckets_for(search, e.map_kind, e.rounding);
    with_value_type(e, [&](auto tag) {
      using value_t = decltype(tag);
      float value[kQuantBlock];
      for (int64_t block = begin; block < end; block += kQuantBlock) {
        const int64_t count = std::min(kQuantBlock, end - block);
        float block_absmax = 0.f;
        for (int64_t j = 0; j < count; ++j) {
          value[j] = codec_load<value_t>(e, block + j);
          block_absmax = absmax_step(block_absmax, value[j]);
        }
        e.absmax[block / kQuantBlock] = block_absmax;
        for (int64_t j = 0; j < count; ++j) codec_encode_code(e, map, buckets, block + j, value[j], block_absmax);
      }
    });
  });
}

void encode_bf16_stochastic_cpu(at::TensorList values, at::TensorList out, int64_t seed,
                                at::IntArrayRef param_index, at::IntArrayRef state_index,
                                at::IntArrayRef global_offset, at::IntArrayRef step) {
  constexpr const char* op = "encode_bf16_stochastic (CPU)";
  const CodecBatch batch = plan_encode_bf16(op, values, out, seed, param_index, state_index, global_offset, step);
  for_each_chunk(batch, op, [&](const CodecEntry& e, int64_t begin, int64_t end) {
    codec_loops().encode_bf16(e, begin, end);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(swap_optimizer, CPU, m) {
  m.impl(kDecodeBlockwise8bitOp, &decode_blockwise_8bit_cpu);
  m.impl(kEncodeBlockwise8bitOp, &encode_blockwise_8bit_cpu);
  m.impl(kEncodeBf16StochasticOp, &encode_bf16_stochastic_cpu);
}

}  // namespace swap_optimizer
