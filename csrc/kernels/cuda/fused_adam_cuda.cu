// CUDA kernel of swap_optimizer::fused_adam_packed.
//
// One call builds a small table on the host (per-param pointers, per-block
// chunk list), copies it to the device on the current stream, then launches a
// prepare kernel (per-param bias corrections and step increments) and one
// update launch per (param dtype, state dtype) pair present, so at most six
// launches however many params the batch holds. Each block of an update launch
// handles one chunk of one param: 16-byte vector loads and stores when every
// pointer of that param is 16-byte aligned, scalar accesses otherwise and for
// the tail.
#include "../adam_math.h"
#include "../compact_update.h"
#include "../packed_layout.h"
#include "../op_registry.h"

#include <cub/block/block_reduce.cuh>

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <vector>

namespace swap_optimizer {
namespace {

constexpr int64_t kChunkElements = 16384;
constexpr int kThreads = 256;
constexpr int64_t kVectorBytes = 16;

struct ParamDesc {
  void* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  void* max_exp_avg_sq;
  float* master;
  int64_t numel;
  int32_t param_index;  // index into the call's step scalars
  int32_t vectorized;   // every pointer above is 16-byte aligned
};

struct ChunkDesc {
  int32_t desc_index;
  int32_t chunk_index;
};

// ILP elements of T; a multiple of 16 bytes, loaded as 128-bit accesses.
template <typename T, int ILP>
struct alignas(kVectorBytes) Pack {
  T value[ILP];
};

// Which step count a row reads, and whether it writes it back incremented.
struct StepRef {
  int64_t step_index;
  int64_t advance;
};

// Rows of one call have distinct step indices (validated), so no two threads
// touch the same count.
__global__ void prepare_steps_kernel(float* steps, const StepRef* refs, StepScalars* scalars,
                                     int64_t count, double lr, double beta1, double beta2,
                                     const float* found_inf) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count || (found_inf != nullptr && *found_inf != 0.f)) return;
  const StepRef ref = refs[i];
  const float next_step = steps[ref.step_index] + 1.0f;
  scalars[i] = make_step_scalars(lr, beta1, beta2, next_step);
  if (ref.advance) steps[ref.step_index] = next_step;
}

template <typename param_t, typename state_t>
__device__ __forceinline__ void update_one(const ParamDesc& d, int64_t i,
                                           const AdamHyper& hyper, const StepScalars& s,
                                           const float* grad_scale) {
  auto* param = static_cast<param_t*>(d.param);
  auto* exp_avg = static_cast<state_t*>(d.exp_avg);
  auto* exp_avg_sq = static_cast<state_t*>(d.exp_avg_sq);
  auto* max_exp_avg_sq = static_cast<state_t*>(d.max_exp_avg_sq);
  float p = d.master ? master_or_written_param(d.master[i], param[i]) : static_cast<float>(param[i]);
  float g = static_cast<float>(static_cast<const param_t*>(d.grad)[i]);
  if (grad_scale) g = g / *grad_scale;
  float m = static_cast<float>(exp_avg[i]);
  float v = static_cast<float>(exp_avg_sq[i]);
  float v_max = hyper.amsgrad ? static_cast<float>(max_exp_avg_sq[i]) : 0.f;
  adam_update(p, g, m, v, v_max, hyper, s);
  if (d.master) d.master[i] = p;
  param[i] = static_cast<param_t>(p);
  exp_avg[i] = static_cast<state_t>(m);
  exp_avg_sq[i] = static_cast<state_t>(v);
  if (hyper.amsgrad) max_exp_avg_sq[i] = static_cast<state_t>(v_max);
}

template <typename T, int ILP>
__device__ __forceinline__ Pack<T, ILP> load_pack(const void* base, int64_t i) {
  return *reinterpret_cast<const Pack<T, ILP>*>(static_cast<const T*>(base) + i);
}

template <typename T, int ILP>
__device__ __forceinline__ void store_pack(void* base, int64_t i, const Pack<T, ILP>& pack) {
  *reinterpret_cast<Pack<T, ILP>*>(static_cast<T*>(base) + i) = pack;
}

