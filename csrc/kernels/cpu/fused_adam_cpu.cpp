// CPU implementation of swap_optimizer::fused_adam_packed: validation, step
// counts and bias corrections, then the element loops of the best instruction
// set this CPU offers (capability_*.cpp).
#include "../op_registry.h"
#include "../packed_layout.h"
#include "compact_update_cpu.h"
#include "cpu_update.h"

#include <torch/library.h>

#include <array>

namespace swap_optimizer {
namespace {

void fused_adam_packed_cpu(at::TensorList params, at::TensorList grads, const at::Tensor& arena,
                           const at::Tensor& layout, const at::Tensor& steps, double lr,
                           double beta1, double beta2, double eps, double weight_decay,
                           bool amsgrad, bool maximize, bool decoupled_weight_decay,
                           std::optional<c10::ScalarType> state_dtype,
                           const std::optional<at::Tensor>& grad_scale,
                           const std::optional<at::Tensor>& found_inf,
                           std::optional<int64_t> rounding_seed) {
  const PackedUpdateArgs args{lr, beta1, beta2, eps, weight_decay,
                              amsgrad, maximize, decoupled_weight_decay};
  const std::vector<ParamRegions> regions = validate_packed_update(
      params, grads, arena, layout, steps, state_dtype, args, grad_scale, found_inf, rounding_seed);
  TORCH_CHECK_VALUE(arena.device().is_cpu(), "fused_adam_packed (CPU): arena is on ",
                    arena.device());
  if (found_inf.has_value() && found_inf->item<float>() != 0.f) {
    return;  // GradScaler saw an inf or NaN: skip the step, step counts included.
  }
  const float* scale = grad_scale.has_value() ? grad_scale->const_data_ptr<float>() : nullptr;
  const AdamHyper hyper = make_adam_hyper(args);
  uint8_t* base = arena.data_ptr<uint8_t>();
  auto at_offset = [base](int64_t offset) -> void* {
    return offset == kAbsent ? nullptr : base + offset;
  };

  float* step_counts = steps.data_ptr<float>();
  std::array<std::vector<CpuParamWork>, static_cast<size_t>(DtypePair::kCount)> groups;
  std::vector<CompactWork> compact;
  std::vector<StepScalars> compact_scalars;
  for (size_t i = 0; i < regions.size(); ++i) {
    const ParamRegions& r = regions[i];
    const float next_step = step_counts[r.step_index] + 1.0f;
    if (r.advance_step) step_counts[r.step_index] = next_step;
    if (r.numel == 0) continue;
    if (r.compact(rounding_seed.has_value())) {
      compact.push_back({make_compact_row(r, base, params[i], grads[i], rounding_seed,
                                          static_cast<int32_t>(compact_scalars.size())),
                         r.param_dtype, r.state_dtype});
      compact_scalars.push_back(make_step_scalars(lr, beta1, beta2, next_step));
      continue;
    }
    const int64_t element_bytes = static_cast<int64_t>(c10::elementSize(r.param_dtype));
    groups[static_cast<size_t>(dtype_pair(r))].push_back(
        {static_cast<uint8_t*>(params[i].data_ptr()) + r.param_offset * element_bytes,
         static_cast<const uint8_t*>(grads[i].const_data_ptr()) + r.param_offset * element_bytes, at_offset(r.exp_avg),
         at_offset(r.exp_avg_sq), at_offset(r.max_exp_avg_sq),
         static_cast<float*>(at_offset(r.master)), r.numel,
         make_step_scalars(lr, beta1, beta2, next_step)});
  }
  static const CpuUpdateFn update = SWAP_OPTIMIZER_FOR_THIS_CPU(update_params);
  for (size_t g = 0; g < groups.size(); ++g) {
    if (!groups[g].empty()) update(static_cast<DtypePair>(g), groups[g], hyper, scale);
  }
  static const CompactUpdateFn update_compact = SWAP_OPTIMIZER_FOR_THIS_CPU(update_compact_rows);
  if (!compact.empty()) update_compact(compact, compact_scalars, hyper, scale);
}

}  // namespace

TORCH_LIBRARY_IMPL(swap_optimizer, CPU, m) {
  m.impl(kFusedAdamPackedOp, &fused_adam_packed_cpu);
}

}  // namespace swap_optimizer
