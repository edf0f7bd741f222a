// The small-batch kernel of the engine (exact fp32 on CUDA cores):
// fp32_resident_kernel<kOpw, kRows, kLayers>, every weight in registers. It
// runs the general step of both overloads: layer 0 adds the prologue's bias
// rows (prologue.cuh), each hidden layer its activation, and the x update is
// the epilogue's step (epilogue.cuh).
//
// At a handful of rows a step is a chain of dependent layers, each one short
// dot product per lane, a shuffle reduction and a trip through distributed
// shared memory; the time is that chain's instructions (BENCHMARKS.md). So
// this kernel keeps nothing on the chain but those: the cluster's CTAs split
// every layer, CTA r owning columns [r S, r S + S) of each hidden layer (S =
// 8 kOpw), and every thread holds its share of the weights in registers for
// the whole call, loaded once. The layer loop, the shapes of the register
// arrays and every index are compile-time constants.
//
//   - Hidden layer l: warp w of CTA r computes columns r S + w kOpw + o,
//     o < kOpw, for the kRows rows; lane i takes the inner columns
//     [4 i, 4 i + 4) and [128 + 4 i, 128 + 4 i + 4) (layer 0: [2 i, 2 i + 2)
//     of x; the bias rows are added with the bias), so the float4 reads of
//     a row are conflict-free. A transposing shuffle butterfly
//     (reduce_transposing) leaves each output on 32 / V lanes, which share
//     its st.async stores into every CTA of the cluster, completing on the
//     receiver's mbarrier: the fp32_smem kernel's exchange.
//   - The last hidden layer's outputs stay in their CTA: the last layer is
//     split over its inner dimension. CTA r multiplies its own S columns by
//     every column of the last layer and sends the partial eps (dim values a
//     row) to every CTA, which adds them up in rank order (so all CTAs hold
//     the same eps, bit for bit) and updates its copy of x. Warp w takes eps
//     columns [8 w, 8 w + 8), 4 lanes a column, each over S / 4 inner columns:
//     float4 blocks g, g + 4, ... of the CTA's S (g = lane % 4), so that the
//     four lanes' reads of a row fall in different banks (contiguous
//     quarters were a 4-way conflict at S = 128: at seed batch 64 the last
//     layer held a quarter of the stall samples, waiting on those reads).
// So a step has one exchange per hidden layer (the last one's is of dim
// values, not H) and two CTA barriers; each CTA does 1 / cs of the work.
// Envelope (host: fp32_resident_shape, csrc/plan): 2 to 4 layers, dim <= 64, every hidden
// layer of the same width H <= 256 with H a multiple of 8 kOpw (the cluster
// has H / (8 kOpw) CTAs; kOpw = 2, 4 or 16), the weights of every layer but
// the first 16-byte aligned (float4 loads), at most 8 rows per cluster, and
// the registers (resident_fits).
#pragma once

#include "../common/activation.cuh"
#include "../common/prologue.cuh"
#include "../common/ptx.cuh"
#include "../common/rows.cuh"
#include "../common/epilogue.cuh"
#include "../common/warp_reduce.cuh"
#include "../../plan/shapes/fp32_resident.h"

#include <cooperative_groups.h>

namespace ddpm_ops {
namespace cuda_kernels {

// The shape the plan chooses for this kernel (csrc/plan/shapes/fp32_resident.h).
using shapes::ResidentBuffers;
using shapes::kHiddenPerLane;
using shapes::kInputPerLane;
using shapes::kResidentMaxDim;
using shapes::kResidentMaxHidden;
using shapes::kResidentMaxLayers;
using shapes::kResidentThreads;
using shapes::resident_bias_floats_at;
using shapes::resident_fits;

namespace cg = cooperative_groups;

// Column of element j of a lane's kHiddenPerLane inner columns.
__device__ __forceinline__ int hidden_column(int lane, int j) { return 4 * (lane + 32 * (j / 4)) + j % 4; }

// The products of one warp's tile, kRows rows x C columns, each lane over its
// kK inner columns, then the transposing reduction: on return v[0] holds
// output e = lane / (32 / (kRows C)) (row e / C, column e % C), on 32 /
// (kRows C) lanes.
template <int kRows, int C, int kK>
__device__ __forceinline__ void resident_products(float (&v)[kRows * C], const float (&w)[C][kK],
                                                  const float (&in)[kRows][kK], int lane) {
  constexpr int V = kRows * C;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int o = 0; o < C; ++o) {
      float acc = 0.f;
#pragma unroll
      for (int j = 0; j < kK; ++j) acc = fmaf(in[r][j], w[o][j], acc);
      v[r * C + o] = acc;
    }
  }
  reduce_transposing<V, V>(v, lane);
#pragma unroll
  for (int o = 16 / V; o > 0; o >>= 1) v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
}

