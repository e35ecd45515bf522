// Adam/AdamW's vocabulary, spelled once: the state keys the runtime keeps
// (AdamKey), the moments the 8-bit codec knows (MomentKey) and the columns of
// the fused op's layout table (LayoutColumn), each enum beside the table of
// its names. swap_optimizer._C exports the names (adam_runtime_keys,
// adam_runtime_key_owners, adam_moment_keys, layout_columns) and the Python
// layer reads them from there. Plain constants: the CUDA sources include it.
#pragma once

#include <cstdint>

namespace swap_optimizer {

// The runtime's keys of one param's state. With 8-bit moments, kExpAvg..
// kMaxExpAvgSq hold codes and each has a float32 absmax per block in the key
// kScaleKeyOffset on.
enum AdamKey : int {
  kExpAvg = 0,
  kExpAvgSq = 1,
  kMaxExpAvgSq = 2,
  kMaster = 3,
  kExpAvgAbsmax = 4,
  kExpAvgSqAbsmax = 5,
  kMaxExpAvgSqAbsmax = 6,
  kCompensation = 7,  // Kahan summation buffer, in the param's dtype
  kAdamKeyCount = 8,
};
constexpr int kScaleKeyOffset = kExpAvgAbsmax - kExpAvg;

// Each key's name: its view's name in the optimizer's state dict (the moments'
// names when they hold values, not 8-bit codes).
inline constexpr const char* kAdamKeyNames[kAdamKeyCount] = {
    "exp_avg",        "exp_avg_sq",     "max_exp_avg_sq",        "master_param",
    "exp_avg_absmax", "exp_avg_sq_absmax", "max_exp_avg_sq_absmax", "compensation"};

// The key whose placement each key follows (SwapOptimizerConfig.state_keys
// names only these owners): a moment's scales go where the moment goes.
inline constexpr AdamKey kAdamKeyOwner[kAdamKeyCount] = {kExpAvg, kExpAvgSq, kMaxExpAvgSq, kMaster,
                                                          kExpAvg, kExpAvgSq, kMaxExpAvgSq, kCompensation};

// Which quantized moment a code array holds (also its key in the rounding
// generator): the first three keys.
enum MomentKey : int { kMomentExpAvg = kExpAvg, kMomentExpAvgSq = kExpAvgSq, kMomentMaxExpAvgSq = kMaxExpAvgSq };
constexpr int kMomentCount = 3;
static_assert(kMomentExpAvg == 0 && kMomentExpAvgSq == 1 && kMomentMaxExpAvgSq == 2,
              "the rounding generator's keys and the absmax array index moments from 0");

// Columns of the int64 layout table, one row per parameter (or piece of one).
// State offsets are in bytes from the start of the arena; kAbsent marks a state
// that is not kept. A row updates elements [param_offset, param_offset + numel)
// of its param and grad, whose states sit at the offsets; its step count is
// steps[step_index], read as the step before this one, and written back
// incremented only when advance_step is 1 (the last piece of a split param, or
// a whole param), so every piece of a param uses the same step.
//
// Compact states (state_codec.h): a row whose moments are 8-bit codes (only
// with state_dtype uint8) has an absmax offset per kept moment: one float32 per
// block of kQuantBlock elements from the row's first element (param_offset is
// then a multiple of kQuantBlock); a row of a 16-bit param may keep a Kahan
// compensation buffer in the param's dtype. Stochastic rounding (a
// rounding_seed) draws for element i of the row with param index random_key and
// global index global_offset + i (the element's index in the whole param, also
// under sharding).
enum LayoutColumn : int64_t {
  kExpAvgOffset = 0,
  kExpAvgSqOffset = 1,
  kMaxExpAvgSqOffset = 2,
  kMasterOffset = 3,
  kNumel = 4,
  kParamOffset = 5,
  kStepIndex = 6,
  kAdvanceStep = 7,
  kExpAvgAbsmaxOffset = 8,
  kExpAvgSqAbsmaxOffset = 9,
  kMaxExpAvgSqAbsmaxOffset = 10,
  kCompensationOffset = 11,
  kRandomKey = 12,
  kGlobalOffset = 13,
  kLayoutColumns = 14,
};

// The column holding each key's arena offset.
inline constexpr LayoutColumn kAdamKeyColumn[kAdamKeyCount] = {
    kExpAvgOffset,       kExpAvgSqOffset,       kMaxExpAvgSqOffset,       kMasterOffset,
    kExpAvgAbsmaxOffset, kExpAvgSqAbsmaxOffset, kMaxExpAvgSqAbsmaxOffset, kCompensationOffset};

// The columns' names (swap_optimizer.LAYOUT_COLUMNS): a key's column is named
// after the key, but for the master copy's, which is "master".
inline constexpr const char* kLayoutColumnNames[kLayoutColumns] = {
    kAdamKeyNames[kExpAvg],       kAdamKeyNames[kExpAvgSq],       kAdamKeyNames[kMaxExpAvgSq],
    "master",                     "numel",                        "param_offset",
    "step_index",                 "advance_step",                 kAdamKeyNames[kExpAvgAbsmax],
    kAdamKeyNames[kExpAvgSqAbsmax], kAdamKeyNames[kMaxExpAvgSqAbsmax], kAdamKeyNames[kCompensation],
    "random_key",                 "global_offset"};

}  // namespace swap_optimizer
