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

}  // namespace swap_optimizer
