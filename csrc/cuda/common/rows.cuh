// The per-row parts the kernels share: a row's first timestep and its range
// check (every kernel); the time-column overload's DDPM coefficients of a
// step (the SampleArgs kernels); SiLU and Mish, exact and from the hardware's
// approximations (the other activations are in activation.cuh).
#pragma once

#include "args.h"

namespace ddpm_ops {
namespace cuda_kernels {

// Loads t_start[row], reporting whether every timestep t_start - k, k < steps,
// indexes the tables. The returned start is clamped into [-1, table_length] so
// that later int arithmetic cannot overflow; reads clamp again per step.
// Args: SampleArgs or EngineArgs (both have t_start, t_is_int64,
// table_length and num_steps).
template <typename Args>
__device__ __forceinline__ int load_t_start(const Args& a, int row, bool* valid) {
  const long long t = a.t_is_int64 ? static_cast<const long long*>(a.t_start)[row]
                                   : static_cast<long long>(static_cast<const int*>(a.t_start)[row]);
  *valid = t < a.table_length && t >= static_cast<long long>(a.num_steps) - 1;
  return static_cast<int>(t < -1 ? -1 : (t > a.table_length ? a.table_length : t));
}

__device__ __forceinline__ int clamp_index(int t, int length) {
  return t < 0 ? 0 : (t >= length ? length - 1 : t);
}

// Row threadIdx.x's DDPM coefficients (c1, c2), loaded one step ahead so that
// their global-memory latency hides behind the layers (threads past the
// tile's rows hold none).
struct CoefPrefetch {
  bool active;
  float c1 = 0.f, c2 = 0.f;
  __device__ CoefPrefetch(const SampleArgs& a, const int* t0, int rows)
      : active(static_cast<int>(threadIdx.x) < rows) {
    if (active) load(a, t0[threadIdx.x]);
  }
  __device__ void load(const SampleArgs& a, int t) {
    t = clamp_index(t, a.table_length);
    c1 = __ldg(a.sqrt_recip_alphas + t);
    c2 = __ldg(a.coef_eps + t);
  }
  // coef[2 * row .. + 1] <- step k's (c1, c2); then loads step k + 1's.
  __device__ void publish(const SampleArgs& a, const int* t0, float* coef, int k) {
    if (!active) return;
    coef[2 * threadIdx.x] = c1;
    coef[2 * threadIdx.x + 1] = c2;
    if (k + 1 < a.num_steps) load(a, t0[threadIdx.x] - (k + 1));
  }
};

// Same formula as the CPU kernel (and F.silu): v * sigmoid(v). The fast
// division (2 ulp) skips IEEE division's slow-path branch; it returns 0 once
// the denominator passes 2^126, where silu(v) is below 1e-36 anyway.
__device__ __forceinline__ float silu(float v) { return __fdividef(v, 1.f + expf(-v)); }
// v * sigmoid(v) from the hardware's approximate exp2 and reciprocal (about
// 1e-6 relative, a few ulp: the exact kernels' errors against float64 stay
// at 1.5e-7; the bf16 rounding of the bf16_wgmma kernel is 500 times coarser),
// a third of the instructions of the exact-rounding formula. Large -v:
// 1 / inf = 0, so v * 0 = 0, as it should.
__device__ __forceinline__ float silu_approx(float v) {
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(v * -1.4426950408889634f));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.f + e));
  return v * r;
}

// Mish, v tanh(softplus(v)), as v n / (n + 2) with n = e^v (e^v + 2) (the
// same function: tanh(log(1 + e)) = ((1 + e)^2 - 1) / ((1 + e)^2 + 1)), from
// the hardware's approximate exp2 and reciprocal: one exponential where the
// exact-rounding formula takes three transcendental functions, for the
// kernels whose step is a chain of dependent instructions. Beyond v = 20 Mish
// is v in float32 (n would overflow); far below, e = 0 gives v * 0 as
// torch's does (NaN at -inf).
__device__ __forceinline__ float mish_approx(float v) {
  if (v > 20.f) return v;
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(v * 1.4426950408889634f));
  const float n = e * (e + 2.f);
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(n + 2.f));
  return v * n * r;
}

// The first timesteps of a thread's two rows of a warpgroup's 64-row tile
// (rows g and g + 8 of its warp's 16, h = 0, 1; 0 past the batch).
__device__ __forceinline__ void load_row_pair(const SampleArgs& a, int first, int (&t)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    bool ok;
    t[h] = first + 8 * h < a.batch ? load_t_start(a, first + 8 * h, &ok) : 0;
  }
}

// Step k's coefficients of those rows, consumed after all layers, which hide
// their load, and their t / T, layer 0's time input. (The kernels copy them
// into local arrays: read through pointers into this struct, the bf16_wgmma
// kernel compiled to different code.)
struct StepCoefficients {
  float c1[2], c2[2], tn[2];
  __device__ __forceinline__ StepCoefficients(const SampleArgs& a, const int (&t)[2], int k) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int ti = clamp_index(t[h] - k, a.table_length);
      c1[h] = __ldg(a.sqrt_recip_alphas + ti);
      c2[h] = __ldg(a.coef_eps + ti);
    }
    tn[0] = static_cast<float>(t[0] - k) / a.total_timesteps;
    tn[1] = static_cast<float>(t[1] - k) / a.total_timesteps;
  }
};

}  // namespace cuda_kernels
}  // namespace ddpm_ops
