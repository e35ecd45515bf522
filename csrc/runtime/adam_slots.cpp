#include "adam_slots.h"

#include <c10/util/Exception.h>

namespace swap_optimizer::runtime {
namespace {

// The dtype of a param's unquantized moments.
c10::ScalarType state_dtype_of(const RuntimeOptions& options, c10::ScalarType param_dtype) {
  if (!options.state_dtype.has_value() || *options.state_dtype == at::kByte) return param_dtype;
  return *options.state_dtype;
}

StateLayout per_element(int64_t bytes) { return {StateKind::kPerElement, bytes, 1}; }

}  // namespace

std::vector<SlotSpec> make_slot_specs(const std::vector<at::Tensor>& params,
                                      const std::vector<int64_t>& group_of_param,
                                      const std::vector<bool>& group_amsgrad,
                                      const std::vector<bool>& swappable,
                                      const RuntimeOptions& options) {
  TORCH_CHECK_VALUE(group_of_param.size() == params.size() && swappable.size() == params.size(),
                    "SwapRuntime: one group index and one swappable flag per param");
  std::vector<SlotSpec> specs;
  specs.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& param = params[i];
    const int64_t group = group_of_param[i];
    TORCH_CHECK_VALUE(group >= 0 && group < static_cast<int64_t>(group_amsgrad.size()),
                      "SwapRuntime: param ", i, " names group ", group, " of ",
                      group_amsgrad.size());
    const c10::ScalarType dtype = param.scalar_type();
    TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                     "SwapOptimizer: param ", i, " has dtype ", dtype,
                     "; supported are float32, bfloat16 and float16");
    const bool quantized = options.state_dtype == at::kByte &&
                           (options.quantized_params.empty() ? param.numel() >= kMinQuantizedNumel
                                                             : static_cast<bool>(options.quantized_params[i]));
    const bool amsgrad = group_amsgrad[group];
    const int64_t moment_bytes =
        quantized ? 1 : static_cast<int64_t>(c10::elementSize(state_dtype_of(options, dtype)));
    SlotSpec spec{param.numel(), static_cast<bool>(swappable[i]), std::vector<StateLayout>(kAdamKeyCount)};
    spec.states[kExpAvg] = spec.states[kExpAvgSq] = per_element(moment_bytes);
    if (amsgrad) spec.states[kMaxExpAvgSq] = per_element(moment_bytes);
    if (options.master_weights && dtype != at::kFloat) spec.states[kMaster] = per_element(4);
    if (quantized) {
      const StateLayout scales{StateKind::kPerBlock, 4, kScaleBlock};
      spec.states[kExpAvgAbsmax] = spec.states[kExpAvgSqAbsmax] = scales;
      if (amsgrad) spec.states[kMaxExpAvgSqAbsmax] = scales;
    }
    if (options.kahan_summation && dtype != at::kFloat) {
      spec.states[kCompensation] = per_element(static_cast<int64_t>(c10::elementSize(dtype)));
    }
    specs.push_back(std::move(spec));
  }
  return specs;
}

std::vector<std::vector<StateDescription>> adam_state_descriptions(const std::vector<at::Tensor>& params,
                                                                   const std::vector<SlotSpec>& specs,
                                                                   const RuntimeOptions& options) {
  std::vector<std::vector<StateDescription>> descriptions;
  for (size_t i = 0; i < params.size(); ++i) {
    const SlotSpec& spec = specs[i];
    const c10::ScalarType param_dtype = params[i].scalar_type();
    const bool quantized = spec.states[kExpAvgAbsmax].kind != StateKind::kAbsent;
    std::vector<StateDescription>& keys = descriptions.emplace_back(kAdamKeyCount);
    for (int key = 0; key < kAdamKeyCount; ++key) {
      if (!key_kept(spec, key)) continue;
      StateDescription& d = keys[key];
      d.shape = params[i].sizes().vec();
      if (key == kMaster) {
        d = {kAdamKeyNames[key], at::kFloat, d.shape};
      } else if (key == kCompensation) {
        d = {kAdamKeyNames[key], param_dtype, d.shape};
      } else if (key >= kExpAvgAbsmax) {  // one float32 per block
        d = {kAdamKeyNames[key], at::kFloat, {key_bytes(spec, key, spec.numel) / 4}};
      } else if (quantized) {
        // Never the plain names, which torch.optim would read as values.
        d = {std::string(kAdamKeyNames[key]) + "_codes", at::kByte, d.shape};
      } else {
        d = {kAdamKeyNames[key], state_dtype_of(options, param_dtype), d.shape};
      }
    }
  }
  return descriptions;
}

}  // namespace swap_optimizer::runtime
