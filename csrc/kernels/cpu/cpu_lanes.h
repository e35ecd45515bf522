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
#include <tuple>
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
// Two float vectors' worth of T per iteration: one full Vectorized<T> for 16-bit types.
constexpr int64_t kStep = 2 * kLanes;
static_assert(kChunkElements % kStep == 0, "chunks must hold whole iterations");

template <typename T>
void load_pair(const T* source, FloatVec& low, FloatVec& high) {
  if constexpr (std::is_same_v<T, float>) {
    low = FloatVec::loadu(source);
    high = FloatVec::loadu(source + kLanes);
  } else {
    static_assert(at::vec::Vectorized<T>::size() == kStep, "16-bit vectors hold two float vectors");
    std::tie(low, high) = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(source));
  }
}

// master_or_written_param (adam_math.h) on two vectors of lanes.
template <typename param_t>
void adopt_written_param(FloatVec (&master)[2], const param_t* param) {
  if constexpr (!std::is_same_v<param_t, float>) {
    FloatVec stored[2], rounded[2];
    load_pair(param, stored[0], stored[1]);
    std::tie(rounded[0], rounded[1]) =
        at::vec::convert_to_float<param_t>(at::vec::convert_from_float<param_t>(master[0], master[1]));
    for (int k = 0; k < 2; ++k) master[k] = FloatVec::blendv(master[k], stored[k], rounded[k] != stored[k]);
  }
}

template <typename T>
void store_pair(T* destination, const FloatVec& low, const FloatVec& high) {
  if constexpr (std::is_same_v<T, float>) {
    low.store(destination);
    high.store(destination + kLanes);
  } else {
    at::vec::convert_from_float<T>(low, high).store(destination);
  }
}

// flatten: at::vec's operators must be inlined into this loop; under a target
// pragma GCC otherwise leaves some of them as calls. The flags that pick which
// arrays exist are template arguments so the loop carries no branches on them.
template <typename param_t, typename state_t, bool kAmsgrad, bool kMaster>
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
  for (; i + kStep <= end; i += kStep) {
    FloatVec p[2], g[2], m[2], v[2], v_max[2] = {FloatVec(0.f), FloatVec(0.f)};
    if constexpr (kMaster) {
      load_pair(master + i, p[0], p[1]);
      adopt_written_param(p, param + i);
    } else {
      load_pair(param + i, p[0], p[1]);
    }
    load_pair(grad + i, g[0], g[1]);
    load_pair(exp_avg + i, m[0], m[1]);
    load_pair(exp_avg_sq + i, v[0], v[1]);
    if constexpr (kAmsgrad) load_pair(max_exp_avg_sq + i, v_max[0], v_max[1]);
    for (int k = 0; k < 2; ++k) {
      if (unscale) g[k] = g[k] / FloatVec(scale);
      adam_update(p[k], g[k], m[k], v[k], v_max[k], hyper, scalars);
    }
    if constexpr (kMaster) store_pair(master + i, p[0], p[1]);
    store_pair(param + i, p[0], p[1]);
    store_pair(exp_avg + i, m[0], m[1]);
    store_pair(exp_avg_sq + i, v[0], v[1]);
    if constexpr (kAmsgrad) store_pair(max_exp_avg_sq + i, v_max[0], v_max[1]);
  }
#endif
  // The tail; on CPUs without AVX2 the whole chunk, since the generic
  // Vectorized<float> cannot keep the fused multiply-add's single rounding.
  for (; i < end; ++i) {
    float p = kMaster ? master_or_written_param(master[i], param[i]) : static_cast<float>(param[i]);
    float g = static_cast<float>(grad[i]);
    if (unscale) g = g / scale;
    float m = static_cast<float>(exp_avg[i]);
    float v = static_cast<float>(exp_avg_sq[i]);
    float v_max = kAmsgrad ? static_cast<float>(max_exp_avg_sq[i]) : 0.f;
    adam_update(p, g, m, v, v_max, hyper, scalars);
    if (kMaster) master[i] = p;
    param[i] = static_cast<param_t>(p);
    exp_avg[i] = static_cast<state_t>(m);
    exp_avg_sq[i] = static_cast<state_t>(v);
    if (kAmsgrad) max_exp_avg_sq[i] = static_cast<state_t>(v_max);
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
      const CpuParamWork& w = work[chunks[c].work_index];
      const bool master = w.master != nullptr;
      auto run = hyper.amsgrad ? (master ? &update_chunk<param_t, state_t, true, true>
                                         : &update_chunk<param_t, state_t, true, false>)
                               : (master ? &update_chunk<param_t, state_t, false, true>
                                         : &update_chunk<param_t, state_t, false, false>);
      run(w, chunks[c].begin, chunks[c].end, hyper, grad_scale);
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

// Defines the entry point named in cpu_update.h for the capability being built.
#define SWAP_OPTIMIZER_DEFINE_CPU_ENTRY(entry)                                              \
  namespace swap_optimizer {                                                                \
  void entry(DtypePair pair, const std::vector<CpuParamWork>& work, const AdamHyper& hyper, \
             const float* grad_scale) {                                                     \
    CPU_CAPABILITY::update_params(pair, work, hyper, grad_scale);                           \
  }                                                                                         \
  }
