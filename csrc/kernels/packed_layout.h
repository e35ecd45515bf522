// The layout table that places each parameter's optimizer state inside one
// packed byte arena, and its validation. Shared by the CPU and CUDA kernels so
// both reject exactly the same tables, before any element is written.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace swap_optimizer {

// Columns of the int64 layout table, one row per parameter (or piece of one).
// State offsets are in bytes from the start of the arena; kAbsent marks a state
// that is not kept. A row updates elements [param_offset, param_offset + numel)
// of its param and grad, whose states sit at the offsets; its step count is
// steps[step_index], read as the step before this one, and written back
// incremented only when advance_step is 1 (the last piece of a split param, or
// a whole param), so every piece of a param uses the same step.
enum LayoutColumn : int64_t {
  kExpAvgOffset = 0,
  kExpAvgSqOffset = 1,
  kMaxExpAvgSqOffset = 2,
  kMasterOffset = 3,
  kNumel = 4,
  kParamOffset = 5,
  kStepIndex = 6,
  kAdvanceStep = 7,
  kLayoutColumns = 8,
};
constexpr int64_t kAbsent = -1;

// Byte offsets of one row's states, checked against its arena, and the part of
// its param it updates.
struct ParamRegions {
  int64_t exp_avg;
  int64_t exp_avg_sq;
  int64_t max_exp_avg_sq;  // kAbsent unless amsgrad
  int64_t master;          // kAbsent unless the fp32 master copy is kept
  int64_t numel;           // elements this row updates
  int64_t param_offset;    // its first element in the param and grad
  int64_t step_index;      // into the steps tensor
  bool advance_step;
  c10::ScalarType param_dtype;
  c10::ScalarType state_dtype;
};

// The (param dtype, state dtype) combinations the kernels are built for; each
// backend runs one typed loop or launch per pair present in a call.
enum class DtypePair : int {
  kFloat,  // fp32 param, fp32 states
  kBFloat16,
  kBFloat16FloatState,
  kHalf,
  kHalfFloatState,
  kCount,
};

DtypePair dtype_pair(const ParamRegions& regions);

struct PackedUpdateArgs {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  bool amsgrad;
  bool maximize;
  bool decoupled_weight_decay;
};

// Checks the hyper-parameter ranges the op accepts.
void check_update_args(const PackedUpdateArgs& args);

// Checks an optional GradScaler tensor (grad_scale or found_inf): one float32
// element on `device`.
void check_amp_scalar(const std::optional<at::Tensor>& tensor, const char* name,
                      const at::Device& device);

// Validates every argument of the fused op and returns the regions of each
// parameter. Throws c10::Error (ValueError/TypeError in Python) naming the
// parameter index and the fix; nothing has been written when it throws.
std::vector<ParamRegions> validate_packed_update(
    at::TensorList params, at::TensorList grads, const at::Tensor& arena,
    const at::Tensor& layout, const at::Tensor& steps,
    std::optional<c10::ScalarType> state_dtype, const PackedUpdateArgs& args,
    const std::optional<at::Tensor>& grad_scale,
    const std::optional<at::Tensor>& found_inf);

struct AdamHyper;
AdamHyper make_adam_hyper(const PackedUpdateArgs& args);

}  // namespace swap_optimizer
