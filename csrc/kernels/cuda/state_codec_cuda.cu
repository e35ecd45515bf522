// CUDA implementations of the codec ops (codec_batch.h).
//
// One call: the host plans the call (entries, chunks), writes them and, for
// the 8-bit ops, the code maps into one pinned table, copies it to the device
// on the current stream (non-blocking) and makes one launch; each block of 256
// threads handles one chunk (16 quantization blocks) of one tensor, whatever
// the tensors' dtypes (a switch uniform over the block). The block first
// copies its tensor's code map into shared memory, where the search for a
// code and the decoding lookups read it. 8-bit encoding gives each warp one
// quantization block at a time (8 elements per lane); its absmax is a warp
// reduction of shuffles, with no __syncthreads in the loop. The max of
// magnitudes (NaN as 0) does not depend on the order, so the CPU's sequential
// max gives the same absmax, and the code is the same function of value and
// absmax (the CPU's bucket tables find the same count as the search here).
#include "../codec_batch.h"
#include "../op_registry.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>

namespace swap_optimizer {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpSize = 32;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kPerLane = kQuantBlock / kWarpSize;
static_assert(kQuantBlock % kWarpSize == 0, "a warp covers a quantization block in whole strides");

// Copies the entry's map into shared memory (all threads, then a barrier).
__device__ void load_map(CodeMap& shared, const CodeMaps& maps, int map_kind) {
  const CodeMap& map = code_map_of(maps, map_kind);
  for (int c = threadIdx.x; c < kCodes; c += blockDim.x) {
    shared.values[c] = map.values[c];
    shared.midpoints[c] = map.midpoints[c];
  }
  __syncthreads();
}

// Calls fn with a value of the entry's value dtype (a tag for templates).
template <typename Fn>
__device__ void with_value_type(const CodecEntry& e, Fn fn) {
  switch (e.value_dtype) {
    case kCodecBFloat16: fn(c10::BFloat16{}); break;
    case kCodecHalf: fn(c10::Half{}); break;
    default: fn(float{}); break;
  }
}

// A block's chunk: its entry, element range and (into `map`, shared) code map.
struct BlockChunk {
  CodecEntry e;
  int64_t begin, end;
};

__device__ BlockChunk start_chunk(const CodecEntry* entries, const CodecChunk* chunks, const CodeMaps* maps,
                                  CodeMap* map) {
  const CodecChunk chunk = chunks[blockIdx.x];
  BlockChunk b{entries[chunk.entry], 0, 0};
  if (map != nullptr) load_map(*map, *maps, b.e.map_kind);
  chunk_range(b.e, chunk, b.begin, b.end);
  return b;
}

__global__ void __launch_bounds__(kThreads)
    decode_8bit_kernel(const CodecEntry* entries, const CodecChunk* chunks, const CodeMaps* maps) {
  __shared__ CodeMap map;
  const BlockChunk b = start_chunk(entries, chunks, maps, &map);
  with_value_type(b.e, [&](auto tag) {
    using value_t = decltype(tag);
    for (int64_t i = b.begin + threadIdx.x; i < b.end; i += kThreads) codec_decode_element<value_t>(b.e, map, i);
  });
}

__global__ void __launch_bounds__(kThreads)
    encode_8bit_kernel(const CodecEntry* entries, const CodecChunk* chunks, const CodeMaps* maps) {
  __shared__ CodeMap map;
  const BlockChunk b = start_chunk(entries, chunks, maps, &map);
  const CodecEntry& e = b.e;
  const int64_t begin = b.begin, end = b.end;
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  with_value_type(e, [&](auto tag) {
    using value_t = decltype(tag);
    // The loop's condition is the same for every lane of a warp, so whole
    // warps take part in the shuffles.
    for (int64_t block = begin + static_cast<int64_t>(warp) * kQuantBlock; block < end;
         block += static_cast<int64_t>(kWarps) * kQuantBlock) {
      float value[kPerLane];
      float absmax = 0.f;
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        const int64_t i = block + lane + k * kWarpSize;
        value[k] = i < end ? codec_load<value_t>(e, i) : 0.f;
        absmax = absmax_step(absmax, value[k]);
      }
#pragma unroll
      for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
        absmax = absmax_step(absmax, __shfl_xor_sync(0xffffffffu, absmax, offset));
      }
      if (lane == 0) e.absmax[block / kQuantBlock] = absmax;
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        const int64_t i = block + lane + k * kWarpSize;
        if (i < end) codec_encode_code(e, map, nullptr, i, value[k], absmax);
      }
    }
  });
}

__global__ void __launch_bounds__(kThreads) encode_bf16_kernel(const CodecEntry* entries, const CodecChunk* chunks) {
  const BlockChunk b = start_chunk(entries, chunks, nullptr, nullptr);
  for (int64_t i = b.begin + threadIdx.x; i < b.end; i += kThreads) codec_encode_bf16_element(b.e, i);
}

