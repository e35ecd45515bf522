// The CPU element loops, included once per instruction set by
// capability_*.cpp after it has selected at::vec's implementation
// (CPU_CAPABILITY) and the compiler's target. Everything here lives in
// swap_optimizer::CPU_CAPABILITY, as at::vec does, so the copies never clash.
//
// at::parallel_for runs over fixed chunks of each param; inside a chunk, at::vec
// lanes, then a scalar tail. Chunk boundaries are multiples of the vector width
// counted from each param's first element, so which path an element takes does
// not depend on how params are grouped into batches or where their states sit.
#include "cpu_update.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace swap_optimizer {

using FloatVec = at::vec::Vectorized<float>;

namespace {  // where adam_math.h declares MathOps
template <>
struct MathOps<FloatVec> {
  static FloatVec sqrt(const FloatVec& x) { return x.sqrt(); }
  static FloatVec fma(const FloatVec& a, const FloatVec& b, const FloatVec& c) {
    return at::vec::fmadd(a, b, c);  // one rounding (AVX2/AVX-512 builds only)
  }
  static FloatVec maximum(const FloatVec& a, const FloatVec& b) { return at::vec::maximum(a, b); }
};
}  // namespace

namespace CPU_CAPABILITY {
namespace {

constexpr int64_t kChunkElements = 16384;
constexpr int64_t kLanes = FloatVec::size();
static_assert(kChunkElements % kLanes == 0, "chunks must hold whole vectors");

template <typename T>
FloatVec load_lanes(const T* source) {
  if constexpr (std::is_same_v<T, float>) {
    return FloatVec::loadu(source);
  } else {
    auto reduced = at::vec::Vectorized<T>::loadu(source, kLanes);
    return std::get<0>(at::vec::convert_to_float<T>(reduced));
  }
}

template <typename T>
void store_lanes(T* destination, const FloatVec& value) {
  if constexpr (std::is_same_v<T, float>) {
    value.store(destination);
  } else {
    at::vec::convert_from_float<T>(value, value).store(destination, kLanes);
  }
}

// flatten: at::vec's operators must be inlined into this loop; under a target
// pragma GCC otherwise leaves some of them as calls.
template <typename param_t, typename state_t>
__attribute__((flatten)) void update_chunk(const CpuParamWork& w, int64_t begin, int64_t end,
                                          const AdamHyper& shared_hyper, const float* grad_scale) {
  // Local copies: the stores below could alias anything behind a reference,
  // which would force the flags and scalars to be reloaded on every vector.
  const AdamHyper hyper = shared_hyper;
  const StepScalars scalars = w.scalars;
  const bool unscale = grad_scale != nullptr;
  const float scale = unscale ? *grad_scale : 1.f;
  auto* param = static_cast<param_t*>(w.param);
  const auto* grad = static_cast<const param_t*>(w.grad);
  auto* exp_avg = static_cast<state_t*>(w.exp_avg);
  auto* exp_avg_sq = static_cast<state_t*>(w.exp_avg_sq);
  auto* max_exp_avg_sq = static_cast<state_t*>(w.max_exp_avg_sq);
  float* master = w.master;
  int64_t i = begin;
#if !defined(CPU_CAPABILITY_DEFAULT)
  for (; i + kLanes <= end; i += kLanes) {
    FloatVec p = master ? FloatVec::loadu(master + i) : load_lanes(param + i);
    FloatVec g = load_lanes(grad + i);
    if (unscale) g = g / FloatVec(scale);
    FloatVec m = load_lanes(exp_avg + i);
    FloatVec v = load_lanes(exp_avg_sq + i);
    FloatVec v_max = hyper.amsgrad ? load_lanes(max_exp_avg_sq + i) : FloatVec(0.f);
    adam_update(p, g, m, v, v_max, hyper, scalars);
    if (master) p.store(master + i);
    store_lanes(param + i, p);
    store_lanes(exp_avg + i, m);
    store_lanes(exp_avg_sq + i, v);
    if (hyper.amsgrad) store_lanes(max_exp_avg_sq + i, v_max);
  }
#endif
  // The tail; on CPUs without AVX2 the whole chunk, since the generic
  // Vectorized<float> cannot keep the fused multiply-add's single rounding.
  for (; i < end; ++i) {
    float p = master ? master[i] : static_cast<float>(param[i]);
    float g = static_cast<float>(grad[i]);
    if (unscale) g = g / scale;
    float m = static_cast<float>(exp_avg[i]);
    float v = static_cast<float>(exp_avg_sq[i]);
    float v_max = hyper.amsgrad ? static_cast<float>(max_exp_avg_sq[i]) : 0.f;
    adam_update(p, g, m, v, v_max, hyper, scalars);
    if (master) master[i] = p;
    param[i] = static_cast<param_t>(p);
    exp_avg[i] = static_cast<state_t>(m);
    exp_avg_sq[i] = static_cast<state_t>(v);
    if (hyper.amsgrad) max_exp_avg_sq[i] = static_cast<state_t>(v_max);
  }
}

struct ChunkRef {
  int64_t work_index;
  int64_t begin;
  int64_t end;
};

template <typename param_t, typename state_t>
void update_typed(const std::vector<CpuParamWork>& work, const AdamHyper& hyper,
                  const float* grad_scale) {
  std::vector<ChunkRef> chunks;
  for (int64_t k = 0; k < static_cast<int64_t>(work.size()); ++k) {
    for (int64_t begin = 0; begin < work[k].numel; begin += kChunkElements) {
      chunks.push_back({k, begin, std::min(begin + kChunkElements, work[k].numel)});
    }
  }
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      update_chunk<param_t, state_t>(work[chunks[c].work_index], chunks[c].begin, chunks[c].end,
                                     hyper, grad_scale);
    }
  });
}

}  // namespace

inline void update_params(DtypePair pair, const std::vector<CpuParamWork>& work,
                          const AdamHyper& hyper, const float* grad_scale) {
  switch (pair) {
    case DtypePair::kFloat: return update_typed<float, float>(work, hyper, grad_scale);
    case DtypePair::kBFloat16: return update_typed<c10::BFloat16, c10::BFloat16>(work, hyper, grad_scale);
    case DtypePair::kBFloat16FloatState: return update_typed<c10::BFloat16, float>(work, hyper, grad_scale);
    case DtypePair::kHalf: return update_typed<c10::Half, c10::Half>(work, hyper, grad_scale);
    case DtypePair::kHalfFloatState: return update_typed<c10::Half, float>(work, hyper, grad_scale);
    case DtypePair::kCount: break;
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace swap_optimizer
