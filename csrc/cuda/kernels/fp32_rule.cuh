// The fp32_rule kernel of ddpm::fused_sample.rule: exact fp32 on CUDA cores.
//
// A thread block runs R rows through every step. Its samples and two buffers
// of layer outputs live in shared memory; each warp computes a few output
// columns of a layer for all R rows at once (rule_layer), reading their weight
// rows from global memory (L2 serves the repeats: small MLPs' weights do not
// fit one SM's shared memory) and the layer's input from shared memory.
// Layer 0 adds the bias rows of the row's step index (time_rows) and of the
// row (cond_rows); the epilogue of the last layer is the step rule: six
// coefficients a row, the two clamps, the noise (given, or drawn from the
// seed where the element is updated: seeded_noise.h) and, with the chain,
// the sample of every step. Rows whose step indices leave the tables end as
// NaN (load_t_start), as in every kernel of the op.
#pragma once

#include "../../seeded_noise.h"
#include "../common/activation.cuh"
#include "../common/rows.cuh"
#include "../common/warp_reduce.cuh"
#include "fp32_rule.h"

#include <cmath>

namespace ddpm_ops {
namespace cuda_kernels {

// torch.clamp's: a NaN stays NaN.
__device__ __forceinline__ float clamp_keep_nan(float v, float lo, float hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

__device__ __forceinline__ float seeded_normal(const RuleArgs& a, int k, int row, int j) {
  const uint64_t key = seeded_noise::noise_key(a.noise_seed, a.seed_per_row, k, a.batch, row);
  return 1.41421356237309505f * erfinvf(seeded_noise::centered_uniform(seeded_noise::column_bits(key, j)));
}

// out[r][c] for the block's rows r < R and columns c of layer l: the bias
// (plus, for layer 0, the bias rows), the dot product of in[r] and weight row
// c, the layer's activation but after the last layer. Each warp takes VC
// columns at a time; its lanes split the inner dimension (float4s when
// aligned: a warp reads 512 contiguous bytes of a weight row at once) and the
// R * VC sums are reduced across the lanes by the transposing butterfly
// (warp_reduce.cuh), after which lane l holds sum l / (32 / V).
template <int R>
__device__ __forceinline__ void rule_layer(const RuleArgs& a, int l, const float* in, int in_ld, float* out,
                                           const int* step_index, int row0, int rows) {
  constexpr int VC = rule_columns(R);
  constexpr int V = R * VC;
  constexpr int kReplicas = 32 / V;
  constexpr int kWarps = rule_threads(R) / 32;
  constexpr int kUnroll = R == 1 ? 2 : 1;  // more loads in flight where registers allow
  static_assert(V >= 2 && V <= 32 && (V & (V - 1)) == 0, "a warp's sums are a power of two, at most 32");
  const LayerArgs& layer = a.layers[l];
  const int K = layer.in, N = layer.out;
  const bool last = l + 1 == a.num_layers;
  const bool vec = K % 4 == 0 && reinterpret_cast<uintptr_t>(layer.weight) % 16 == 0;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int c0 = warp * VC; c0 < N; c0 += kWarps * VC) {  // warp-uniform
    const float* w_row[VC];
#pragma unroll
    for (int j = 0; j < VC; ++j) w_row[j] = layer.weight + static_cast<size_t>(min(c0 + j, N - 1)) * K;
    float v[V];
#pragma unroll
    for (int e = 0; e < V; ++e) v[e] = 0.f;
    if (vec) {
#pragma unroll kUnroll
      for (int k4 = lane; k4 < K / 4; k4 += 32) {
        float4 w4[VC];
#pragma unroll
        for (int j = 0; j < VC; ++j) w4[j] = __ldg(reinterpret_cast<const float4*>(w_row[j]) + k4);
#pragma unroll
        for (int i = 0; i < R; ++i) {
          const float4 h4 = reinterpret_cast<const float4*>(in + i * in_ld)[k4];
#pragma unroll
          for (int j = 0; j < VC; ++j) {
            float& acc = v[i * VC + j];
            acc = fmaf(h4.x, w4[j].x, acc);
            acc = fmaf(h4.y, w4[j].y, acc);
            acc = fmaf(h4.z, w4[j].z, acc);
            acc = fmaf(h4.w, w4[j].w, acc);
          }
        }
      }
    } else {
#pragma unroll kUnroll
      for (int k = lane; k < K; k += 32) {
        float wk[VC];
#pragma unroll
        for (int j = 0; j < VC; ++j) wk[j] = __ldg(w_row[j] + k);
#pragma unroll
        for (int i = 0; i < R; ++i) {
          const float h = in[i * in_ld + k];
#pragma unroll
          for (int j = 0; j < VC; ++j) v[i * VC + j] = fmaf(h, wk[j], v[i * VC + j]);
        }
      }
    }
    reduce_transposing<V, V>(v, lane);
#pragma unroll
    for (int o = kReplicas / 2; o > 0; o >>= 1) v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
    const int e = lane / kReplicas;
    const int r = e / VC, c = c0 + e % VC;
    if (lane % kReplicas != 0 || c >= N) continue;
    float acc = v[0] + __ldg(layer.bias + c);
    if (l == 0 && r < rows) {
      if (a.time_rows != nullptr) acc += __ldg(a.time_rows + static_cast<size_t>(step_index[r]) * N + c);
      if (a.cond_rows != nullptr) acc += __ldg(a.cond_rows + static_cast<size_t>(row0 + r) * N + c);
    }
    out[r * a.width + c] = last ? acc : activate(acc, a.activations[l]);
  }
}

template <int R>
__global__ void __launch_bounds__(rule_threads(R)) fp32_rule_kernel(const RuleArgs a) {
  constexpr int kThreads = rule_threads(R);
  extern __shared__ __align__(16) float smem[];
  int* const t0 = reinterpret_cast<int*>(smem);  // the row header (rule_smem_bytes)
  int* const step_index = t0 + R;
  int* const valid = step_index + R;
  float (*const coef)[R] = reinterpret_cast<float (*)[R]>(valid + R);  // [kStepTables][R]
  float* const xs = smem + rule_row_header_floats(R);  // (R, dim_ld): the samples
  float* const buffers[2] = {xs + R * a.dim_ld, xs + R * (a.dim_ld + a.width)};

  const int row0 = blockIdx.x * R;
  const int rows = min(R, a.batch - row0);
  if (static_cast<int>(threadIdx.x) < R) {
    bool ok = false;
    t0[threadIdx.x] = static_cast<int>(threadIdx.x) < rows ? load_t_start(a, row0 + threadIdx.x, &ok) : 0;
    valid[threadIdx.x] = ok;
  }
  for (int i = threadIdx.x; i < R * a.dim; i += kThreads) {
    const int r = i / a.dim, j = i - r * a.dim;
    xs[r * a.dim_ld + j] = r < rows ? a.x[static_cast<size_t>(row0 + r) * a.dim + j] : 0.f;
  }
  __syncthreads();
  if (a.chain) {
    for (int i = threadIdx.x; i < rows * a.dim; i += kThreads) {
      const int r = i / a.dim, j = i - r * a.dim;
      a.out[static_cast<size_t>(row0 + r) * a.dim + j] = valid[r] ? xs[r * a.dim_ld + j] : NAN;
    }
  }

  for (int k = 0; k < a.num_steps; ++k) {
    if (static_cast<int>(threadIdx.x) < R) {
      const int s = clamp_index(t0[threadIdx.x] - k, a.table_length);
      step_index[threadIdx.x] = s;
#pragma unroll
      for (int q = 0; q < kStepTables; ++q) coef[q][threadIdx.x] = __ldg(a.tables + static_cast<size_t>(q) * a.table_length + s);
    }
    __syncthreads();
    const float* in = xs;
    int in_ld = a.dim_ld;
    for (int l = 0; l < a.num_layers; ++l) {
      rule_layer<R>(a, l, in, in_ld, buffers[l & 1], step_index, row0, rows);
      __syncthreads();
      in = buffers[l & 1];
      in_ld = a.width;
    }
    float* const dest = a.chain ? a.out + static_cast<size_t>(k + 1) * a.batch * a.dim : a.out;
    const bool last_step = k + 1 == a.num_steps;
    for (int i = threadIdx.x; i < rows * a.dim; i += kThreads) {
      const int r = i / a.dim, j = i - r * a.dim;
      const int row = row0 + r;
      const float e = in[r * a.width + j];
      const float xv = xs[r * a.dim_ld + j];
      float x0 = coef[kA][r] * xv - coef[kB][r] * e;
      if (a.clip) x0 = clamp_keep_nan(x0, a.clip_lo, a.clip_hi);
      float next = coef[kC][r] * x0 + coef[kD][r] * xv + coef[kE][r] * e;
      if (a.noise != nullptr) {
        next += coef[kS][r] * __ldg(a.noise + (static_cast<size_t>(k) * a.batch + row) * a.dim + j);
      } else if (a.noise_seed != nullptr) {
        next += coef[kS][r] * seeded_normal(a, k, row, j);
      }
      if (a.post_clip) next = clamp_keep_nan(next, a.post_lo, a.post_hi);
      xs[r * a.dim_ld + j] = next;
      if (a.chain || last_step) dest[static_cast<size_t>(row) * a.dim + j] = valid[r] ? next : NAN;
    }
    __syncthreads();
  }
}

}  // namespace cuda_kernels
}  // namespace ddpm_ops
