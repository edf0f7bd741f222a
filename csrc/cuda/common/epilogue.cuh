// The engine's epilogue: one step of the rule for one element of x, after
// the last layer (StepArgs, args.h), and the stores of its result. Every
// engine kernel updates x through step_update, so the six (or seven) tables,
// the clamps, the noise (given, or drawn from the seed) and the chain are
// written once for the GPU.
#pragma once

#include "../../common/seeded_noise.h"
#include "args.h"

#include <cmath>

namespace ddpm_ops {
namespace cuda_kernels {

// Table q at step index s (already clamped into the tables); a null table is
// the identity's coefficient.
__device__ __forceinline__ float step_coefficient(const StepArgs& st, int q, int s) {
  return st.tables[q] != nullptr ? __ldg(st.tables[q] + s) : (q == kA ? 1.f : 0.f);
}

// A row's coefficients of one step, in registers. The kernels load step
// k + 1's during step k and store them into shared memory later: storing a
// value right after its load stalls the storing warp for the load's latency,
// and every warp of the step then waits for that one at the next barrier.
struct StepRow {
  float c[kStepTablesWithPrevious];
  __device__ __forceinline__ void load(const StepArgs& st, int s) {
#pragma unroll
    for (int q = 0; q < kStepTablesWithPrevious; ++q) c[q] = step_coefficient(st, q, s);
  }
};

// torch.clamp's: a NaN stays NaN.
__device__ __forceinline__ float clamp_keep_nan(float v, float lo, float hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

// The call's one seed from its generator's Philox state: a hash of the
// state's seed and offset (the offset advances by every call).
__device__ __forceinline__ uint64_t generator_seed(const GeneratorArgs& g) {
  const uint64_t seed = g.captured ? static_cast<uint64_t>(*g.seed_ptr) : g.seed;
  const uint64_t offset = g.captured ? static_cast<uint64_t>(*g.offset_ptr) + g.offset_intragraph : g.offset;
  return seeded_noise::mix64(seed ^ seeded_noise::mix64(offset));
}

// z[k, row, j] drawn from the seeds (seeded_noise.h, the CPU kernel's draw),
// or from the generator's seed for the call.
__device__ __forceinline__ float seeded_normal(const EngineArgs& a, int k, int row, int j) {
  const int64_t call_seed = a.step.generator.used ? static_cast<int64_t>(generator_seed(a.step.generator)) : 0;
  const uint64_t key = seeded_noise::noise_key(a.step.generator.used ? &call_seed : a.step.noise_seed,
                                               a.step.seed_per_row, static_cast<uint64_t>(k),
                                               static_cast<uint64_t>(a.batch), static_cast<uint64_t>(row));
  return 1.41421356237309505f * erfinvf(seeded_noise::centered_uniform(seeded_noise::column_bits(key, j)));
}

// Whether the call adds noise (given, or drawn from the seeds or the generator).
__device__ __forceinline__ bool has_noise(const StepArgs& st) {
  return st.noise != nullptr || st.noise_seed != nullptr || st.generator.used;
}

// z[k, row, j], step k's noise at (row, column j) clamped to the call's
// noise_clip, 0 without noise. It does not depend on x, so a kernel can
// compute it where its warps would wait for the step's last layer anyway: a
// draw is about a hundred dependent instructions, and the given noise a load.
__device__ __forceinline__ float step_noise(const EngineArgs& a, int k, int row, int j) {
  const StepArgs& st = a.step;
  if (!has_noise(st)) return 0.f;
  float z = st.noise != nullptr ? __ldg(st.noise + (static_cast<size_t>(k) * a.batch + row) * a.dim + j)
                                : seeded_normal(a, k, row, j);
  if (st.noise_clip > 0.f) z = clamp_keep_nan(z, -st.noise_clip, st.noise_clip);
  return z;
}

// x after a step at column j, from x, the network's output e, the step's
// noise z (step_noise) and the row's coefficients coef(q) of the step.
// *x0_prev carries the clipped x0 from step to step where a P table is given
// (zero at a call's first step).
template <typename Coefficients>
__device__ __forceinline__ float step_update(const EngineArgs& a, const Coefficients& coef, float x, float e,
                                             float* x0_prev, float z, int j) {
  const StepArgs& st = a.step;
  // Null tables' terms are left out, not multiplied by 0: an infinite x then
  // stays infinite, as in the time-column loop's c1 (x - c2 e).
  float x0 = (st.tables[kA] != nullptr ? coef(kA) * x : x) - coef(kB) * e;
  if (st.clip_bounds != nullptr) {
    x0 = clamp_keep_nan(x0, __ldg(st.clip_bounds + j), __ldg(st.clip_bounds + a.dim + j));
  } else if (st.clip) {
    x0 = clamp_keep_nan(x0, st.clip_lo, st.clip_hi);
  }
  float next = coef(kC) * x0;
  if (st.tables[kD] != nullptr) next += coef(kD) * x;
  if (st.tables[kE] != nullptr) next += coef(kE) * e;
  if (st.tables[kP] != nullptr) {
    next += coef(kP) * *x0_prev;
    *x0_prev = x0;
  }
  if (has_noise(st)) next += coef(kS) * z;
  if (st.post_clip_bounds != nullptr) {
    next = clamp_keep_nan(next, __ldg(st.post_clip_bounds + j), __ldg(st.post_clip_bounds + a.dim + j));
  } else if (st.post_clip) {
    next = clamp_keep_nan(next, st.post_lo, st.post_hi);
  }
  return next;
}

// The same, drawing step k's noise at (row, j) itself. The seeds are read
// from device memory at each call, so that a CUDA graph whose replays draw
// them first draws fresh noise.
template <typename Coefficients>
__device__ __forceinline__ float step_update(const EngineArgs& a, const Coefficients& coef, float x, float e,
                                             float* x0_prev, int k, int row, int j) {
  return step_update(a, coef, x, e, x0_prev, step_noise(a, k, row, j), j);
}

// Stores x after `steps_done` steps at (row, j): into the chain's entry
// steps_done, and at the end into the result. Rows whose step indices leave
// the tables store NaN (load_t_start).
__device__ __forceinline__ void store_sample(const EngineArgs& a, int steps_done, int row, int j, float v,
                                             bool valid) {
  const StepArgs& st = a.step;
  const float value = valid ? v : __int_as_float(0x7fc00000);
  if (st.chain) {
    st.out[(static_cast<size_t>(steps_done) * a.batch + row) * a.dim + j] = value;
  } else if (steps_done == a.num_steps) {
    st.out[static_cast<size_t>(row) * a.dim + j] = value;
  }
}

}  // namespace cuda_kernels
}  // namespace ddpm_ops
