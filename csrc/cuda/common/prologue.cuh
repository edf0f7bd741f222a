// The engine's prologue: the terms added to layer 0's output besides its
// bias (BiasRowArgs, args.h). Every engine kernel adds them through these
// functions, so both overloads' first layers are one formula: a time row by
// step index, the time-column overload's t / T column as such a row, a
// condition row per sample.
#pragma once

#include "activation.cuh"
#include "args.h"
#include "rows.cuh"

namespace ddpm_ops {
namespace cuda_kernels {

// The part fixed over a call for (row, column c of layer 0): its bias and
// condition row.
__device__ __forceinline__ float fixed_bias_row(const EngineArgs& a, int row, int c) {
  float b = __ldg(a.layers[0].bias + c);
  if (a.bias_rows.cond_rows != nullptr) b += __ldg(a.bias_rows.cond_rows + static_cast<size_t>(row) * a.layers[0].out + c);
  return b;
}

// The time column's weight at column c (0 without one).
__device__ __forceinline__ float time_column_weight(const BiasRowArgs& b, int c) {
  return b.time_column != nullptr ? __ldg(b.time_column + static_cast<size_t>(c) * b.time_column_ld) : 0.f;
}

// The part of step index s (clamped into the tables) at column c: the time
// row and the time column's t / T term, the latter computed from the
// unclamped index t as the time-column loop does (t_norm = t / T).
__device__ __forceinline__ float step_bias_row(const EngineArgs& a, float column_weight, int t, int s, int c) {
  float b = column_weight != 0.f ? column_weight * (static_cast<float>(t) / a.bias_rows.time_divisor) : 0.f;
  if (a.bias_rows.time_rows != nullptr) b += __ldg(a.bias_rows.time_rows + static_cast<size_t>(s) * a.layers[0].out + c);
  return b;
}

// acc + sum_q h[q] w[q] in the order of q, w in global memory and h there
// too (kGlobalInput) or in shared memory, the loads kBatch at a time: one
// load latency per term (each from L2) made a 32-term product cost 32
// latencies on fp32_resident's critical path. Batches cost registers, so
// only kernels with registers to spare ask for them; the others
// (evaluate_bias_net's kBatch of 1) keep the plain loop, with which the
// 16-row tiles of tf32x3_tiled fit 128 registers and two CTAs an SM (seed
// net, batch 4096: 624 us, against about 1000 at 153 registers).
template <bool kGlobalInput, int kBatch>
__device__ __forceinline__ float dot_from_l2(const float* h, const float* w, int n, float acc) {
  int q = 0;
  for (; q + kBatch <= n; q += kBatch) {
    float hv[kBatch], wv[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      hv[j] = kGlobalInput ? __ldg(h + q + j) : h[q + j];
      wv[j] = __ldg(w + q + j);
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) acc = fmaf(hv[j], wv[j], acc);
  }
  for (; q < n; ++q) acc = fmaf(kGlobalInput ? __ldg(h + q) : h[q], __ldg(w + q), acc);
  return acc;
}

// out[i * out_ld + c - c0] = net(input row row_of(i))[c] for rows i < n and
// columns c0 <= c < c1 of the last layer; the hidden layers go through
// `scratch` (2 n net.widest_hidden floats). The whole block calls it: a
// thread per output, a barrier per layer. The networks are small (a time
// embedding's MLP, an observation's columns), so plain dot products serve.
template <int kBatch, typename RowOf>
__device__ void evaluate_bias_net(const BiasNetArgs& net, int n, RowOf row_of, float* out, int out_ld, int c0,
                                  int c1, float* scratch) {
  const float* in = nullptr;
  int in_ld = 0;
  for (int l = 0; l < net.num_layers; ++l) {
    const LayerArgs& layer = net.layers[l];
    const bool last = l + 1 == net.num_layers;
    const int lo = last ? c0 : 0, cols = last ? c1 - c0 : layer.out;
    float* const dst = last ? out : scratch + (l & 1) * n * net.widest_hidden;
    const int dst_ld = last ? out_ld : net.widest_hidden;
    for (int idx = threadIdx.x; idx < n * cols; idx += blockDim.x) {
      const int i = idx / cols, c = lo + idx % cols;
      const float* w = layer.weight + static_cast<size_t>(c) * layer.ld;
      float acc = last ? 0.f : __ldg(layer.bias + c);
      if (l == 0) {
        const float* h = net.input + static_cast<size_t>(row_of(i)) * layer.in;
        if constexpr (kBatch > 1) {
          acc = dot_from_l2<true, kBatch>(h, w, layer.in, acc);
        } else {
          for (int q = 0; q < layer.in; ++q) acc = fmaf(__ldg(h + q), __ldg(w + q), acc);
        }
      } else {
        const float* h = in + i * in_ld;
        if constexpr (kBatch > 1) {
          acc = dot_from_l2<false, kBatch>(h, w, layer.in, acc);
        } else {
          for (int q = 0; q < layer.in; ++q) acc = fmaf(h[q], __ldg(w + q), acc);
        }
      }
      dst[i * dst_ld + c - lo] = last ? acc : activate(acc, net.activations[l]);
    }
    __syncthreads();
    in = dst;
    in_ld = dst_ld;
  }
}

// A block's rows of the bias networks in shared memory (bias_net_floats):
// the condition rows of its `rows` rows, and the time rows of `window` steps
// of them, columns [c0, c0 + cols) of layer 0.
struct BiasNetRows {
  float* cond = nullptr;  // (rows, cols)
  float* time = nullptr;  // (rows * window, cols): row r at step k0 + j is r * window + j
  float* scratch = nullptr;
  int rows = 0, cols = 0, c0 = 0, window = 1;

