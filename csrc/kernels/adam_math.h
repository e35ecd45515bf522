// The per-element Adam/AdamW update, written once for the CUDA kernel and the
// CPU kernel. It is a template over the value type V so the CPU kernel can run
// it on at::vec::Vectorized<float> lanes and on plain floats for the tail,
// and the CUDA kernel on floats; MathOps<V> supplies sqrt and a NaN-propagating
// max for each V.
//
// The order of operations follows torch.optim.Adam's single-tensor path
// (lerp for exp_avg, mul + addcmul for exp_avg_sq, addcdiv for the param), each
// operation rounded to float (the lerp as one fused multiply-add). Both backends are built without floating-point
// contraction (-ffp-contract=off, nvcc --fmad=false) so that the vector path,
// the scalar tail and the CUDA kernel produce the same bits.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define SWAP_HOST_DEVICE __host__ __device__
#else
#define SWAP_HOST_DEVICE
#endif

namespace swap_optimizer {

// Hyper-parameters of one call, converted once on the host. Each field holds the
// float that torch's own tensor ops would apply for the corresponding Python
// double, so both implementations round the same way.
struct AdamHyper {
  float lr_weight_decay_factor;  // 1 - lr * weight_decay (decoupled decay)
  float weight_decay;            // L2 coefficient added to the gradient (Adam)
  float exp_avg_weight;          // 1 - beta1, the lerp weight
  float beta2;
  float one_minus_beta2;
  float eps;
  bool decoupled_weight_decay;
  bool has_weight_decay;
  bool amsgrad;
  bool maximize;
};

// Per-parameter scalars that depend on the parameter's own step count.
struct StepScalars {
  float neg_step_size;          // -lr / (1 - beta1^step)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
  uint32_t step;                // the count this update makes (keys stochastic rounding)
};

// The functions below have internal linkage: the CPU kernel is compiled once per
// instruction set (csrc/kernels/cpu/capability_*.cpp), and an inline function
// with external linkage compiled for AVX-512 could otherwise be the copy the
// linker keeps for every caller.
namespace {

// Computes the step scalars in double, as torch does in Python, then rounds.
SWAP_HOST_DEVICE inline StepScalars make_step_scalars(double lr, double beta1,
                                                      double beta2, double step) {
  const double bias_correction1 = 1.0 - pow(beta1, step);
  const double bias_correction2 = 1.0 - pow(beta2, step);
  StepScalars scalars;
  scalars.neg_step_size = static_cast<float>(-(lr / bias_correction1));
  scalars.bias_correction2_sqrt = static_cast<float>(sqrt(bias_correction2));
  scalars.step = static_cast<uint32_t>(step);
  return scalars;
}

template <typename V>
struct MathOps;

template <>
struct MathOps<float> {
  SWAP_HOST_DEVICE static float sqrt(float x) { return ::sqrtf(x); }
  SWAP_HOST_DEVICE static float fma(float a, float b, float c) { return ::fmaf(a, b, c); }
  // torch.maximum semantics: NaN if either side is NaN.
  SWAP_HOST_DEVICE static float maximum(float a, float b) {
    if (a != a) return a;
    if (b != b) return b;
    return a > b ? a : b;
  }
};

// The value the update starts from when an fp32 master copy is kept: the
// master, unless the param is no longer its rounding (it was written outside
// step(), through .data say, which bumps no version counter): then the param's
// value, which the master takes. Costs nothing extra: the kernel reads both.
template <typename param_t>
SWAP_HOST_DEVICE inline float master_or_written_param(float master, param_t param) {
  const float stored = static_cast<float>(param);
  return static_cast<float>(static_cast<param_t>(master)) == stored ? master : stored;
}

// torch.lerp's formula for a scalar weight, chosen by the weight's magnitude,
// with the fused multiply-add that torch's vectorised CPU lerp uses.
template <typename V>
SWAP_HOST_DEVICE inline V lerp_like_torch(const V& start, const V& end, float weight) {
  if ((weight < 0.0f ? -weight : weight) < 0.5f) {
    return MathOps<V>::fma(V(weight), end - start, start);
  }
  return MathOps<V>::fma(V(weight - 1.0f), end - start, end);
}

// Updates one lane (or one vector of lanes) in place. `grad` is already
// divided by the gradient scale when one is in use. `max_exp_avg_sq` is read and
// written only when hyper.amsgrad is set.
template <typename V>
SWAP_HOST_DEVICE inline void adam_update(V& param, V grad, V& exp_avg, V& exp_avg_sq,
                                         V& max_exp_avg_sq, const AdamHyper& hyper,
                                         const StepScalars& scalars) {
  if (hyper.maximize) {
    grad = V(0.0f) - grad;
  }
  if (hyper.has_weight_decay) {
    if (hyper.decoupled_weight_decay) {
      param = param * V(hyper.lr_weight_decay_factor);
    } else {
      // One rounding, as torch's grad.add(param, alpha=weight_decay) on CPU
      // (vectorised fmadd) and CUDA: the sum can cancel, so two roundings show.
      grad = MathOps<V>::fma(V(hyper.weight_decay), param, grad);
    }
  }
  exp_avg = lerp_like_torch(exp_avg, grad, hyper.exp_avg_weight);
  exp_avg_sq = exp_avg_sq * V(hyper.beta2);
  exp_avg_sq = exp_avg_sq + V(hyper.one_minus_beta2) * grad * grad;
  V second_moment = exp_avg_sq;
  if (hyper.amsgrad) {
    max_exp_avg_sq = MathOps<V>::maximum(max_exp_avg_sq, exp_avg_sq);
    second_moment = max_exp_avg_sq;
  }
  const V denom =
      MathOps<V>::sqrt(second_moment) / V(scalars.bias_correction2_sqrt) + V(hyper.eps);
  param = param + V(scalars.neg_step_size) * exp_avg / denom;
}

}  // namespace
}  // namespace swap_optimizer
