#include "packed_layout.h"

#include "adam_math.h"
#include "compact_update.h"
#include "state_codec.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <unordered_set>

namespace swap_optimizer {
namespace {

bool is_supported_float(c10::ScalarType dtype) {
  return dtype == c10::kFloat || dtype == c10::kBFloat16 || dtype == c10::kHalf;
}

struct ByteRange {
  int64_t begin;
  int64_t end;
  int64_t param_index;
  const char* what;
};

// Checks that `numel` elements of `element_size` bytes fit at `offset`.
void check_region(int64_t index, const char* what, int64_t offset, int64_t numel,
                  int64_t element_size, int64_t arena_nbytes,
                  std::vector<ByteRange>& ranges) {
  TORCH_CHECK_VALUE(offset >= 0, "fused_adam_packed: param ", index, ": ", what,
                    " offset is ", offset,
                    " but must be a byte offset >= 0 into the arena");
  TORCH_CHECK_VALUE(offset % element_size == 0, "fused_adam_packed: param ", index,
                    ": ", what, " offset ", offset, " is not a multiple of its element size ",
                    element_size, "; align state offsets to the state dtype");
  TORCH_CHECK_VALUE(numel <= (std::numeric_limits<int64_t>::max() - offset) / element_size,
                    "fused_adam_packed: param ", index, ": ", what, " region overflows");
  const int64_t end = offset + numel * element_size;
  TORCH_CHECK_VALUE(end <= arena_nbytes, "fused_adam_packed: param ", index, ": ", what,
                    " occupies bytes [", offset, ", ", end, ") but the arena holds only ",
                    arena_nbytes, " bytes; make the arena larger or fix the offset");
  if (numel > 0) {
    ranges.push_back({offset, end, index, what});
  }
}

}  // namespace

std::vector<ParamRegions> validate_packed_update(
    at::TensorList params, at::TensorList grads, const at::Tensor& arena,
    const at::Tensor& layout, const at::Tensor& steps,
    std::optional<c10::ScalarType> state_dtype, const PackedUpdateArgs& args,
    const std::optional<at::Tensor>& grad_scale,
    const std::optional<at::Tensor>& found_inf,
    std::optional<int64_t> rounding_seed) {
  const int64_t count = static_cast<int64_t>(params.size());
  TORCH_CHECK_VALUE(static_cast<int64_t>(grads.size()) == count,
                    "fused_adam_packed: got ", count, " params but ", grads.size(),
                    " grads; pass one grad per param");
  TORCH_CHECK_VALUE(layout.device().is_cpu() && layout.scalar_type() == c10::kLong &&
                        layout.dim() == 2 && layout.size(1) == kLayoutColumns,
                    "fused_adam_packed: layout must be a CPU int64 tensor of shape [",
                    count, ", ", static_cast<int64_t>(kLayoutColumns),
                    "] (exp_avg, exp_avg_sq, max_exp_avg_sq, master, numel, param_offset, step_index, "
                    "advance_step, exp_avg_absmax, exp_avg_sq_absmax, max_exp_avg_sq_absmax, compensation, "
                    "random_key, global_offset), got ",
                    layout.scalar_type(), " ", layout.sizes(), " on ", layout.device());
  TORCH_CHECK_VALUE(layout.size(0) == count, "fused_adam_packed: layout has ",
                    layout.size(0), " rows but there are ", count, " params");
  TORCH_CHECK_VALUE(layout.is_contiguous(), "fused_adam_packed: layout must be contiguous");
  TORCH_CHECK_VALUE(arena.scalar_type() == c10::kByte && arena.is_contiguous() &&
                        arena.dim() == 1,
                    "fused_adam_packed: arena must be a contiguous 1-D uint8 tensor, got ",
                    arena.scalar_type(), " ", arena.sizes(),
                    arena.is_contiguous() ? "" : " (not contiguous)");
  TORCH_CHECK_VALUE(!state_dtype.has_value() || is_supported_float(*state_dtype) ||
                        *state_dtype == c10::kByte,
                    "fused_adam_packed: state_dtype must be float32, bfloat16, float16 or uint8 (8-bit "
                    "blockwise), got ", *state_dtype);
  TORCH_CHECK_VALUE(!rounding_seed.has_value() || state_dtype == c10::kBFloat16,
                    "fused_adam_packed: rounding_seed rounds bfloat16 states stochastically; pass it only "
                    "with state_dtype=torch.bfloat16");
  check_update_args(args);

  const at::Device device = arena.device();
  TORCH_CHECK_VALUE(steps.device() == device && steps.scalar_type() == c10::kFloat &&
                        steps.is_contiguous() && steps.dim() == 1,
                    "fused_adam_packed: steps must be a contiguous 1-D float32 tensor on ", device,
                    " (the step table the layout's step_index column points into), got ",
                    steps.scalar_type(), " ", steps.sizes(), " on ", steps.device());
  check_amp_scalar(grad_scale, "grad_scale", device);
  check_amp_scalar(found_inf, "found_inf", device);

  const int64_t arena_nbytes = arena.numel();
  const int64_t* rows = layout.const_data_ptr<int64_t>();
  std::vector<ParamRegions> regions;
  regions.reserve(count);
  std::vector<ByteRange> ranges;
  ranges.reserve(count * 4);
  std::unordered_set<const void*> seen_params;
  std::unordered_set<int64_t> seen_steps;

  for (int64_t i = 0; i < count; ++i) {
    const at::Tensor& param = params[i];
    const at::Tensor& grad = grads[i];
    TORCH_CHECK_TYPE(is_supported_float(param.scalar_type()), "fused_adam_packed: param ", i,
                     " has dtype ", param.scalar_type(),
                     "; supported are float32, bfloat16 and float16");
    TORCH_CHECK_TYPE(grad.scalar_type() == param.scalar_type(), "fused_adam_packed: param ", i,
                     " is ", param.scalar_type(), " but its grad is ", grad.scalar_type(),
                     "; grads must have the param's dtype");
    TORCH_CHECK_VALUE(param.device() == device && grad.device() == device,
                      "fused_adam_packed: param ", i, " is on ", param.device(),
                      " and its grad on ", grad.device(), " but the arena is on ", device,
                      "; keep params, grads and arena on one device");
    TORCH_CHECK_VALUE(param.is_contiguous() && grad.is_contiguous(),
                      "fused_adam_packed: param ", i, " or its grad is not contiguous; call "
                      ".contiguous() or keep its state resident");
    TORCH_CHECK_VALUE(param.sizes() == grad.sizes(), "fused_adam_packed: param ", i,
                      " has shape ", param.sizes(), " but its grad has shape ", grad.sizes());
    const int64_t* row = rows + i * kLayoutColumns;
    const int64_t numel = row[kNumel];
    const int64_t param_offset = row[kParamOffset];
    TORCH_CHECK_VALUE(numel >= 0 && param_offset >= 0 && param_offset <= param.numel() &&
                          numel <= param.numel() - param_offset,
                      "fused_adam_packed: param ", i, " has ", param.numel(),
                      " elements but its layout row updates ", numel, " of them from element ",
                      param_offset, "; param_offset + numel must not exceed the param's numel");
    const int64_t step_index = row[kStepIndex];
    TORCH_CHECK_VALUE(step_index >= 0 && step_index < steps.numel(), "fused_adam_packed: param ", i,
                      "'s step_index is ", step_index, " but steps has ", steps.numel(),
                      " elements; point it at the param's step count");
    TORCH_CHECK_VALUE(seen_steps.insert(step_index).second, "fused_adam_packed: param ", i,
                      " uses step_index ", step_index,
                      " like an earlier param; each row needs its own step count");
    TORCH_CHECK_VALUE(row[kAdvanceStep] == 0 || row[kAdvanceStep] == 1, "fused_adam_packed: param ", i,
                      "'s advance_step is ", row[kAdvanceStep], " but must be 0 or 1");
    if (numel > 0) {
      TORCH_CHECK_VALUE(seen_params.insert(param.data_ptr()).second,
                        "fused_adam_packed: param ", i,
                        " shares its storage with an earlier param; pass each param once");
    }

    ParamRegions region;
    region.param_dtype = param.scalar_type();
    region.exp_avg = row[kExpAvgOffset];
    region.exp_avg_sq = row[kExpAvgSqOffset];
    region.max_exp_avg_sq = row[kMaxExpAvgSqOffset];
    region.master = row[kMasterOffset];
    region.absmax[0] = row[kExpAvgAbsmaxOffset];
    region.absmax[1] = row[kExpAvgSqAbsmaxOffset];
    region.absmax[2] = row[kMaxExpAvgSqAbsmaxOffset];
    region.compensation = row[kCompensationOffset];
    region.random_key = row[kRandomKey];
    region.global_offset = row[kGlobalOffset];
    // With state_dtype uint8, rows with absmax offsets hold 8-bit codes; the
    // others (params too small to quantize) keep states in the param's dtype.
    const bool quantized = state_dtype == c10::kByte && region.absmax[0] != kAbsent;
    region.state_dtype = quantized ? c10::kByte
                         : state_dtype == c10::kByte ? param.scalar_type()
                                                     : state_dtype.value_or(param.scalar_type());
    TORCH_CHECK_VALUE(region.state_dtype == param.scalar_type() || region.state_dtype == c10::kFloat ||
                          region.state_dtype == c10::kBFloat16 || quantized,
                      "fused_adam_packed: param ", i, " is ", param.scalar_type(),
                      " so its states must be in its dtype, float32 or bfloat16 (or 8-bit, with state_dtype "
                      "uint8), not ", region.state_dtype);
    TORCH_CHECK_VALUE(region.random_key >= 0 && region.global_offset >= 0, "fused_adam_packed: param ", i,
                      "'s random_key and global_offset must be >= 0, got ", region.random_key, " and ",
                      region.global_offset);
    region.numel = numel;
    region.param_offset = param_offset;
    region.step_index = step_index;
    region.advance_step = row[kAdvanceStep] == 1;

    const int64_t state_size = c10::elementSize(region.state_dtype);
    check_region(i, "exp_avg", region.exp_avg, numel, state_size, arena_nbytes, ranges);
    check_region(i, "exp_avg_sq", region.exp_avg_sq, numel, state_size, arena_nbytes, ranges);
    if (args.amsgrad) {
      check_region(i, "max_exp_avg_sq", region.max_exp_avg_sq, numel, state_size,
                   arena_nbytes, ranges);
    } else {
      TORCH_CHECK_VALUE(region.max_exp_avg_sq == kAbsent, "fused_adam_packed: param ", i,
                        " has a max_exp_avg_sq offset but amsgrad is off; set it to -1");
    }
    if (region.master != kAbsent) {
      TORCH_CHECK_VALUE(param.scalar_type() != c10::kFloat, "fused_adam_packed: param ", i,
                        " is float32 and needs no master copy; set its master offset to -1");
      check_region(i, "master", region.master, numel, sizeof(float), arena_nbytes, ranges);
    }
    const char* absmax_names[3] = {"exp_avg_absmax", "exp_avg_sq_absmax", "max_exp_avg_sq_absmax"};
    for (int k = 0; k < 3; ++k) {
      const bool kept = k < 2 || args.amsgrad;
      if (quantized && kept) {
        check_region(i, absmax_names[k], region.absmax[k], (numel + kQuantBlock - 1) / kQuantBlock,
                     sizeof(float), arena_nbytes, ranges);
      } else {
        TORCH_CHECK_VALUE(region.absmax[k] == kAbsent, "fused_adam_packed: param ", i, " has an ",
                          absmax_names[k], " offset but ",
                          quantized ? "amsgrad is off" : "its states are not 8-bit (state_dtype uint8 "
                                                         "and an exp_avg_absmax offset)",
                          "; set it to -1");
      }
    }
    if (quantized) {
      TORCH_CHECK_VALUE(param_offset % kQuantBlock == 0, "fused_adam_packed: param ", i,
                        " has 8-bit states, so its row must start on a block of ", kQuantBlock,
                        " elements; param_offset ", param_offset, " does not");
    }
    if (region.compensation != kAbsent) {
      TORCH_CHECK_VALUE(param.scalar_type() != c10::kFloat && region.master == kAbsent,
                        "fused_adam_packed: param ", i, " has a compensation buffer, which only a 16-bit param "
                        "without a master copy keeps; set its compensation offset to -1");
      check_region(i, "compensation", region.compensation, numel, param.element_size(), arena_nbytes, ranges);
    }
    regions.push_back(region);
  }

  std::sort(ranges.begin(), ranges.end(),
            [](const ByteRange& a, const ByteRange& b) { return a.begin < b.begin; });
  for (size_t k = 1; k < ranges.size(); ++k) {
    const ByteRange& previous = ranges[k - 1];
    const ByteRange& current = ranges[k];
    TORCH_CHECK_VALUE(current.begin >= previous.end, "fused_adam_packed: param ",
                      current.param_index, "'s ", current.what, " at bytes [", current.begin,
                      ", ", current.end, ") overlaps param ", previous.param_index, "'s ",
                      previous.what, " at [", previous.begin, ", ", previous.end,
                      "); every state needs its own region of the arena");
  }
  return regions;
}

void check_update_args(const PackedUpdateArgs& args) {
  TORCH_CHECK_VALUE(args.lr >= 0.0 && args.eps >= 0.0 && args.weight_decay >= 0.0 &&
                        args.beta1 >= 0.0 && args.beta1 < 1.0 && args.beta2 >= 0.0 &&
                        args.beta2 < 1.0,
                    "fused_adam_packed: need lr >= 0, eps >= 0, weight_decay >= 0 and "
                    "0 <= beta1, beta2 < 1; got lr=", args.lr, " eps=", args.eps,
                    " weight_decay=", args.weight_decay, " betas=(", args.beta1, ", ",
                    args.beta2, ")");
}

void check_amp_scalar(const std::optional<at::Tensor>& tensor, const char* name,
                      const at::Device& device) {
  if (!tensor.has_value()) return;
  TORCH_CHECK_VALUE(tensor->scalar_type() == c10::kFloat && tensor->numel() == 1,
                    "fused_adam_packed: ", name,
                    " must be a float32 tensor with one element, got dtype ",
                    tensor->scalar_type(), " and ", tensor->numel(), " elements");
  TORCH_CHECK_VALUE(tensor->device() == device, "fused_adam_packed: ", name, " is on ",
                    tensor->device(), " but the params are on ", device,
                    "; move it with .to(", device, ")");
}

DtypePair dtype_pair(const ParamRegions& regions) {
  TORCH_INTERNAL_ASSERT(regions.state_dtype != c10::kByte, "8-bit rows run the compact loops");
  const bool float_state = regions.state_dtype == c10::kFloat;
  switch (regions.param_dtype) {
    case c10::kBFloat16: return float_state ? DtypePair::kBFloat16FloatState : DtypePair::kBFloat16;
    case c10::kHalf: return float_state ? DtypePair::kHalfFloatState : DtypePair::kHalf;
    default: return DtypePair::kFloat;
  }
}

AdamHyper make_adam_hyper(const PackedUpdateArgs& args) {
  AdamHyper hyper;
  hyper.lr_weight_decay_factor = static_cast<float>(1.0 - args.lr * args.weight_decay);
  hyper.weight_decay = static_cast<float>(args.weight_decay);
  hyper.exp_avg_weight = static_cast<float>(1.0 - args.beta1);
  hyper.beta2 = static_cast<float>(args.beta2);
  hyper.one_minus_beta2 = static_cast<float>(1.0 - args.beta2);
  hyper.eps = static_cast<float>(args.eps);
  hyper.decoupled_weight_decay = args.decoupled_weight_decay;
  hyper.has_weight_decay = args.weight_decay != 0.0;
  hyper.amsgrad = args.amsgrad;
  hyper.maximize = args.maximize;
  return hyper;
}

CompactRow make_compact_row(const ParamRegions& r, uint8_t* arena_base, const at::Tensor& param,
                            const at::Tensor& grad, std::optional<int64_t> rounding_seed,
                            int32_t scalars_index) {
  auto at_offset = [arena_base](int64_t offset) -> void* {
    return offset == kAbsent ? nullptr : arena_base + offset;
  };
  const int64_t skip = r.param_offset * static_cast<int64_t>(c10::elementSize(r.param_dtype));
  CompactRow row{};
  row.param = static_cast<uint8_t*>(param.data_ptr()) + skip;
  row.grad = static_cast<const uint8_t*>(grad.const_data_ptr()) + skip;
  const int64_t moments[3] = {r.exp_avg, r.exp_avg_sq, r.max_exp_avg_sq};
  for (int k = 0; k < 3; ++k) {
    row.moment[k] = at_offset(moments[k]);
    row.absmax[k] = static_cast<float*>(at_offset(r.absmax[k]));
    row.rounding_key[k] = rounding_seed.has_value()
                              ? rounding_key(static_cast<uint64_t>(*rounding_seed), r.random_key, k)
                              : 0;
  }
  row.master = static_cast<float*>(at_offset(r.master));
  row.compensation = at_offset(r.compensation);
  row.numel = r.numel;
  row.global_offset = r.global_offset;
  row.scalars_index = scalars_index;
  row.stochastic = rounding_seed.has_value() && r.state_dtype == c10::kBFloat16 ? 1 : 0;
  return row;
}

}  // namespace swap_optimizer