template <typename param_t, typename state_t>
__device__ __forceinline__ void update_vector(const ParamDesc& d, int64_t i,
                                              const AdamHyper& hyper, const StepScalars& s,
                                              const float* grad_scale) {
  constexpr int ILP = kVectorBytes / sizeof(param_t);
  Pack<param_t, ILP> param = load_pack<param_t, ILP>(d.param, i);
  const Pack<param_t, ILP> grad = load_pack<param_t, ILP>(d.grad, i);
  Pack<state_t, ILP> exp_avg = load_pack<state_t, ILP>(d.exp_avg, i);
  Pack<state_t, ILP> exp_avg_sq = load_pack<state_t, ILP>(d.exp_avg_sq, i);
  Pack<state_t, ILP> max_exp_avg_sq;
  Pack<float, ILP> master;
  if (hyper.amsgrad) max_exp_avg_sq = load_pack<state_t, ILP>(d.max_exp_avg_sq, i);
  if (d.master) master = load_pack<float, ILP>(d.master, i);
  const float scale = grad_scale ? *grad_scale : 1.f;
#pragma unroll
  for (int k = 0; k < ILP; ++k) {
    float p = d.master ? master_or_written_param(master.value[k], param.value[k]) : static_cast<float>(param.value[k]);
    float g = static_cast<float>(grad.value[k]);
    if (grad_scale) g = g / scale;
    float m = static_cast<float>(exp_avg.value[k]);
    float v = static_cast<float>(exp_avg_sq.value[k]);
    float v_max = hyper.amsgrad ? static_cast<float>(max_exp_avg_sq.value[k]) : 0.f;
    adam_update(p, g, m, v, v_max, hyper, s);
    master.value[k] = p;
    param.value[k] = static_cast<param_t>(p);
    exp_avg.value[k] = static_cast<state_t>(m);
    exp_avg_sq.value[k] = static_cast<state_t>(v);
    if (hyper.amsgrad) max_exp_avg_sq.value[k] = static_cast<state_t>(v_max);
  }
  store_pack(d.param, i, param);
  store_pack(d.exp_avg, i, exp_avg);
  store_pack(d.exp_avg_sq, i, exp_avg_sq);
  if (hyper.amsgrad) store_pack(d.max_exp_avg_sq, i, max_exp_avg_sq);
  if (d.master) store_pack(d.master, i, master);
}

template <typename param_t, typename state_t>
__global__ void __launch_bounds__(kThreads)
    packed_adam_kernel(const ParamDesc* descs, const ChunkDesc* chunks,
                       const StepScalars* scalars, AdamHyper hyper, const float* grad_scale,
                       const float* found_inf) {
  if (found_inf != nullptr && *found_inf != 0.f) return;
  const ChunkDesc chunk = chunks[blockIdx.x];
  const ParamDesc d = descs[chunk.desc_index];
  const StepScalars s = scalars[d.param_index];
  const int64_t begin = static_cast<int64_t>(chunk.chunk_index) * kChunkElements;
  const int64_t end = min(begin + kChunkElements, d.numel);
  if (d.vectorized) {
    constexpr int ILP = kVectorBytes / sizeof(param_t);
    for (int64_t i = begin + threadIdx.x * ILP; i < end; i += kThreads * ILP) {
      if (i + ILP <= end) {
        update_vector<param_t, state_t>(d, i, hyper, s, grad_scale);
      } else {
        for (int64_t j = i; j < end; ++j) update_one<param_t, state_t>(d, j, hyper, s, grad_scale);
      }
    }
  } else {
    for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
      update_one<param_t, state_t>(d, i, hyper, s, grad_scale);
    }
  }
}

// Rows with compact states (compact_update.h): one block per chunk of a row.
// An 8-bit row is updated a quantization block (kThreads elements, one per
// thread) at a time; the block's absmax is a CUB block reduction.
static_assert(kThreads == kQuantBlock, "one thread per element of a quantization block");

struct AbsmaxOp {
  __device__ float operator()(float a, float b) const { return b > a ? b : a; }
};

