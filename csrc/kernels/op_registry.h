// Names and schema of the ops this extension registers under the
// `swap_optimizer` namespace. The schema lives in bindings/ops.cpp
// (TORCH_LIBRARY); backends register implementations with TORCH_LIBRARY_IMPL.
#pragma once

namespace swap_optimizer {

constexpr const char* kFusedAdamPackedOp = "fused_adam_packed";

// One fused Adam/AdamW update of a batch of params whose states live in one
// packed byte arena at the offsets given by `layout` (see packed_layout.h).
// The op increments `steps` (one float32 count per param) unless found_inf is
// non-zero, in which case nothing at all is written. With rounding_seed, bf16
// states round stochastically (state_codec.h).
constexpr const char* kFusedAdamPackedSchema =
    "fused_adam_packed(Tensor(a!)[] params, Tensor[] grads, Tensor(b!) arena, "
    "Tensor layout, Tensor(c!) steps, *, float lr, float beta1, float beta2, float eps, "
    "float weight_decay, bool amsgrad, bool maximize, bool decoupled_weight_decay, "
    "ScalarType? state_dtype=None, Tensor? grad_scale=None, Tensor? found_inf=None, "
    "int? rounding_seed=None) -> ()";

// The codec ops (codec_batch.h): one call converts every tensor of a list
// between a compact form and values, elementwise, the same bits on the CPU and
// CUDA. Lists are parallel, one entry per tensor; every tensor of a call is on
// one device and contiguous.
//
// decode_blockwise_8bit: out[i] = dtype rounding of map[code] * absmax[block]
// (fp32 product), code_map[i] 0 = signed map, 1 = unsigned (state_codec.h).
constexpr const char* kDecodeBlockwise8bitOp = "decode_blockwise_8bit";
constexpr const char* kDecodeBlockwise8bitSchema =
    "decode_blockwise_8bit(Tensor[] codes, Tensor[] absmax, Tensor(a!)[] out, int[] code_map) -> ()";

// encode_blockwise_8bit: absmax[i] = per block of 256 the largest |value| (NaN
// as 0), codes[i] = each value's code under rounding[i]: 0 nearest, 1 nearest
// but never 0 for a positive value, 2 up (1 and 2 with the unsigned map only).
constexpr const char* kEncodeBlockwise8bitOp = "encode_blockwise_8bit";
constexpr const char* kEncodeBlockwise8bitSchema =
    "encode_blockwise_8bit(Tensor[] values, Tensor(a!)[] codes, Tensor(b!)[] absmax, int[] code_map, "
    "int[] rounding) -> ()";

// encode_bf16_stochastic: out[i] = values[i] (fp32) rounded to bf16
// stochastically, element j keyed by (seed, param_index[i], state_index[i] in
// 0..3, global_offset[i] + j, step[i]).
constexpr const char* kEncodeBf16StochasticOp = "encode_bf16_stochastic";
constexpr const char* kEncodeBf16StochasticSchema =
    "encode_bf16_stochastic(Tensor[] values, Tensor(a!)[] out, int seed, int[] param_index, int[] state_index, "
    "int[] global_offset, int[] step) -> ()";

}  // namespace swap_optimizer
