// The fp32_rule kernel of the engine: exact fp32 on CUDA cores, no cluster
// and no tensor cores, so it runs on every GPU the extension is built for
// and every shape whose rows fit shared memory.
//
// A thread block runs R rows through every step. Its samples and two buffers
// of layer outputs live in shared memory; each warp computes a few output
// columns of a layer for all R rows at once (rule_layer), reading their weight
// rows from global memory (L2 serves the repeats: small MLPs' weights do not
// fit one SM's shared memory) and the layer's input from shared memory.
// Layer 0 adds the prologue's bias rows (prologue.cuh: the bias networks
// evaluated into shared memory, the condition rows once, the time rows a
// window of steps at a time); the last layer ends
// in the epilogue's step (epilogue.cuh).
//
// A network program (ProgramArgs, fp32_rule.h) replaces the chain of layers
// by its instructions, run in order by the whole block (rule_program): its
// Linear layers are rule_layer's, the concatenated input, the activations and
// the residual adds are element-wise passes over shared memory, a LayerNorm a
// warp per row; the residual stack is more activation buffers.
//
// On Hopper the rows may be run by a cluster of CTAs (kCluster): each CTA
// computes its share of every Linear's output columns, reading only those
// weight rows, and stores them into every CTA of the cluster (distributed
// shared memory), a cluster barrier after each Linear. Everything else (the
// prologue, the program's element-wise instructions and LayerNorms, the
// step) every CTA computes on whole rows of its own copy, so that a
// LayerNorm or a residual add needs no exchange: the copies stay identical
// (the noise is drawn alike in every CTA). A small batch's weight stream,
// the bound of one block (every weight from L2 at every step), is so split
// over the cluster's SMs.
#pragma once

#include "../common/activation.cuh"
#include "../common/prologue.cuh"
#include "../common/ptx.cuh"
#include "../common/rows.cuh"
#include "../common/epilogue.cuh"
#include "../common/warp_reduce.cuh"
#include "../../plan/shapes/fp32_rule.h"
#include "fp32_rule.h"