template <typename param_t>
__device__ void update_codes_chunk(const CompactRow& r, int64_t begin, int64_t end, const AdamHyper& hyper,
                                   const StepScalars& s, const float* grad_scale, const CodeMaps& maps) {
  using BlockReduce = cub::BlockReduce<float, kThreads>;
  __shared__ typename BlockReduce::TempStorage temp;
  __shared__ float block_absmax[3];
  const int moments = hyper.amsgrad ? 3 : 2;
  for (int64_t block = begin; block < end; block += kQuantBlock) {
    const int64_t i = block + threadIdx.x;
    const bool active = i < end;
    float value[3] = {0.f, 0.f, 0.f};
    if (active) update_code_element<param_t>(r, maps, i, hyper, s, grad_scale, value);
    for (int k = 0; k < moments; ++k) {
      const float absmax = BlockReduce(temp).Reduce(active ? magnitude_for_absmax(value[k]) : 0.f, AbsmaxOp{});
      if (threadIdx.x == 0) block_absmax[k] = absmax;
      __syncthreads();  // temp is reused by the next reduction; block_absmax is read below
    }
    if (threadIdx.x == 0) {
      for (int k = 0; k < moments; ++k) r.absmax[k][block / kQuantBlock] = block_absmax[k];
    }
    if (active) {
      for (int k = 0; k < moments; ++k) store_code(r, maps, k, i, value[k], block_absmax[k]);
    }
    __syncthreads();  // block_absmax is rewritten by the next block
  }
}

template <typename param_t, typename state_t>
__global__ void __launch_bounds__(kThreads)
    compact_adam_kernel(const CompactRow* rows, const ChunkDesc* chunks, const StepScalars* scalars,
                        AdamHyper hyper, const float* grad_scale, const float* found_inf,
                        const CodeMaps* maps) {
  if (found_inf != nullptr && *found_inf != 0.f) return;
  const ChunkDesc chunk = chunks[blockIdx.x];
  const CompactRow r = rows[chunk.desc_index];
  const StepScalars s = scalars[r.scalars_index];
  const int64_t begin = static_cast<int64_t>(chunk.chunk_index) * kChunkElements;
  const int64_t end = min(begin + kChunkElements, r.numel);
  if constexpr (std::is_same_v<state_t, uint8_t>) {
    update_codes_chunk<param_t>(r, begin, end, hyper, s, grad_scale, *maps);
  } else {
    for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
      update_value_element<param_t, state_t>(r, i, hyper, s, grad_scale);
    }
  }
}

// Compact rows are grouped by (param dtype, state dtype): 3 x 4 kernels.
constexpr c10::ScalarType kParamDtypes[] = {c10::kFloat, c10::kBFloat16, c10::kHalf};
constexpr c10::ScalarType kStateDtypes[] = {c10::kFloat, c10::kBFloat16, c10::kHalf, c10::kByte};
constexpr int kCompactGroups = 12;

int compact_group(const ParamRegions& r) {
  int p = 0, s = 0;
  while (kParamDtypes[p] != r.param_dtype) ++p;
  while (kStateDtypes[s] != r.state_dtype) ++s;
  return p * 4 + s;
}

bool aligned(const void* pointer) {
  return pointer == nullptr || reinterpret_cast<uintptr_t>(pointer) % kVectorBytes == 0;
}

constexpr int kGroups = static_cast<int>(DtypePair::kCount);

template <typename T>
size_t round_up_bytes(size_t n) {
  return (n + alignof(T) - 1) / alignof(T) * alignof(T);
}