// in[r] <- this lane's inner columns of row r of a hidden buffer.
template <int kRows>
__device__ __forceinline__ void load_hidden_inputs(float (&in)[kRows][kHiddenPerLane],
                                                   const float (&buffer)[kRows][kResidentMaxHidden], int lane) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int i = 0; i < kHiddenPerLane / 4; ++i) {
      const float4 q = reinterpret_cast<const float4*>(buffer[r])[lane + 32 * i];
      in[r][4 * i] = q.x;
      in[r][4 * i + 1] = q.y;
      in[r][4 * i + 2] = q.z;
      in[r][4 * i + 3] = q.w;
    }
  }
}

// w[o][j] <- weight[n0 + o][hidden_column(lane, j)] (row stride ld, rows
// 16-byte aligned), zero past the K inner columns (K % 4 == 0): two float4
// loads an output. The whole call's weights load once, at its start, where
// scalar loads and their addresses had been the largest part of the time
// (seed batch 64, clusters of 2: about 14 of 40 us, BENCHMARKS.md).
template <int C>
__device__ __forceinline__ void load_hidden_weights(float (&w)[C][kHiddenPerLane], const float* weight, int n0,
                                                    int K, int ld, int lane) {
#pragma unroll
  for (int o = 0; o < C; ++o) {
    const float4* row = reinterpret_cast<const float4*>(weight + static_cast<size_t>(n0 + o) * ld);
#pragma unroll
    for (int i = 0; i < kHiddenPerLane / 4; ++i) {
      const int q = lane + 32 * i;
      const float4 v = q < K / 4 ? __ldg(row + q) : make_float4(0.f, 0.f, 0.f, 0.f);
      w[o][4 * i] = v.x;
      w[o][4 * i + 1] = v.y;
      w[o][4 * i + 2] = v.z;
      w[o][4 * i + 3] = v.w;
    }
  }
}

