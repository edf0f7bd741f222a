// The activations of fused_sample.rule's hidden layers on CUDA, in fp32 with
// the formulas ATen's own kernels use (the ATen loop and the reference agree
// to float32 rounding).
#pragma once

#include "../../common/activation.h"
#include "rows.cuh"

namespace ddpm_ops {
namespace cuda_kernels {

// One overload per activation (visit_activation picks it).
__device__ __forceinline__ float activate(float v, ActivationTag<Activation::kSilu>) { return silu(v); }
__device__ __forceinline__ float activate(float v, ActivationTag<Activation::kMish>) {
  return v * tanhf(v > 20.f ? v : log1pf(expf(v)));
}
__device__ __forceinline__ float activate(float v, ActivationTag<Activation::kRelu>) {
  return v > 0.f ? v : (v == v ? 0.f : v);  // NaN stays NaN, as torch.relu
}
__device__ __forceinline__ float activate(float v, ActivationTag<Activation::kGelu>) {
  return 0.5f * v * (1.f + erff(v * 0.70710678118654752f));
}
__device__ __forceinline__ float activate(float v, ActivationTag<Activation::kGeluTanh>) {
  const float inner = 0.79788456080286536f * (v + 0.044715f * v * v * v);
  return 0.5f * v * (1.f + tanhf(inner));
}
__device__ __forceinline__ float activate(float v, ActivationTag<Activation::kTanh>) { return tanhf(v); }
__device__ __forceinline__ float activate(float v, ActivationTag<Activation::kIdentity>) { return v; }

__device__ __forceinline__ float activate(float v, Activation act) {
  return visit_activation(act, [v](auto tag) { return activate(v, tag); });
}

// The same, with SiLU and Mish from the hardware's approximate exp2 and
// reciprocal (silu_approx, mish_approx: within the 1e-5 promise, a third of
// the instructions or fewer), for the kernels whose step is a chain of
// dependent instructions.
__device__ __forceinline__ float activate_fast(float v, Activation act) {
  if (act == Activation::kSilu) return silu_approx(v);
  if (act == Activation::kMish) return mish_approx(v);
  return activate(v, act);
}

}  // namespace cuda_kernels
}  // namespace ddpm_ops