template <typename T>
size_t round_up_bytes(size_t n) {
  return (n + alignof(T) - 1) / alignof(T) * alignof(T);
}

// The batch's table on the device: entries, chunks and (with_maps) the code
// maps, written into pinned memory and copied on the current stream.
struct DeviceTable {
  at::Tensor storage;
  const CodecEntry* entries;
  const CodecChunk* chunks;
  const CodeMaps* maps;
};

DeviceTable copy_table(const CodecBatch& batch, bool with_maps) {
  const size_t chunks_offset = round_up_bytes<CodecChunk>(batch.entries.size() * sizeof(CodecEntry));
  const size_t maps_offset = round_up_bytes<CodeMaps>(chunks_offset + batch.chunks.size() * sizeof(CodecChunk));
  const size_t bytes = with_maps ? maps_offset + sizeof(CodeMaps) : maps_offset;
  at::Tensor host = at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions(at::kByte).pinned_memory(true));
  uint8_t* h = host.data_ptr<uint8_t>();
  std::copy(batch.entries.begin(), batch.entries.end(), reinterpret_cast<CodecEntry*>(h));
  std::copy(batch.chunks.begin(), batch.chunks.end(), reinterpret_cast<CodecChunk*>(h + chunks_offset));
  if (with_maps) *reinterpret_cast<CodeMaps*>(h + maps_offset) = code_maps();
  at::Tensor device = at::empty_like(host, at::TensorOptions(at::kByte).device(batch.device));
  device.copy_(host, /*non_blocking=*/true);  // the caching host allocator keeps `host` until the copy is done
  const uint8_t* d = device.const_data_ptr<uint8_t>();
  return {device, reinterpret_cast<const CodecEntry*>(d), reinterpret_cast<const CodecChunk*>(d + chunks_offset),
          with_maps ? reinterpret_cast<const CodeMaps*>(d + maps_offset) : nullptr};
}

// Copies the batch's table and launches kernel over its chunks, on the current stream.
template <typename Kernel>
void launch(const CodecBatch& batch, const char* op, bool with_maps, Kernel kernel) {
  if (batch.empty()) return;
  TORCH_CHECK_VALUE(batch.device.is_cuda(), op, ": tensors are on ", batch.device, ", not a CUDA device");
  const c10::cuda::CUDAGuard guard(batch.device);
  const DeviceTable table = copy_table(batch, with_maps);
  kernel(table, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void decode_blockwise_8bit_cuda(at::TensorList codes, at::TensorList absmax, at::TensorList out,
                                at::IntArrayRef code_map) {
  constexpr const char* op = "decode_blockwise_8bit (CUDA)";
  const CodecBatch batch = plan_decode_8bit(op, codes, absmax, out, code_map);
  launch(batch, op, /*with_maps=*/true, [&](const DeviceTable& t, cudaStream_t stream) {
    decode_8bit_kernel<<<batch.chunks.size(), kThreads, 0, stream>>>(t.entries, t.chunks, t.maps);
  });
}

void encode_blockwise_8bit_cuda(at::TensorList values, at::TensorList codes, at::TensorList absmax,
                                at::IntArrayRef code_map, at::IntArrayRef rounding) {
  constexpr const char* op = "encode_blockwise_8bit (CUDA)";
  const CodecBatch batch = plan_encode_8bit(op, values, codes, absmax, code_map, rounding);
  launch(batch, op, /*with_maps=*/true, [&](const DeviceTable& t, cudaStream_t stream) {
    encode_8bit_kernel<<<batch.chunks.size(), kThreads, 0, stream>>>(t.entries, t.chunks, t.maps);
  });
}

void encode_bf16_stochastic_cuda(at::TensorList values, at::TensorList out, int64_t seed,
                                 at::IntArrayRef param_index, at::IntArrayRef state_index,
                                 at::IntArrayRef global_offset, at::IntArrayRef step) {
  constexpr const char* op = "encode_bf16_stochastic (CUDA)";
  const CodecBatch batch = plan_encode_bf16(op, values, out, seed, param_index, state_index, global_offset, step);
  launch(batch, op, /*with_maps=*/false, [&](const DeviceTable& t, cudaStream_t stream) {
    encode_bf16_kernel<<<batch.chunks.size(), kThreads, 0, stream>>>(t.entries, t.chunks);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(swap_optimizer, CUDA, m) {
  m.impl(kDecodeBlockwise8bitOp, &decode_blockwise_8bit_cuda);
  m.impl(kEncodeBlockwise8bitOp, &encode_blockwise_8bit_cuda);
  m.impl(kEncodeBf16StochasticOp, &encode_bf16_stochastic_cuda);
}

}  // namespace swap_optimizer
