// The settings of one SwapRuntime: how many batches and arenas, the states'
// dtypes and compact forms, and which states go to the host. Apart from
// swap_runtime.h so that the Adam slots (adam_slots.h), which read them, need
// not include the runtime.
#pragma once

#include "../kernels/adam_vocabulary.h"
#include "store_layout.h"

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace swap_optimizer::runtime {

struct RuntimeOptions {
  int64_t swap_times = 16;
  int64_t num_arenas = 2;
  // none: the param's dtype; kByte: 8-bit moments for params of at least
  // kMinQuantizedNumel elements, the param's dtype for smaller ones.
  std::optional<c10::ScalarType> state_dtype;
  bool master_weights = false;                 // fp32 master copies of 16-bit params
  bool kahan_summation = false;                // Kahan buffers for 16-bit params
  std::optional<int64_t> rounding_seed;        // bf16 moments round stochastically
  // Per param: the global index of its first local element (a shard's offset
  // in the whole param), which keys stochastic rounding; empty: all 0.
  std::vector<int64_t> global_offsets;
  // Per param, with state_dtype kByte: whether its moments are 8-bit, decided
  // on the whole param (under sharding every rank must agree, whatever its
  // shard's size); empty: local numel >= kMinQuantizedNumel.
  std::vector<bool> quantized_params;
  bool pin_memory = true;
  bool keep_arenas = false;
  KeyFlags swap_keys = KeyFlags(kAdamKeyCount, true);  // which states (keys) of swappable params go to the host
  // Per param: its resident group (SlotSpec::resident_group); empty: all 0,
  // one resident batch.
  std::vector<int64_t> resident_groups;
};

}  // namespace swap_optimizer::runtime