  __device__ BiasNetRows(const BiasRowArgs& b, float* smem, int rows_, int cols_, int c0_)
      : rows(rows_), cols(cols_), c0(c0_), window(b.window) {
    if (b.cond_net.input != nullptr) {
      cond = smem;
      smem += rows * cols;
    }
    if (b.time_net.input != nullptr) {
      time = smem;
      smem += rows * window * cols;
    }
    scratch = smem;
  }

  // The condition rows of rows row0 ... (clamped into the batch); kBatch:
  // dot_from_l2's (1: one load at a time).
  template <int kBatch = 1>
  __device__ void evaluate_cond(const EngineArgs& a, int row0) {
    if (cond == nullptr) return;
    evaluate_bias_net<kBatch>(a.bias_rows.cond_net, rows, [&](int i) { return min(row0 + i, a.batch - 1); }, cond, cols, c0,
                      c0 + cols, scratch);
  }
  // The time rows of steps k0 ... k0 + window - 1; t0(r): row r's first step index.
  template <int kBatch = 1, typename FirstStep>
  __device__ void evaluate_time(const EngineArgs& a, int k0, FirstStep t0) {
    if (time == nullptr) return;
    evaluate_bias_net<kBatch>(a.bias_rows.time_net, rows * window,
                      [&](int i) { return clamp_index(t0(i / window) - k0 - i % window, a.table_length); }, time,
                      cols, c0, c0 + cols, scratch);
  }
  // Whether step k starts a new window of time rows.
  __device__ bool time_window_starts(int k) const { return time != nullptr && k % window == 0; }
  // The networks' part of layer 0's output at (row r, step k, column c).
  __device__ float at(int r, int k, int c) const {
    float v = 0.f;
    if (cond != nullptr) v += cond[r * cols + c - c0];
    if (time != nullptr) v += time[(r * window + k % window) * cols + c - c0];
    return v;
  }
};

// Everything layer 0 adds to its product at (the block's row r, batch row
// `row`, column c) in step k, whose unclamped step index is t: the bias, the
// condition row, the time row and time column, the networks' rows.
__device__ __forceinline__ float first_layer_bias(const EngineArgs& a, const BiasNetRows& nets, int r, int row, int t,
                                                  int k, int c) {
  return fixed_bias_row(a, row, c) +
         step_bias_row(a, time_column_weight(a.bias_rows, c), t, clamp_index(t, a.table_length), c) +
         nets.at(r, k, c);
}

}  // namespace cuda_kernels
}  // namespace ddpm_ops
