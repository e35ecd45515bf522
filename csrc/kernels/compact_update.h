// The per-element pieces of the update for rows with compact states (see
// state_codec.h and packed_layout.h): how the update's starting value is read
// and written back (fp32 master, Kahan compensation, or the param), and how a
// moment is read and stored (fp32/fp16, bf16 rounded to nearest or
// stochastically, 8-bit codes). Written once for the CPU loops
// (cpu/compact_update_cpu.cpp) and the CUDA kernel, which only differ in how a
// block's absmax is reduced.
#pragma once

#include "adam_math.h"
#include "state_codec.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

namespace swap_optimizer {

// One row of a compact call; pointers already point at the row's first element
// (and, for absmax, at its first block).
struct CompactRow {
  void* param;
  const void* grad;
  void* moment[3];      // exp_avg, exp_avg_sq, max_exp_avg_sq (null unless amsgrad)
  float* absmax[3];     // per block, 8-bit rows only
  float* master;        // null unless an fp32 master copy is kept
  void* compensation;   // null unless a Kahan buffer is kept (param dtype)
  uint64_t rounding_key[3];  // stochastic rounding of bf16 moments; unused otherwise
  int64_t numel;
  int64_t global_offset;
  int32_t scalars_index;  // into the call's StepScalars
  int32_t stochastic;     // bf16 moments round stochastically
};

namespace {

// The update's starting value: the master copy (unless the param was written
// outside step()), the param plus its compensation, or the param.
template <typename param_t>
SWAP_HOST_DEVICE inline float load_start(const CompactRow& r, int64_t i) {
  const param_t stored = static_cast<const param_t*>(r.param)[i];
  if (r.master != nullptr) return master_or_written_param(r.master[i], stored);
  if (r.compensation != nullptr) {
    return static_cast<float>(stored) + static_cast<float>(static_cast<const param_t*>(r.compensation)[i]);
  }
  return static_cast<float>(stored);
}

// Writes the updated value: the param rounds to nearest; the master keeps it
// whole, or the compensation keeps what the rounding lost (Kahan summation, as
// torchdistx's AnyPrecisionAdamW: the next step starts from param + it).
template <typename param_t>
SWAP_HOST_DEVICE inline void store_result(const CompactRow& r, int64_t i, float value) {
  const param_t rounded = static_cast<param_t>(value);
  static_cast<param_t*>(r.param)[i] = rounded;
  if (r.master != nullptr) r.master[i] = value;
  if (r.compensation != nullptr) {
    static_cast<param_t*>(r.compensation)[i] = static_cast<param_t>(value - static_cast<float>(rounded));
  }
}

template <typename param_t>
SWAP_HOST_DEVICE inline float load_grad(const CompactRow& r, int64_t i, const float* grad_scale) {
  const float g = static_cast<float>(static_cast<const param_t*>(r.grad)[i]);
  return grad_scale != nullptr ? g / *grad_scale : g;
}

// A moment kept as values (not codes).
template <typename state_t>
SWAP_HOST_DEVICE inline float load_moment(const CompactRow& r, int k, int64_t i) {
  return static_cast<float>(static_cast<const state_t*>(r.moment[k])[i]);
}

template <typename state_t>
SWAP_HOST_DEVICE inline void store_moment(const CompactRow& r, int k, int64_t i, float value, uint32_t step) {
  if constexpr (std::is_same_v<state_t, c10::BFloat16>) {
    if (r.stochastic) {
      static_cast<uint16_t*>(r.moment[k])[i] =
          bf16_bits_stochastic_at(value, r.rounding_key[k], r.global_offset + i, step);
      return;
    }
  }
  static_cast<state_t*>(r.moment[k])[i] = static_cast<state_t>(value);
}

// How moment k's codes are kept: exp_avg in the signed map, rounded to the
// nearest code; exp_avg_sq the nearest, but never 0 for a positive value;
// max_exp_avg_sq rounded up, so it never falls below a value it held.
SWAP_HOST_DEVICE inline int moment_map_kind(int k) { return k == kMomentExpAvg ? kSignedMap : kUnsignedMap; }
SWAP_HOST_DEVICE inline const CodeMap& moment_map(const CodeMaps& maps, int k) {
  return code_map_of(maps, moment_map_kind(k));
}
SWAP_HOST_DEVICE inline int moment_rounding(int k) {
  return k == kMomentExpAvg ? kRoundNearest : k == kMomentExpAvgSq ? kRoundNearestNonzero : kRoundUp;
}

// An 8-bit moment: its code decoded with its block's absmax.
SWAP_HOST_DEVICE inline float load_code(const CompactRow& r, const CodeMaps& maps, int k, int64_t i) {
  return decode(moment_map(maps, k), static_cast<const uint8_t*>(r.moment[k])[i], r.absmax[k][i / kQuantBlock]);
}

// Stores an 8-bit moment given its block's new absmax, with the binary
// search (the CUDA kernel's; the CPU loops encode a block at a time).
SWAP_HOST_DEVICE inline void store_code(const CompactRow& r, const CodeMaps& maps, int k, int64_t i, float value,
                                        float absmax) {
  static_cast<uint8_t*>(r.moment[k])[i] =
      encode_code(moment_map(maps, k), nullptr, moment_rounding(k), value, absmax);
}

// One element's update given its moments, already loaded: reads the start and
// the grad, writes the result; the moments are updated in place.
template <typename param_t>
SWAP_HOST_DEVICE inline void update_param_element(const CompactRow& r, int64_t i, const AdamHyper& hyper,
                                                  const StepScalars& s, const float* grad_scale, float& exp_avg,
                                                  float& exp_avg_sq, float& max_exp_avg_sq) {
  float p = load_start<param_t>(r, i);
  adam_update(p, load_grad<param_t>(r, i, grad_scale), exp_avg, exp_avg_sq, max_exp_avg_sq, hyper, s);
  store_result<param_t>(r, i, p);
}

// One element of a row whose moments are values: the whole update.
template <typename param_t, typename state_t>
SWAP_HOST_DEVICE inline void update_value_element(const CompactRow& r, int64_t i, const AdamHyper& hyper,
                                                  const StepScalars& s, const float* grad_scale) {
  float m = load_moment<state_t>(r, kMomentExpAvg, i);
  float v = load_moment<state_t>(r, kMomentExpAvgSq, i);
  float v_max = hyper.amsgrad ? load_moment<state_t>(r, kMomentMaxExpAvgSq, i) : 0.f;
  update_param_element<param_t>(r, i, hyper, s, grad_scale, m, v, v_max);
  store_moment<state_t>(r, kMomentExpAvg, i, m, s.step);
  store_moment<state_t>(r, kMomentExpAvgSq, i, v, s.step);
  if (hyper.amsgrad) store_moment<state_t>(r, kMomentMaxExpAvgSq, i, v_max, s.step);
}

// One element of an 8-bit row, up to the moments' encoding (the CUDA
// kernel's; the CPU loops decode a block at a time): the param is written,
// the updated moments (exp_avg, exp_avg_sq, max) land in `moments` for the
// block's absmax and store_code.
template <typename param_t>
SWAP_HOST_DEVICE inline void update_code_element(const CompactRow& r, const CodeMaps& maps, int64_t i,
                                                 const AdamHyper& hyper, const StepScalars& s,
                                                 const float* grad_scale, float (&moments)[3]) {
  moments[0] = load_code(r, maps, kMomentExpAvg, i);
  moments[1] = load_code(r, maps, kMomentExpAvgSq, i);
  moments[2] = hyper.amsgrad ? load_code(r, maps, kMomentMaxExpAvgSq, i) : 0.f;
  update_param_element<param_t>(r, i, hyper, s, grad_scale, moments[0], moments[1], moments[2]);
}

}  // namespace
}  // namespace swap_optimizer
