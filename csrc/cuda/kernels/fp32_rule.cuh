// The fp32_rule kernel of the engine: exact fp32 on CUDA cores, no cluster
// and no tensor cores, so it runs on every GPU the extension is built for
// and every shape whose rows fit shared memory.
//
// A thread block runs R rows through every step. Its samples and two buffers
// of layer outputs live in shared memory; each warp computes a few output
// columns of a layer for all R rows at once (rule_layer), reading their weight
// rows from global memory (L2 serves the repeats: small MLPs' weights do not
// fit one SM's shared memory) and the layer's input from shared memory.
// Layer 0 adds the prologue's bias rows (bias_rows.cuh: the bias networks
// evaluated into shared memory, the condition rows once, the time rows a
// window of steps at a time); the last layer ends
// in the epilogue's step (step_epilogue.cuh).
#pragma once

#include "../common/activation.cuh"
#include "../common/bias_rows.cuh"
#include "../common/rows.cuh"
#include "../common/step_epilogue.cuh"
#include "../common/warp_reduce.cuh"
#include "fp32_rule.h"

namespace ddpm_ops {
namespace cuda_kernels {

// The block's per-row state in shared memory (rule_smem_bytes).
template <int R>
struct RuleRows {
  int* t0;          // first step index (clamped, load_t_start)
  int* t;           // step index now, unclamped
  int* valid;
  float (*coef)[R];  // [kStepTablesWithPrevious][R]
};

// out[r][c] for the block's rows r < R and columns c of layer l: the bias
// (plus, for layer 0, the bias rows), the dot product of in[r] and weight row
// c, the layer's activation but after the last layer. Each warp takes VC
// columns at a time; its lanes split the inner dimension (float4s when
// aligned: a warp reads 512 contiguous bytes of a weight row at once) and the
// R * VC sums are reduced across the lanes by the transposing butterfly
// (warp_reduce.cuh), after which lane l holds sum l / (32 / V).
template <int R>
__device__ __forceinline__ void rule_layer(const EngineArgs& a, int l, const float* in, int in_ld, float* out,
                                           int out_ld, const RuleRows<R>& rr, const BiasNetRows& nets, int k,
                                           int row0) {
  constexpr int VC = rule_columns(R);
  constexpr int V = R * VC;
  constexpr int kReplicas = 32 / V;
  constexpr int kWarps = rule_threads(R) / 32;
  constexpr int kUnroll = R == 1 ? 2 : 1;  // more loads in flight where registers allow
  static_assert(V >= 2 && V <= 32 && (V & (V - 1)) == 0, "a warp's sums are a power of two, at most 32");
  const LayerArgs& layer = a.layers[l];
  const int K = layer.in, N = layer.out, ld = layer.ld;
  const bool last = l + 1 == a.num_layers;
  const bool vec = K % 4 == 0 && ld % 4 == 0 && reinterpret_cast<uintptr_t>(layer.weight) % 16 == 0;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int c0 = warp * VC; c0 < N; c0 += kWarps * VC) {  // warp-uniform
    const float* w_row[VC];
#pragma unroll
    for (int j = 0; j < VC; ++j) w_row[j] = layer.weight + static_cast<size_t>(min(c0 + j, N - 1)) * ld;
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
    float acc = v[0];
    if (l == 0) {
      acc += first_layer_bias(a, nets, r, min(row0 + r, a.batch - 1), rr.t[r], k, c);
    } else {
      acc += __ldg(layer.bias + c);
    }
    out[r * out_ld + c] = last ? acc : activate(acc, a.activations[l]);
  }
}

template <int R>
__global__ void __launch_bounds__(rule_threads(R)) fp32_rule_kernel(const __grid_constant__ EngineArgs a) {
  constexpr int kThreads = rule_threads(R);
  extern __shared__ __align__(16) float smem[];
  int widest = a.dim;
  for (int l = 0; l < a.num_layers; ++l) widest = max(widest, a.layers[l].out);
  const int width = round_up4(widest), dim_ld = round_up4(a.dim);
  RuleRows<R> rr;
  rr.t0 = reinterpret_cast<int*>(smem);
  rr.t = rr.t0 + R;
  rr.valid = rr.t + R;
  rr.coef = reinterpret_cast<float (*)[R]>(rr.valid + R);
  float* const xs = smem + rule_row_header_floats(R);  // (R, dim_ld): the samples
  float* const x0_prev = xs + R * dim_ld;                  // (R, dim_ld)
  float* const buffers[2] = {x0_prev + R * dim_ld, x0_prev + R * dim_ld + R * width};
  BiasNetRows nets(a.bias_rows, buffers[1] + R * width, R, a.layers[0].out, 0);

  const int row0 = blockIdx.x * R;
  const int rows = min(R, a.batch - row0);
  if (static_cast<int>(threadIdx.x) < R) {
    bool ok = false;
    rr.t0[threadIdx.x] = static_cast<int>(threadIdx.x) < rows ? load_t_start(a, row0 + threadIdx.x, &ok) : 0;
    rr.valid[threadIdx.x] = ok;
  }
  for (int i = threadIdx.x; i < R * a.dim; i += kThreads) {
    const int r = i / a.dim, j = i - r * a.dim;
    xs[r * dim_ld + j] = r < rows ? a.x[static_cast<size_t>(row0 + r) * a.dim + j] : 0.f;
    x0_prev[r * dim_ld + j] = 0.f;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < rows * a.dim; i += kThreads) {
    const int r = i / a.dim, j = i - r * a.dim;
    store_sample(a, 0, row0 + r, j, xs[r * dim_ld + j], rr.valid[r]);
  }
  nets.evaluate_cond(a, row0);

  for (int k = 0; k < a.num_steps; ++k) {
    if (static_cast<int>(threadIdx.x) < R) {
      const int t = rr.t0[threadIdx.x] - k, s = clamp_index(t, a.table_length);
      rr.t[threadIdx.x] = t;
#pragma unroll
      for (int q = 0; q < kStepTablesWithPrevious; ++q) rr.coef[q][threadIdx.x] = step_coefficient(a.step, q, s);
    }
    if (nets.time_window_starts(k)) nets.evaluate_time(a, k, [&](int r) { return rr.t0[r]; });
    __syncthreads();
    const float* in = xs;
    int in_ld = dim_ld;
    for (int l = 0; l < a.num_layers; ++l) {
      rule_layer<R>(a, l, in, in_ld, buffers[l & 1], width, rr, nets, k, row0);
      __syncthreads();
      in = buffers[l & 1];
      in_ld = width;
    }
    for (int i = threadIdx.x; i < rows * a.dim; i += kThreads) {
      const int r = i / a.dim, j = i - r * a.dim;
      const int row = row0 + r;
      const auto coef = [&](int q) { return rr.coef[q][r]; };
      const float next = step_update(a, coef, xs[r * dim_ld + j], in[r * width + j], &x0_prev[r * dim_ld + j], k,
                                     row, j);
      xs[r * dim_ld + j] = next;
      store_sample(a, k + 1, row, j, next, rr.valid[r]);
    }
    __syncthreads();
  }
}

}  // namespace cuda_kernels
}  // namespace ddpm_ops
