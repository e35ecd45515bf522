// Adam/AdamW's states as the store layout sees them: eight keys (moments,
// master weights, 8-bit scales, Kahan buffers), the slots a param's settings
// make of them, and the names and dtypes their views carry. The fused Adam op
// reads the arena offsets of these keys from its layout table.
#pragma once

#include "../kernels/adam_vocabulary.h"
#include "runtime_options.h"
#include "store_layout.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace swap_optimizer::runtime {

// One float32 step count per param, as torch.optim keeps.
constexpr int64_t kAdamStepBytes = 4;

// Params with fewer elements keep unquantized states under 8-bit moments (as
// bitsandbytes and torchao do): their blocks' scales would cost more than the
// codes save, and they are often norms and biases that want precise moments.
constexpr int64_t kMinQuantizedNumel = 4096;
// Elements per absmax scale of 8-bit moments (kQuantBlock in state_codec.h).
constexpr int64_t kScaleBlock = 256;
static_assert(kSplitGranule % kScaleBlock == 0, "pieces start on whole scale blocks");

// The keys (AdamKey), their names and owners are in adam_vocabulary.h.

// What a state's view is called and holds: its name in the optimizer's state
// dict, dtype and shape (a whole param's).
struct StateDescription {
  std::string name;
  c10::ScalarType dtype;
  std::vector<int64_t> shape;
};

// Every param's slot for Adam/AdamW under `options`; group_amsgrad[g]: group g
// keeps max_exp_avg_sq.
std::vector<SlotSpec> make_slot_specs(const std::vector<at::Tensor>& params,
                                      const std::vector<int64_t>& group_of_param,
                                      const std::vector<bool>& group_amsgrad,
                                      const std::vector<bool>& swappable,
                                      const RuntimeOptions& options);

// The views' names, dtypes and shapes of each param's kept keys (absent keys
// get an empty name).
std::vector<std::vector<StateDescription>> adam_state_descriptions(const std::vector<at::Tensor>& params,
                                                                   const std::vector<SlotSpec>& specs,
                                                                   const RuntimeOptions& options);

}  // namespace swap_optimizer::runtime