template <int kOpw, int kRows, int kLayers>
__global__ void __launch_bounds__(kResidentThreads, 1) fp32_resident_kernel(const __grid_constant__ EngineArgs a) {
#if DDPM_OPS_HOPPER_CODE
  static_assert(kLayers >= 2 && kLayers <= kResidentMaxLayers, "2 to 4 layers");
  static_assert(resident_fits(kOpw, kRows, kLayers), "the registers");
  static_assert(kHiddenPerLane * 32 == kResidentMaxHidden && kInputPerLane * 32 == kResidentMaxDim, "lane split");
  constexpr int kSliced = kLayers - 1;   // hidden layers; all but the last are exchanged
  constexpr int kOwn = 8 * kOpw;         // hidden columns per CTA
  constexpr int kPartialK = kOwn / 4;    // inner columns per lane of the last layer
  constexpr int kSliceV = kRows * kOpw;  // outputs of a warp's hidden-layer tile
  static_assert(kSliceV <= 32, "a warp's tile is at most 32 outputs");
  static_assert(kPartialK % 4 == 0, "float4 reads of the last hidden layer");
  constexpr int kSliceReplicas = 32 / kSliceV;
  constexpr int kBiasNetLoadBatch = 4;  // dot_from_l2: the registers are there (no instantiation spills)
  constexpr int kUpdates = (kRows * kResidentMaxDim + kResidentThreads - 1) / kResidentThreads;  // x values per thread
  // All of the shared memory is asked for, though, so that a multiprocessor
  // runs one CTA, as the co-resident cluster counts assume (plan::Device).
  extern __shared__ float4 smem_f4[];
  ResidentBuffers<kOpw, kRows>& sh = *reinterpret_cast<ResidentBuffers<kOpw, kRows>*>(smem_f4);
  static_assert(sizeof(ResidentBuffers<kOpw, kRows>) <= sizeof(float) * resident_bias_floats_at(kOpw, kRows),
                "the bias networks' rows start after the buffers");

  cg::cluster_group cluster = cg::this_cluster();
  const int cs = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int row0 = static_cast<int>(blockIdx.x / cs) * kRows;
  const int dim = a.dim;
  const int H = a.layers[0].out;
  const int own0 = rank * kOwn;           // this CTA's first hidden column
  const int n_warp = own0 + warp * kOpw;  // this warp's
  // The bias networks' rows of this CTA's columns of layer 0.
  BiasNetRows nets(a.bias_rows, reinterpret_cast<float*>(smem_f4) + resident_bias_floats_at(kOpw, kRows), kRows,
                   kOwn, own0);
  auto clamped_row = [&](int r) { return min(row0 + r, a.batch - 1); };

  // Every weight this thread multiplies, for the whole call.
  float w0[kOpw][kInputPerLane];
  float wh[kSliced > 1 ? kSliced - 1 : 1][kOpw][kHiddenPerLane];
  float wl[1][kPartialK];  // the last layer: column l_col, inner float4 blocks l_group + 4 m
#pragma unroll
  for (int o = 0; o < kOpw; ++o) {
#pragma unroll
    for (int j = 0; j < kInputPerLane; ++j) {
      const int k = kInputPerLane * lane + j;
      w0[o][j] = k < dim ? __ldg(a.layers[0].weight + static_cast<size_t>(n_warp + o) * a.layers[0].ld + k) : 0.f;
    }
  }
#pragma unroll
  for (int l = 1; l < kSliced; ++l) load_hidden_weights(wh[l - 1], a.layers[l].weight, n_warp, H, H, lane);
  const int l_col = 8 * warp + lane / 4;
  const int l_group = lane % 4;  // float4 blocks l_group + 4 m of this CTA's columns
  const float4* l_row =
      reinterpret_cast<const float4*>(a.layers[kLayers - 1].weight + static_cast<size_t>(l_col) * H + own0) + l_group;
#pragma unroll
  for (int q = 0; q < kPartialK; q += 4) {
    const float4 v = l_col < dim ? __ldg(l_row + q) : make_float4(0.f, 0.f, 0.f, 0.f);
    wl[0][q] = v.x;
    wl[0][q + 1] = v.y;
    wl[0][q + 2] = v.z;
    wl[0][q + 3] = v.w;
  }

  // What a lane needs for the output it ends a hidden layer with: row s_row,
  // column s_col, the biases (layer 0's with its condition row) and the time
  // column's weight there.
  const int s_e = lane / kSliceReplicas;
  const int s_row = s_e / kOpw;
  const int s_col = n_warp + s_e % kOpw;
  const int s_replica = lane % kSliceReplicas;
  float s_bias[kSliced];
  s_bias[0] = fixed_bias_row(a, clamped_row(s_row), s_col);
#pragma unroll
  for (int l = 1; l < kSliced; ++l) s_bias[l] = __ldg(a.layers[l].bias + s_col);
  const float s_time_weight = time_column_weight(a.bias_rows, s_col);
  bool unused;
  const int s_t0 = load_t_start(a, clamped_row(s_row), &unused);
  auto step_bias = [&](int k) {
    return step_bias_row(a, s_time_weight, s_t0 - k, clamp_index(s_t0 - k, a.table_length), s_col);
  };
  // And for the x values it updates: u_row[m], column u_col, the last bias,
  // whether the row's step indices are in range.
  const int u_col = threadIdx.x % kResidentMaxDim;
  const float u_bias = u_col < dim ? __ldg(a.layers[kLayers - 1].bias + u_col) : 0.f;
  int u_row[kUpdates];
  bool u_valid[kUpdates];
#pragma unroll
  for (int m = 0; m < kUpdates; ++m) {
    u_row[m] = (threadIdx.x + m * kResidentThreads) / kResidentMaxDim;
    load_t_start(a, clamped_row(u_row[m]), &u_valid[m]);
  }
  auto updates = [&](int m) { return u_row[m] < kRows && u_col < dim; };
  // Thread r < kRows loads row r's coefficients of step k into registers,
  // then publishes them into sh.coef[k & 1].
  const bool c_loads = static_cast<int>(threadIdx.x) < kRows;
  const int c_t0 = c_loads ? load_t_start(a, clamped_row(threadIdx.x), &unused) : 0;
  StepRow c_next;
  auto load_coefficients = [&](int k) {
    if (c_loads) c_next.load(a.step, clamp_index(c_t0 - k, a.table_length));
  };
  auto publish_coefficients = [&](int k) {
    if (!c_loads) return;
#pragma unroll
    for (int q = 0; q < kStepTablesWithPrevious; ++q) sh.coef[k & 1][q][threadIdx.x] = c_next.c[q];
  };

  // Zero the layer inputs (padding columns are read, against zero weights),
  // then the first x.
  for (int i = threadIdx.x; i < kRows * kResidentMaxDim; i += kResidentThreads) (&sh.x[0][0])[i] = 0.f;
  for (int i = threadIdx.x; i < 2 * kRows * kResidentMaxHidden; i += kResidentThreads) (&sh.hidden[0][0][0])[i] = 0.f;
  for (int i = threadIdx.x; i < kRows * kResidentMaxDim; i += kResidentThreads) (&sh.x0_prev[0][0])[i] = 0.f;
  __syncthreads();
#pragma unroll
  for (int m = 0; m < kUpdates; ++m) {
    const int row = row0 + u_row[m];
    if (updates(m) && row < a.batch) {
      sh.x[u_row[m]][u_col] = __ldg(a.x + static_cast<size_t>(row) * dim + u_col);
      if (row % cs == rank) store_sample(a, 0, row, u_col, sh.x[u_row[m]][u_col], u_valid[m]);
    }
  }
  load_coefficients(0);
  publish_coefficients(0);
  float s_step_bias = step_bias(0);
  nets.evaluate_cond<kBiasNetLoadBatch>(a, row0);
  if (threadIdx.x == 0) {
    // One arrival per phase, this CTA's own; the senders' bytes complete it.
    for (int b = 0; b < 4; ++b) mbarrier_init(&sh.bars[b], 1);
    fence_mbarrier_init();
  }
  // Every CTA must be running, its mbarriers initialized, before anyone sends
  // to it; this also publishes x.
  cluster.sync();

  // Phase parities, bit b for bars[b], of the next phase to complete.
  uint32_t parity = 0;
  auto wait_for = [&](int b) {
    mbarrier_wait(&sh.bars[b], (parity >> b) & 1u);
    parity ^= 1u << b;
  };
  int buffer = 0;  // the hidden buffer the next exchanged layer writes
  for (int k = 0; k < a.num_steps; ++k) {
    // The next step's coefficients and bias rows, in flight during this one.
    if (k + 1 < a.num_steps) load_coefficients(k + 1);
    const float s_next_step_bias = k + 1 < a.num_steps ? step_bias(k + 1) : 0.f;
    if (nets.time_window_starts(k)) {
      nets.evaluate_time<kBiasNetLoadBatch>(a, k, [&](int r) { return load_t_start(a, clamped_row(r), &unused); });
    }
#pragma unroll
    for (int l = 0; l < kSliced; ++l) {
      float v[kSliceV];
      if (l == 0) {
        float in[kRows][kInputPerLane];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const float2 p = reinterpret_cast<const float2*>(sh.x[r])[lane];
          in[r][0] = p.x;
          in[r][1] = p.y;
        }
        resident_products<kRows, kOpw, kInputPerLane>(v, w0, in, lane);
        v[0] += s_bias[0] + s_step_bias + nets.at(s_row, k, s_col);
      } else {
        wait_for(buffer ^ 1);
        float in[kRows][kHiddenPerLane];
        load_hidden_inputs<kRows>(in, sh.hidden[buffer ^ 1], lane);
        resident_products<kRows, kOpw, kHiddenPerLane>(v, wh[l - 1], in, lane);
        v[0] += s_bias[l];
      }
      const float out = activate_fast(v[0], a.activations[l]);
      if (l + 1 == kSliced) {
        if (s_replica == 0) sh.last[s_row][s_col - own0] = out;
        break;
      }
      // The exchange (the fp32_smem kernel's: why no barrier guards it). This
      // CTA's own arrival announces the phase's bytes, before or after they
      // land.
      if (threadIdx.x == 0)
        mbarrier_expect_local(smem_address(&sh.bars[buffer]), static_cast<uint32_t>(kRows * H * sizeof(float)));
      const uint32_t at = smem_address(&sh.hidden[buffer][s_row][s_col]);
      const uint32_t bar = smem_address(&sh.bars[buffer]);
      for (int d = s_replica; d < cs; d += kSliceReplicas)
        st_async(cluster_address(at, d), out, cluster_address(bar, d));
      buffer ^= 1;
    }
    // The last layer, this CTA's share of its inner dimension. Its partial
    // sums go to every CTA, into a buffer by step parity: a CTA sends step
    // k + 2's only once it has every CTA's step k + 1 partials, which each
    // sends after adding up its step k ones.
    __syncthreads();  // sh.last
    const int pb = k & 1;
    float p[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float acc = 0.f;
#pragma unroll
      for (int q = 0; q < kPartialK; q += 4) {
        const float4 h = reinterpret_cast<const float4*>(sh.last[r])[l_group + q];
        acc = fmaf(h.x, wl[0][q], acc);
        acc = fmaf(h.y, wl[0][q + 1], acc);
        acc = fmaf(h.z, wl[0][q + 2], acc);
        acc = fmaf(h.w, wl[0][q + 3], acc);
      }
      acc += __shfl_xor_sync(0xffffffffu, acc, 1);
      p[r] = acc + __shfl_xor_sync(0xffffffffu, acc, 2);
    }
    if (threadIdx.x == 0)
      mbarrier_expect_local(smem_address(&sh.bars[2 + pb]), static_cast<uint32_t>(cs * kRows * dim * sizeof(float)));
    if (l_col < dim) {
      const uint32_t at = smem_address(&sh.partial[pb][rank][0][l_col]);
      const uint32_t bar = smem_address(&sh.bars[2 + pb]);
      for (int d = lane % 4; d < cs; d += 4) {
        const uint32_t remote = cluster_address(at, d), remote_bar = cluster_address(bar, d);
#pragma unroll
        for (int r = 0; r < kRows; ++r)
          st_async(remote + static_cast<uint32_t>(r * kResidentMaxDim * sizeof(float)), p[r], remote_bar);
      }
    }
    // The step's noise while the partners' partial sums are on their way.
    float z[kUpdates];
#pragma unroll
    for (int m = 0; m < kUpdates; ++m)
      z[m] = updates(m) ? step_noise(a, k, min(row0 + u_row[m], a.batch - 1), u_col) : 0.f;
    wait_for(2 + pb);
    // The step, the same on every CTA. Every warp has read x for this step
    // (its layer 0 came before the barrier above).
#pragma unroll
    for (int m = 0; m < kUpdates; ++m) {
      if (!updates(m)) continue;
      const int r = u_row[m], row = row0 + r;
      float eps = 0.f;
      for (int src = 0; src < cs; ++src) eps += sh.partial[pb][src][r][u_col];
      const auto coef = [&](int q) { return sh.coef[k & 1][q][r]; };
      const float next = step_update(a, coef, sh.x[r][u_col], eps + u_bias, &sh.x0_prev[r][u_col], z[m], u_col);
      sh.x[r][u_col] = next;
      // Every CTA holds the result; they share the writing by row.
      if (row < a.batch && row % cs == rank) store_sample(a, k + 1, row, u_col, next, u_valid[m]);
    }
    s_step_bias = s_next_step_bias;
    // sh.coef[(k + 1) & 1] was last read by step k - 1's update, before the
    // barrier that ended it; the barrier below publishes it.
    if (k + 1 < a.num_steps) publish_coefficients(k + 1);
    __syncthreads();
  }
  // Nothing is in flight towards this CTA at its exit: it has waited for
  // every phase sent to it.
#else
  __trap();
#endif
}

}  // namespace cuda_kernels
}  // namespace ddpm_ops