namespace ddpm_ops {
namespace cuda_kernels {

// The shape the plan chooses for this kernel (csrc/plan/shapes/fp32_rule.h).
using shapes::RuleWeights;
using shapes::rule_column_share;
using shapes::rule_columns;
using shapes::rule_row_header_floats;
using shapes::rule_scratch_floats;
using shapes::rule_threads;

// This CTA's place in its cluster (one CTA of one: no cluster).
struct RuleCluster {
  int rank = 0, size = 1;
  // The output columns [x, y) of a layer of n this CTA computes in blocks of
  // R rows (rule_column_share).
  template <int R>
  __device__ int2 columns(int n) const {
    const int share = rule_column_share(n, size, R);
    const int begin = min(n, rank * share);
    return make_int2(begin, min(n, begin + share));
  }
};

// Every thread of the block (kCluster: of the cluster) has arrived here, and
// their earlier shared-memory writes, remote ones included, are visible.
template <bool kCluster>
__device__ __forceinline__ void rule_barrier() {
  sync_cluster_or_cta<kCluster ? 2 : 1>();  // any size above one: the cluster barrier
}

// The block's per-row state in shared memory (rule_smem_bytes).
template <int R>
struct RuleRows {
  int* t0;          // first step index (clamped, load_t_start)
  int* t;           // step index now, unclamped
  int* valid;
  float (*coef)[R];  // [kStepTablesWithPrevious][R]
  float* scratch;    // rule_layer's partial sums (rule_scratch_floats)
};

// A weight's float4 at k4 / float at k: kept on chip (shared memory) or read
// through the read-only cache from L2.
template <bool kOnChip>
__device__ __forceinline__ float4 weight4(const float* row, int k4) {
  if constexpr (kOnChip) return reinterpret_cast<const float4*>(row)[k4];
  return __ldg(reinterpret_cast<const float4*>(row) + k4);
}
template <bool kOnChip>
__device__ __forceinline__ float weight1(const float* row, int k) {
  if constexpr (kOnChip) return row[k];
  return __ldg(row + k);
}

// v[i * VC + j] += this lane's part of in[i] . w_row[j] over the K inputs:
// those (float4s where vec) from `first` on, every `stride`-th.
template <int R, int VC, bool kOnChip>
__device__ __forceinline__ void rule_products(const float* const (&w_row)[VC], const float* in, int in_ld, int K,
                                              bool vec, int first, int stride, float (&v)[R * VC]) {
  // More loads in flight where registers allow and the loads are L2's.
  constexpr int kUnroll = R == 1 && !kOnChip ? 2 : 1;
  if (vec) {
#pragma unroll kUnroll
    for (int k4 = first; k4 < K / 4; k4 += stride) {
      float4 w4[VC];
#pragma unroll
      for (int j = 0; j < VC; ++j) w4[j] = weight4<kOnChip>(w_row[j], k4);
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
    for (int k = first; k < K; k += stride) {
      float wk[VC];
#pragma unroll
      for (int j = 0; j < VC; ++j) wk[j] = weight1<kOnChip>(w_row[j], k);
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const float h = in[i * in_ld + k];
#pragma unroll
        for (int j = 0; j < VC; ++j) v[i * VC + j] = fmaf(h, wk[j], v[i * VC + j]);
      }
    }
  }
}

// out[r][c] for the block's rows r < R and columns c of layer l: the bias
// (plus, for layer 0, the bias rows), the dot product of in[r] and weight row
// c, the layer's activation but after the last layer. Each warp takes VC
// columns at a time; its lanes split the inner dimension (float4s when
// aligned: a warp reads 512 contiguous bytes of a weight row at once) and the
// R * VC sums are reduced across the lanes by the transposing butterfly
// (warp_reduce.cuh), after which lane l holds sum l / (32 / V) (in each of
// its kReplicas lanes). Where the columns are too few to keep every warp
// busy (a narrow last layer, a cluster's share), `split` warps take each
// group of columns, each a part of the inner dimension, and their sums meet
// in `scratch` (rule_scratch_floats). In a cluster the CTA computes its share
// of the columns (RuleCluster::columns) and stores them into the partners'
// `out` too. The weights are read from `on_chip` (this CTA's share of the
// layer, rows of round_up4(in) floats) where it is not null, else from L2.
template <int R, bool kCluster>
__device__ __forceinline__ void rule_layer(const EngineArgs& a, int l, const float* in, int in_ld, float* out,
                                           int out_ld, const RuleRows<R>& rr, const BiasNetRows& nets, int k,
                                           int row0, const RuleCluster& cluster, const float* on_chip,
                                           float* scratch) {
  constexpr int VC = rule_columns(R);
  constexpr int V = R * VC;
  constexpr int kReplicas = 32 / V;
  constexpr int kThreads = rule_threads(R);
  constexpr int kWarps = kThreads / 32;
  static_assert(V >= 2 && V <= 32 && (V & (V - 1)) == 0, "a warp's sums are a power of two, at most 32");
  const LayerArgs& layer = a.layers[l];
  const int K = layer.in;
  const int2 columns = cluster.columns<R>(layer.out);
  const int end = columns.y;
  const bool last = l + 1 == a.num_layers;
  const int ld = on_chip != nullptr ? round_up4(K) : layer.ld;
  const float* const weights = on_chip != nullptr ? on_chip : layer.weight;
  const bool vec = K % 4 == 0 && ld % 4 == 0 && reinterpret_cast<uintptr_t>(weights) % 16 == 0;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int groups = (end - columns.x + VC - 1) / VC;
  int split = 1;  // a power of two: warp % split is the warp's part
  while (groups > 0 && 2 * split * groups <= kWarps) split *= 2;
  const int part = warp % split;
  // Element (r, c) from its sum, stored into CTA p of the cluster (this one's own at its rank).
  const auto store = [&](float acc, int r, int c, int p) {
    acc += l == 0 ? first_layer_bias(a, nets, r, min(row0 + r, a.batch - 1), rr.t[r], k, c) : __ldg(layer.bias + c);
    const float value = last ? acc : activate(acc, a.activations[l]);
    float* const dst = out + r * out_ld + c;
    if (!kCluster || p == cluster.rank) {
      *dst = value;
    } else {
      st_cluster(cluster_address(smem_address(dst), p), value);
    }
  };
  for (int c0 = columns.x + warp / split * VC; c0 < end; c0 += kWarps / split * VC) {  // warp-uniform
    const float* w_row[VC];
#pragma unroll
    for (int j = 0; j < VC; ++j) {
      const int c = min(c0 + j, end - 1);
      w_row[j] = weights + static_cast<size_t>(on_chip != nullptr ? c - columns.x : c) * ld;
    }
    float v[V];
#pragma unroll
    for (int e = 0; e < V; ++e) v[e] = 0.f;
    if (on_chip != nullptr) {
      rule_products<R, VC, true>(w_row, in, in_ld, K, vec, lane + 32 * part, 32 * split, v);
    } else {
      rule_products<R, VC, false>(w_row, in, in_ld, K, vec, lane + 32 * part, 32 * split, v);
    }
    reduce_transposing<V, V>(v, lane);
#pragma unroll
    for (int o = kReplicas / 2; o > 0; o >>= 1) v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
    const int e = lane / kReplicas, replica = lane % kReplicas;
    if (split > 1) {
      if (replica == 0) scratch[warp * V + e] = v[0];
      continue;
    }
    const int c = c0 + e % VC;
    if (c >= end) continue;
    for (int p = replica; p < cluster.size; p += kReplicas) store(v[0], e / VC, c, p);
  }
  if (split == 1) return;  // block-uniform
  __syncthreads();
  for (int i = threadIdx.x; i < groups * V * cluster.size; i += kThreads) {
    const int p = i % cluster.size, g = i / cluster.size / V, e = i / cluster.size % V;
    const int c = columns.x + g * VC + e % VC;
    if (c >= end) continue;
    float acc = 0.f;
    for (int q = 0; q < split; ++q) acc += scratch[(g * split + q) * V + e];
    store(acc, e / VC, c, p);
  }
}

// The sum of a value over the warp's lanes, in every lane.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// dst = LayerNorm(src) over n columns of each of the R rows, a warp per row:
// two passes over the row (the mean, then the centred squares: the one-pass
// E[h^2] - mean^2 loses the variance of rows far from zero mean), biased
// variance, then the affine part. In place (dst == src) is safe: a lane
// writes only the columns it read.
template <int R>
__device__ __forceinline__ void rule_layer_norm(const float* src, int src_ld, float* dst, int dst_ld, int n, float eps,
                                                const float* gamma, const float* beta) {
  constexpr int kWarps = rule_threads(R) / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int r = warp; r < R; r += kWarps) {
    const float* in = src + r * src_ld;
    float sum = 0.f;
    for (int j = lane; j < n; j += 32) sum += in[j];
    const float mean = warp_sum(sum) / static_cast<float>(n);
    float squares = 0.f;
    for (int j = lane; j < n; j += 32) {
      const float d = in[j] - mean;
      squares = fmaf(d, d, squares);
    }
    const float rstd = 1.f / sqrtf(warp_sum(squares) / static_cast<float>(n) + eps);
    float* out = dst + r * dst_ld;
    for (int j = lane; j < n; j += 32) {
      const float y = (in[j] - mean) * rstd;
      out[j] = gamma != nullptr ? fmaf(y, __ldg(gamma + j), __ldg(beta + j)) : y;
    }
  }
}

// Step k's network program (ProgramArgs) on the block's rows; returns the
// buffer that holds e. Buffer b >= 0 is buffers + b * R * width, all of
// row stride width; the samples xs have dim_ld. A barrier follows every
// instruction (each reads what the one before wrote, across warps), a
// cluster's after a Linear (its columns come from every CTA).
template <int R, bool kCluster, typename OnChip>
__device__ const float* rule_program(const EngineArgs& a, const ProgramArgs& prog, const float* xs, int dim_ld,
                                     float* buffers, int width, const RuleRows<R>& rr, const BiasNetRows& nets, int k,
                                     int row0, const RuleCluster& cluster, OnChip on_chip) {
  constexpr int kThreads = rule_threads(R);
  const auto buffer = [&](int b) { return b == kProgramX ? const_cast<float*>(xs) : buffers + b * R * width; };
  const auto ld = [&](int b) { return b == kProgramX ? dim_ld : width; };
  const float* out = xs;
  for (int i = 0; i < prog.num_ops; ++i) {
    const ProgramOpArgs& op = prog.ops[i];
    const float* src = buffer(op.src);
    const int src_ld = ld(op.src), n = op.width;
    float* const dst = buffer(op.dst);
    switch (op.kind) {
      case ProgramOpArgs::kInput:
        for (int e = threadIdx.x; e < R * n; e += kThreads) {
          const int r = e / n, column = e - r * n;
          int c = column;  // the column within the part
          float v = 0.f;
          for (int p = 0; p < prog.num_input_parts; ++p) {
            const int part = prog.input_parts[p];
            const int cols = part == kPartX ? a.dim : (part == kPartCond ? prog.cond_cols : prog.time_cols);
            if (c < cols) {
              v = part == kPartX    ? xs[r * dim_ld + c]
                  : part == kPartCond ? __ldg(prog.cond_input + static_cast<size_t>(min(row0 + r, a.batch - 1)) *
                                                                    prog.cond_cols + c)
                                      : __ldg(prog.time_input + static_cast<size_t>(clamp_index(rr.t[r], a.table_length)) *
                                                                    prog.time_cols + c);
              break;
            }
            c -= cols;
          }
          dst[r * width + column] = v;
        }
        break;
      case ProgramOpArgs::kLinear:
        if (kCluster && op.fence) rule_barrier<kCluster>();
        rule_layer<R, kCluster>(a, op.index, src, src_ld, dst, width, rr, nets, k, row0, cluster, on_chip(op.index),
                                rr.scratch);
        break;
      case ProgramOpArgs::kActivation:
        for (int e = threadIdx.x; e < R * n; e += kThreads) {
          const int r = e / n, c = e - r * n;
          dst[r * width + c] = activate(src[r * src_ld + c], static_cast<Activation>(op.act));
        }
        break;
      case ProgramOpArgs::kLayerNorm:
        rule_layer_norm<R>(src, src_ld, dst, width, n, op.eps, op.index >= 0 ? prog.norm_weights[op.index] : nullptr,
                           op.index >= 0 ? prog.norm_biases[op.index] : nullptr);
        break;
      case ProgramOpArgs::kAdd: {
        const float* other = buffer(op.other);
        const int other_ld = ld(op.other);
        for (int e = threadIdx.x; e < R * n; e += kThreads) {
          const int r = e / n, c = e - r * n;
          dst[r * width + c] = src[r * src_ld + c] + other[r * other_ld + c];
        }
        break;
      }
    }
    if (op.kind == ProgramOpArgs::kLinear) {
      rule_barrier<kCluster>();
    } else {
      __syncthreads();
    }
    out = dst;
  }
  return out;
}

// kProgram: the instantiation that runs `prog` (num_ops > 0); the other
// runs the chain of layers and never reads it, so that a call without a
// program runs the code it ran before programs existed. kCluster: the rows
// are run by a cluster of CTAs (launched as such; the Hopper build only).
template <int R, bool kProgram, bool kCluster>
__global__ void __launch_bounds__(rule_threads(R))
    fp32_rule_kernel(const __grid_constant__ EngineArgs a, const __grid_constant__ ProgramArgs prog,
                     const __grid_constant__ RuleWeights kept) {
  constexpr int kThreads = rule_threads(R);
  extern __shared__ __align__(16) float smem[];
  int widest = kProgram ? max(a.dim, prog.input_width) : a.dim;
  for (int l = 0; l < a.num_layers; ++l) widest = max(widest, a.layers[l].out);
  const int width = round_up4(widest), dim_ld = round_up4(a.dim);
  RuleRows<R> rr;
  rr.t0 = reinterpret_cast<int*>(smem);
  rr.t = rr.t0 + R;
  rr.valid = rr.t + R;
  rr.coef = reinterpret_cast<float (*)[R]>(rr.valid + R);
  rr.scratch = smem + rule_row_header_floats(R);
  float* const xs = rr.scratch + rule_scratch_floats(R);  // (R, dim_ld): the samples
  float* const x0_prev = xs + R * dim_ld;                  // (R, dim_ld)
  float* const buffers[2] = {x0_prev + R * dim_ld, x0_prev + R * dim_ld + R * width};
  BiasNetRows nets(a.bias_rows, buffers[1] + (kProgram ? 1 + prog.saved_buffers : 1) * R * width, R,
                   a.layers[0].out, 0);
  RuleCluster cluster;
  if constexpr (kCluster) {
    cluster.rank = cluster_rank();
    cluster.size = cluster_size();
  }
  // The CTAs of a cluster hold the same samples; each stores its share of them.
  const auto stores = [&](int i) { return !kCluster || i % cluster.size == cluster.rank; };

  const int row0 = static_cast<int>(blockIdx.x) / cluster.size * R;
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
  // This CTA's share of each layer kept on chip: copied once.
  for (int l = 0; l < a.num_layers; ++l) {
    if (kept.offset[l] == 0) continue;
    const LayerArgs& layer = a.layers[l];
    const int2 columns = cluster.columns<R>(layer.out);
    const int ld = round_up4(layer.in), n = (columns.y - columns.x) * layer.in;
    for (int i = threadIdx.x; i < n; i += kThreads) {
      const int c = i / layer.in, q = i - c * layer.in;
      smem[kept.offset[l] + c * ld + q] = __ldg(layer.weight + static_cast<size_t>(columns.x + c) * layer.ld + q);
    }
  }
  const auto on_chip = [&](int l) { return kept.offset[l] != 0 ? smem + kept.offset[l] : nullptr; };
  // In a cluster also: every CTA has started before any stores into it.
  rule_barrier<kCluster>();
  for (int i = threadIdx.x; i < rows * a.dim; i += kThreads) {
    const int r = i / a.dim, j = i - r * a.dim;
    if (stores(i)) store_sample(a, 0, row0 + r, j, xs[r * dim_ld + j], rr.valid[r]);
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
    if constexpr (kProgram) {
      in = rule_program<R, kCluster>(a, prog, xs, dim_ld, buffers[0], width, rr, nets, k, row0, cluster, on_chip);
    }
    for (int l = 0; !kProgram && l < a.num_layers; ++l) {
      rule_layer<R, kCluster>(a, l, in, in_ld, buffers[l & 1], width, rr, nets, k, row0, cluster, on_chip(l),
                              rr.scratch);
      rule_barrier<kCluster>();
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
      if (stores(i)) store_sample(a, k + 1, row, j, next, rr.valid[r]);
    }
    // In a cluster also: no CTA stores the next step's first Linear into
    // another that still reads this step's e.
    rule_barrier<kCluster>();
  }
}

}  // namespace cuda_kernels
}  // namespace ddpm_ops