void fused_adam_packed_cuda(at::TensorList params, at::TensorList grads,
                            const at::Tensor& arena, const at::Tensor& layout,
                            const at::Tensor& steps, double lr, double beta1, double beta2,
                            double eps, double weight_decay, bool amsgrad, bool maximize,
                            bool decoupled_weight_decay,
                            std::optional<c10::ScalarType> state_dtype,
                            const std::optional<at::Tensor>& grad_scale,
                            const std::optional<at::Tensor>& found_inf,
                            std::optional<int64_t> rounding_seed) {
  const PackedUpdateArgs args{lr, beta1, beta2, eps, weight_decay,
                              amsgrad, maximize, decoupled_weight_decay};
  const std::vector<ParamRegions> regions = validate_packed_update(
      params, grads, arena, layout, steps, state_dtype, args, grad_scale, found_inf, rounding_seed);
  TORCH_CHECK_VALUE(arena.is_cuda(), "fused_adam_packed (CUDA): arena on ", arena.device());
  const int64_t count = static_cast<int64_t>(regions.size());
  if (count == 0) return;

  const c10::cuda::CUDAGuard guard(arena.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  uint8_t* base = arena.data_ptr<uint8_t>();

  std::vector<ParamDesc> descs[kGroups];
  std::vector<ChunkDesc> chunks[kGroups];
  std::vector<CompactRow> compact_rows[kCompactGroups];
  std::vector<ChunkDesc> compact_chunks[kCompactGroups];
  bool any_quantized = false;
  std::vector<StepRef> step_refs;
  for (int64_t i = 0; i < count; ++i) {
    const ParamRegions& r = regions[i];
    step_refs.push_back({r.step_index, r.advance_step ? 1 : 0});
    if (r.numel == 0) continue;
    const int64_t chunk_count = (r.numel + kChunkElements - 1) / kChunkElements;
    TORCH_CHECK_VALUE(chunk_count <= std::numeric_limits<int32_t>::max(),
                      "fused_adam_packed: param ", i, " is too large");
    if (r.compact(rounding_seed.has_value())) {
      const int g = compact_group(r);
      any_quantized |= r.quantized();
      for (int64_t c = 0; c < chunk_count; ++c) {
        compact_chunks[g].push_back({static_cast<int32_t>(compact_rows[g].size()), static_cast<int32_t>(c)});
      }
      compact_rows[g].push_back(make_compact_row(r, base, params[i], grads[i], rounding_seed, static_cast<int32_t>(i)));
      continue;
    }
    auto state_at = [&](int64_t offset) -> void* {
      return offset == kAbsent ? nullptr : base + offset;
    };
    const int64_t element_bytes = static_cast<int64_t>(c10::elementSize(r.param_dtype));
    ParamDesc d{static_cast<uint8_t*>(params[i].data_ptr()) + r.param_offset * element_bytes,
                static_cast<const uint8_t*>(grads[i].const_data_ptr()) + r.param_offset * element_bytes,
                state_at(r.exp_avg),
                state_at(r.exp_avg_sq), state_at(r.max_exp_avg_sq),
                static_cast<float*>(state_at(r.master)), r.numel, static_cast<int32_t>(i), 0};
    d.vectorized = aligned(d.param) && aligned(d.grad) && aligned(d.exp_avg) &&
                   aligned(d.exp_avg_sq) && aligned(d.max_exp_avg_sq) && aligned(d.master);
    const int g = static_cast<int>(dtype_pair(r));
    for (int64_t c = 0; c < chunk_count; ++c) {
      chunks[g].push_back({static_cast<int32_t>(descs[g].size()), static_cast<int32_t>(c)});
    }
    descs[g].push_back(d);
  }

  // One host table, one H2D copy: scalars, step references, then each group's
  // descs and chunks, each compact group's rows and chunks, and the code maps
  // when a row is 8-bit.
  const size_t step_refs_offset = round_up_bytes<StepRef>(count * sizeof(StepScalars));
  size_t bytes = round_up_bytes<ParamDesc>(step_refs_offset + count * sizeof(StepRef));
  size_t desc_offset[kGroups], chunk_offset[kGroups];
  for (int g = 0; g < kGroups; ++g) {
    desc_offset[g] = bytes;
    bytes = round_up_bytes<ChunkDesc>(bytes + descs[g].size() * sizeof(ParamDesc));
    chunk_offset[g] = bytes;
    bytes = round_up_bytes<ParamDesc>(bytes + chunks[g].size() * sizeof(ChunkDesc));
  }
  size_t compact_row_offset[kCompactGroups], compact_chunk_offset[kCompactGroups];
  for (int g = 0; g < kCompactGroups; ++g) {
    bytes = round_up_bytes<CompactRow>(bytes);
    compact_row_offset[g] = bytes;
    bytes = round_up_bytes<ChunkDesc>(bytes + compact_rows[g].size() * sizeof(CompactRow));
    compact_chunk_offset[g] = bytes;
    bytes += compact_chunks[g].size() * sizeof(ChunkDesc);
  }
  const size_t maps_offset = round_up_bytes<CodeMaps>(bytes);
  if (any_quantized) bytes = maps_offset + sizeof(CodeMaps);
  at::Tensor host_table =
      at::empty({static_cast<int64_t>(bytes)}, arena.options().device(at::kCPU).pinned_memory(true));
  uint8_t* host = host_table.data_ptr<uint8_t>();
  std::copy(step_refs.begin(), step_refs.end(), reinterpret_cast<StepRef*>(host + step_refs_offset));
  for (int g = 0; g < kGroups; ++g) {
    std::copy(descs[g].begin(), descs[g].end(), reinterpret_cast<ParamDesc*>(host + desc_offset[g]));
    std::copy(chunks[g].begin(), chunks[g].end(), reinterpret_cast<ChunkDesc*>(host + chunk_offset[g]));
  }
  for (int g = 0; g < kCompactGroups; ++g) {
    std::copy(compact_rows[g].begin(), compact_rows[g].end(),
              reinterpret_cast<CompactRow*>(host + compact_row_offset[g]));
    std::copy(compact_chunks[g].begin(), compact_chunks[g].end(),
              reinterpret_cast<ChunkDesc*>(host + compact_chunk_offset[g]));
  }
  if (any_quantized) *reinterpret_cast<CodeMaps*>(host + maps_offset) = code_maps();
  at::Tensor device_table = at::empty_like(host_table, arena.options());
  device_table.copy_(host_table, /*non_blocking=*/true);
  uint8_t* table = device_table.data_ptr<uint8_t>();

  const float* found_inf_ptr = found_inf.has_value() ? found_inf->const_data_ptr<float>() : nullptr;
  const float* grad_scale_ptr = grad_scale.has_value() ? grad_scale->const_data_ptr<float>() : nullptr;
  auto* scalars = reinterpret_cast<StepScalars*>(table);
  const int64_t prepare_blocks = (count + kThreads - 1) / kThreads;
  prepare_steps_kernel<<<prepare_blocks, kThreads, 0, stream>>>(
      steps.data_ptr<float>(), reinterpret_cast<const StepRef*>(table + step_refs_offset), scalars, count, lr,
      beta1, beta2, found_inf_ptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  const AdamHyper hyper = make_adam_hyper(args);
  auto launch = [&](auto param_tag, auto state_tag, DtypePair pair) {
    using param_t = decltype(param_tag);
    using state_t = decltype(state_tag);
    const int g = static_cast<int>(pair);
    if (chunks[g].empty()) return;
    packed_adam_kernel<param_t, state_t><<<chunks[g].size(), kThreads, 0, stream>>>(
        reinterpret_cast<const ParamDesc*>(table + desc_offset[g]),
        reinterpret_cast<const ChunkDesc*>(table + chunk_offset[g]), scalars, hyper,
        grad_scale_ptr, found_inf_ptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  launch(float{}, float{}, DtypePair::kFloat);
  launch(c10::BFloat16{}, c10::BFloat16{}, DtypePair::kBFloat16);
  launch(c10::BFloat16{}, float{}, DtypePair::kBFloat16FloatState);
  launch(c10::Half{}, c10::Half{}, DtypePair::kHalf);
  launch(c10::Half{}, float{}, DtypePair::kHalfFloatState);

  auto launch_compact = [&](auto param_tag, auto state_tag, int g) {
    using param_t = decltype(param_tag);
    using state_t = decltype(state_tag);
    if (compact_chunks[g].empty()) return;
    compact_adam_kernel<param_t, state_t><<<compact_chunks[g].size(), kThreads, 0, stream>>>(
        reinterpret_cast<const CompactRow*>(table + compact_row_offset[g]),
        reinterpret_cast<const ChunkDesc*>(table + compact_chunk_offset[g]), scalars, hyper, grad_scale_ptr,
        found_inf_ptr, reinterpret_cast<const CodeMaps*>(table + maps_offset));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  auto launch_states = [&](auto param_tag, int p) {
    launch_compact(param_tag, float{}, p * 4);
    launch_compact(param_tag, c10::BFloat16{}, p * 4 + 1);
    launch_compact(param_tag, c10::Half{}, p * 4 + 2);
    launch_compact(param_tag, uint8_t{}, p * 4 + 3);
  };
  launch_states(float{}, 0);
  launch_states(c10::BFloat16{}, 1);
  launch_states(c10::Half{}, 2);
}

}  // namespace

TORCH_LIBRARY_IMPL(swap_optimizer, CUDA, m) {
  m.impl(kFusedAdamPackedOp, &fused_adam_packed_cuda);
}

}  // namespace swap_optimizer
