// The layout table that places each parameter's optimizer state inside one
// packed byte arena, and its validation. Shared by the CPU and CUDA kernels so
// both reject exactly the same tables, before any element is written.
#pragma once

#include "adam_vocabulary.h"

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace swap_optimizer {

// The layout table's columns (LayoutColumn) are in adam_vocabulary.h.
constexpr int64_t kAbsent = -1;

// Byte offsets of one row's states, checked against its arena, and the part of
// its param it updates.
struct ParamRegions {
  int64_t exp_avg;
  int64_t exp_avg_sq;
  int64_t max_exp_avg_sq;  // kAbsent unless amsgrad
  int64_t master;          // kAbsent unless the fp32 master copy is kept
  int64_t absmax[3];       // per moment (exp_avg, exp_avg_sq, max): kAbsent unless 8-bit
  int64_t compensation;    // kAbsent unless a Kahan buffer is kept
  int64_t random_key;      // the param's index for stochastic rounding
  int64_t global_offset;   // the global index of the row's first element
  int64_t numel;           // elements this row updates
  int64_t param_offset;    // its first element in the param and grad
  int64_t step_index;      // into the steps tensor
  bool advance_step;
  c10::ScalarType param_dtype;
  c10::ScalarType state_dtype;  // kByte: 8-bit codes with absmax blocks

  bool quantized() const { return state_dtype == c10::kByte; }
  // Rows the plain element loops (dtype_pair) do not run: 8-bit moments, bf16
  // moments of another dtype's param or stochastically rounded, a Kahan buffer.
  bool compact(bool stochastic) const {
    return quantized() || compensation != kAbsent ||
           (state_dtype == c10::kBFloat16 && (stochastic || param_dtype != c10::kBFloat16));
  }
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
    const std::optional<at::Tensor>& found_inf,
    std::optional<int64_t> rounding_seed);

struct AdamHyper;
AdamHyper make_adam_hyper(const PackedUpdateArgs& args);

// The pointers of a compact row (compact_update.h): arena offsets resolved
// against `arena_base`, param and grad advanced to the row's first element.
struct CompactRow;
CompactRow make_compact_row(const ParamRegions& regions, uint8_t* arena_base, const at::Tensor& param,
                            const at::Tensor& grad, std::optional<int64_t> rounding_seed,
                            int32_t scalars_index);

}  // namespace swap_optimizer
