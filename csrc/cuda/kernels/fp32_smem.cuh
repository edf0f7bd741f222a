// The fp32_smem kernel of ddpm::fused_sample (small and medium batch, exact
// fp32 on CUDA cores, every weight slice in shared memory).
//
// fp32_smem_kernel: a thread-block cluster of up to 16 CTAs runs a tile of
// rows through all steps. CTA r owns a slice of every layer's output neurons
// and keeps that slice of the weights in shared memory for the whole call.
// Each warp reduces its outputs with a transposing shuffle butterfly and
// stores them straight into every CTA's shared memory with st.async, which
// completes on the receiver's mbarrier; a CTA waits only for the bytes it
// needs, so there is no cluster-wide barrier per layer, nor a CTA barrier.
// The latency of a layer is one split-K dot product per lane, 5 levels of
// shuffles and one one-way trip through distributed shared memory.
#pragma once

#include "../common/ptx.cuh"
#include "../common/rows.cuh"
#include "../common/warp_reduce.cuh"
#include "../../plan/shapes/fp32_smem.h"

#include <cooperative_groups.h>

namespace ddpm_ops {
namespace cuda_kernels {

// The shape the plan chooses for this kernel (csrc/plan/shapes/fp32_smem.h).
using shapes::LayerWork;
using shapes::SmemPlan;
using shapes::kEps0;
using shapes::kExchangeBuffers;
using shapes::kHidden0;
using shapes::kSmemThreads;
using shapes::kSmemWarps;
using shapes::smem_widest_vc_log2;

namespace cg = cooperative_groups;

__device__ __forceinline__ int divide(int n, int d, uint32_t magic) {
  return d == 1 ? n : static_cast<int>(__umulhi(static_cast<uint32_t>(n), magic));
}

// Where a layer's outputs go: column n0 onwards of the rows of `out` (this
// CTA's shared memory, row stride ld). With a barrier (`bar` != 0) every
// output is sent to that place in all `cs` CTAs of the cluster, this one
// included, by st.async completing on their mbarrier `bar`; without one it
// is stored here only (the caller synchronizes the CTA).
struct LayerSink {
  uint32_t out;  // smem_address of column n0 of row 0
  int ld;
  uint32_t bar;
  int cs;
};

// One layer's slice on one CTA: out[r][c] = act(bias[c] + in[r] . w[c]) for
// rows r < rows, slice columns c < ns. Each warp takes tiles of VR rows x VC
// columns; its 32 lanes split the inner dimension (float4 along k when kVec)
// and then reduce the tile's VR * VC sums with a transposing butterfly: each
// exchange level halves the values a lane holds, so the whole tile costs
// V - 1 + log2(32 / V) shuffles, and lane l ends with output l / (32 / V),
// replicated on 32 / V lanes, which share its stores into the cluster. No
// CTA barrier: a warp sends its tile as soon as it is reduced.
// kVec: weight rows of stride round_up4(K), read as float4 along k: the
// padded copy in shared memory, or global weights when K % 4 == 0 and they
// are 16-byte aligned (a generic pointer serves both); otherwise scalar reads
// of the global weights (row stride K). kL2: the weights come from L2, whose
// latency wants many loads in flight (several inner iterations at once);
// shared memory needs few.
template <int VR, int VC, bool kVec, bool kL2>
__device__ __forceinline__ void smem_layer(const LayerWork& sp, const float* in, int in_ld, const float* w,
                                              const float* bias, int K, int rows, int ns, bool apply_silu,
                                              const LayerSink& sink) {
  constexpr int V = VR * VC;
  static_assert(V >= 2 && V <= 32 && (V & (V - 1)) == 0, "a tile is a power of two of at most 32 outputs");
  constexpr int kReplicas = 32 / V;
  constexpr int kUnroll = !kL2 ? 2 : (V >= 16 ? 2 : (V >= 8 ? 4 : 8));
  const int steps_k = kVec ? round_up4(K) >> 2 : K;
  const int w_ld = kVec ? round_up4(K) : K;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  for (int tile = warp; tile < sp.ntiles; tile += kSmemWarps) {  // warp-uniform
    const int tr = divide(tile, sp.tiles_c, sp.tiles_c_magic);
    const int tc = tile - tr * sp.tiles_c;
    const float* a_row[VR];
    const float* w_row[VC];
#pragma unroll
    for (int i = 0; i < VR; ++i) a_row[i] = in + min(tr * VR + i, rows - 1) * in_ld;
#pragma unroll
    for (int j = 0; j < VC; ++j) w_row[j] = w + min(tc * VC + j, ns - 1) * w_ld;
    float v[V];
#pragma unroll
    for (int e = 0; e < V; ++e) v[e] = 0.f;
#pragma unroll kUnroll
    for (int k = lane; k < steps_k; k += 32) {
      if (kVec) {
        float4 a4[VR];
#pragma unroll
        for (int i = 0; i < VR; ++i) a4[i] = reinterpret_cast<const float4*>(a_row[i])[k];
#pragma unroll
        for (int j = 0; j < VC; ++j) {
          const float4 b4 = reinterpret_cast<const float4*>(w_row[j])[k];
#pragma unroll
          for (int i = 0; i < VR; ++i) {
            float& acc = v[i * VC + j];
            acc = fmaf(a4[i].x, b4.x, acc);
            acc = fmaf(a4[i].y, b4.y, acc);
            acc = fmaf(a4[i].z, b4.z, acc);
            acc = fmaf(a4[i].w, b4.w, acc);
          }
        }
      } else {
        float a1[VR];
#pragma unroll
        for (int i = 0; i < VR; ++i) a1[i] = a_row[i][k];
#pragma unroll
        for (int j = 0; j < VC; ++j) {
          const float b1 = __ldg(w_row[j] + k);
#pragma unroll
          for (int i = 0; i < VR; ++i) v[i * VC + j] = fmaf(a1[i], b1, v[i * VC + j]);
        }
      }
    }
    reduce_transposing<V, V>(v, lane);
#pragma unroll
    for (int o = kReplicas / 2; o > 0; o >>= 1) v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
    const int e = lane / kReplicas;
    const int replica = lane % kReplicas;
    const int r = tr * VR + e / VC;
    const int c = tc * VC + e % VC;
    if (r >= rows || c >= ns) continue;
    float out = v[0] + bias[c];
    if (apply_silu) out = silu(out);
    const uint32_t at = sink.out + static_cast<uint32_t>(r * sink.ld + c) * sizeof(float);
    if (sink.bar == 0) {
      if (replica == 0) *static_cast<float*>(__cvta_shared_to_generic(at)) = out;
      continue;
    }
    for (int d = replica; d < sink.cs; d += kReplicas)
      st_async(cluster_address(at, d), out, cluster_address(sink.bar, d));
  }
}

// smem_layer with the column tile the host chose for this layer.
template <int VR, bool kVec, bool kL2>
__device__ __forceinline__ void smem_layer_tiled(const LayerWork& sp, const float* in, int in_ld,
                                                    const float* w, const float* bias, int K, int rows, int ns,
                                                    bool apply_silu, const LayerSink& sink) {
  constexpr int kWidest = 1 << smem_widest_vc_log2(VR);
  switch (sp.vc_log2) {
    case 1: return smem_layer<VR, 2, kVec, kL2>(sp, in, in_ld, w, bias, K, rows, ns, apply_silu, sink);
    case 2: return smem_layer<VR, 4, kVec, kL2>(sp, in, in_ld, w, bias, K, rows, ns, apply_silu, sink);
    case 3: return smem_layer<VR, 8, kVec, kL2>(sp, in, in_ld, w, bias, K, rows, ns, apply_silu, sink);
    default: return smem_layer<VR, kWidest, kVec, kL2>(sp, in, in_ld, w, bias, K, rows, ns, apply_silu, sink);
  }
}

// dst[r * ld + k] = src[r * width + k] for r < rows, k < width; zero for
// width <= k < ld, as asynchronous copies that all go in flight at once (16
// bytes each where the layout allows). The caller waits for them.
__device__ __forceinline__ void stage_padded_rows(float* dst, const float* src, int rows, int width,
                                                  int ld) {
  if (width == ld && width % 4 == 0 && (reinterpret_cast<uintptr_t>(src) & 15) == 0) {
    for (int i = threadIdx.x; i < rows * width / 4; i += kSmemThreads)
      cp_async16(dst + 4 * i, src + 4 * i, true);
    return;
  }
  for (int i = threadIdx.x; i < rows * ld; i += kSmemThreads) {
    const int r = i / ld, k = i - r * ld;
    const bool inside = k < width;
    cp_async4(dst + i, inside ? src + r * width + k : src, inside);
  }
}

// This CTA's weight slices: rows [n0, n0 + ns) of each layer, copied once
// with rows padded to a multiple of 4 by zeros, and their biases (and the
// whole last layer where every CTA computes it); the caller commits and waits.
__device__ __forceinline__ void stage_weight_slices(const SampleArgs& a, const SmemPlan& p, int rank, float* smem) {
  const int L = a.num_layers;
  for (int l = 0; l < L; ++l) {
    if (p.weight_offset[l] < 0) continue;
    const LayerArgs& la = a.layers[l];
    const int s = p.work[l].cols;
    const int n0 = rank * s;
    const int ns = max(0, min(s, la.out - n0));
    stage_padded_rows(smem + p.weight_offset[l], la.weight + static_cast<size_t>(n0) * la.in, ns,
                      la.in, round_up4(la.in));
    stage_padded_rows(smem + p.bias_offset[l], la.bias + n0, 1, ns, ns);
  }
  if (p.last_weight_offset >= 0) {
    const LayerArgs& la = a.layers[L - 1];
    stage_padded_rows(smem + p.last_weight_offset, la.weight, la.out, la.in, round_up4(la.in));
    stage_padded_rows(smem + p.last_bias_offset, la.bias, 1, la.out, la.out);
  }
}

// VR: the rows of a warp's output tile (1, 2 or 4; the host picks it from the
// rows per cluster).
template <int VR>
__global__ void __launch_bounds__(kSmemThreads, 1)
    fp32_smem_kernel(const __grid_constant__ SampleArgs a, const __grid_constant__ SmemPlan p) {
#if DDPM_OPS_HOPPER_CODE
  cg::cluster_group cluster = cg::this_cluster();
  extern __shared__ float4 smem_f4[];
  float* smem = reinterpret_cast<float*>(smem_f4);
  const int cs = p.cluster_size;
  const int rank = static_cast<int>(cluster.block_rank());
  const int row0 = static_cast<int>(blockIdx.x / cs) * p.rows_per_tile;
  const int rows = min(p.rows_per_tile, a.batch - row0);
  const int dim = a.dim;
  const int L = a.num_layers;
  const int in0_ld = p.in0_ld;
  float* in0 = smem + p.in0_offset;
  float* xcur = smem + p.x_offset;
  float* coef = smem + p.coef_offset;
  int* t0 = reinterpret_cast<int*>(smem + p.t_offset);
  int* valid = reinterpret_cast<int*>(smem + p.valid_offset);
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + p.barrier_offset);

  stage_weight_slices(a, p, rank, smem);
  cp_async_commit();
  // Zero the layer inputs: float4 reads cover the padding columns, which
  // must hold finite values (the weights there are zero).
  for (int i = threadIdx.x; i < p.hidden_offset[1] + p.rows_per_tile * p.hidden_ld - p.in0_offset;
       i += kSmemThreads)
    in0[i] = 0.f;
  if (threadIdx.x == 0) {
    // One arrival per phase, this CTA's own (exchange below); the senders'
    // bytes complete it.
    for (int b = 0; b < kExchangeBuffers; ++b) mbarrier_init(bars + b, 1);
    fence_mbarrier_init();
  }
  __syncthreads();
  for (int r = threadIdx.x; r < rows; r += kSmemThreads) {
    bool ok;
    t0[r] = load_t_start(a, row0 + r, &ok);
    valid[r] = ok;
    in0[r * in0_ld + dim] = static_cast<float>(t0[r]) / a.total_timesteps;
  }
  for (int i = threadIdx.x; i < rows * dim; i += kSmemThreads) {
    const int r = i / dim, j = i - r * dim;
    const float v = __ldg(a.x + static_cast<size_t>(row0) * dim + i);
    xcur[i] = v;
    in0[r * in0_ld + j] = v;
  }
  CoefPrefetch coefs(a, t0, rows);
  cp_async_wait<0>();
  // Every CTA of the cluster must be running, with its mbarriers initialized,
  // before anyone sends to it; this also publishes the local setup.
  cluster.sync();

  uint32_t parity = 0;  // bit b: parity of the next phase of bars[b] to complete
  auto wait_for = [&](int b) {
    mbarrier_wait(bars + b, (parity >> b) & 1u);
    parity ^= 1u << b;
  };
  const bool replicated = p.last_weight_offset >= 0;
  for (int k = 0; k < a.num_steps; ++k) {
    coefs.publish(a, t0, coef, k);  // read in the update, past a CTA barrier
    const float* in = in0;
    int in_ld = in0_ld;
    int in_buffer = -1;  // exchanged buffer `in` arrives in, or -1: local
    float* eps = smem + p.eps_offset[replicated ? 0 : k & 1];
    for (int l = 0; l < L; ++l) {
      if (in_buffer >= 0) wait_for(in_buffer);
      const LayerArgs& la = a.layers[l];
      const bool last = l + 1 == L;
      if (last && replicated) {
        // The whole last layer on every CTA: saves one exchange a step.
        const LayerSink sink = {smem_address(eps), p.eps_ld, 0u, 1};
        smem_layer_tiled<VR, true, false>(p.last_work, in, in_ld, smem + p.last_weight_offset,
                                             smem + p.last_bias_offset, la.in, rows, la.out, false, sink);
        in_buffer = -1;
        break;
      }
      const LayerWork& sp = p.work[l];
      const int n0 = rank * sp.cols;
      const int ns = max(0, min(sp.cols, la.out - n0));
      // Hidden outputs alternate between two buffers across layers and steps.
      const int hidden = (k * (L - 1) + l) & 1;
      const int out_buffer = last ? kEps0 + (k & 1) : kHidden0 + hidden;
      float* out = last ? eps : smem + p.hidden_offset[hidden];
      const int out_ld = last ? p.eps_ld : p.hidden_ld;
      // The exchange. Every CTA sends each of its outputs to every CTA (itself
      // included) with st.async, completing on the receiver's barrier for
      // out_buffer, whose one arrival per phase is its own: the announcement
      // of all the phase's bytes, made here, before or after some of them
      // land (the transaction count may dip below zero meanwhile). Its
      // previous phase has completed: this CTA waited for it before the
      // layer that read it (the previous layer, or the layer before the last
      // layer of the previous step), so no byte of a later phase arrives
      // early either: a sender starts on this layer only once it holds this
      // CTA's outputs of the previous layer. The same chain makes the writes
      // safe: a buffer is overwritten only after its owner has sent the
      // outputs of the layer that read it, and a warp sends only after its
      // reads (no fence: nothing here lives in global memory).
      if (threadIdx.x == 0)
        mbarrier_expect_local(smem_address(bars + out_buffer),
                              static_cast<uint32_t>(rows * la.out * sizeof(float)));
      const LayerSink sink = {smem_address(out + n0), out_ld, smem_address(bars + out_buffer), cs};
      const float* w_global = la.weight + static_cast<size_t>(n0) * la.in;
      if (p.weight_offset[l] >= 0) {
        smem_layer_tiled<VR, true, false>(sp, in, in_ld, smem + p.weight_offset[l], smem + p.bias_offset[l],
                                             la.in, rows, ns, !last, sink);
      } else if (la.in % 4 == 0 && (reinterpret_cast<uintptr_t>(la.weight) & 15) == 0) {
        smem_layer_tiled<VR, true, true>(sp, in, in_ld, w_global, la.bias + n0, la.in, rows, ns, !last,
                                            sink);
      } else {
        smem_layer_tiled<VR, false, true>(sp, in, in_ld, w_global, la.bias + n0, la.in, rows, ns, !last,
                                             sink);
      }
      in = out;
      in_ld = out_ld;
      in_buffer = out_buffer;
    }
    if (in_buffer >= 0) wait_for(in_buffer);  // the sliced last layer's outputs
    // The replicated last layer's outputs, and this step's coefficients: the
    // layers have no CTA barrier of their own.
    __syncthreads();
    // x <- c1 * (x - c2 * eps), redundantly on every CTA (cheaper than another
    // exchange), and the next step's layer-0 input.
    for (int i = threadIdx.x; i < rows * dim; i += kSmemThreads) {
      const int r = i / dim, j = i - r * dim;
      const float v = coef[2 * r] * (xcur[i] - coef[2 * r + 1] * eps[r * p.eps_ld + j]);
      xcur[i] = v;
      in0[r * in0_ld + j] = v;
    }
    for (int r = threadIdx.x; r < rows; r += kSmemThreads)
      in0[r * in0_ld + dim] = static_cast<float>(t0[r] - (k + 1)) / a.total_timesteps;
    __syncthreads();
  }

  // Every CTA holds the result; they share the writing by row. Nothing is in
  // flight towards this CTA: it has waited for every phase sent to it.
  for (int r = rank; r < rows; r += cs) {
    float* dst = a.out + static_cast<size_t>(row0 + r) * dim;
    const float nan = __int_as_float(0x7fc00000);
    for (int j = threadIdx.x; j < dim; j += kSmemThreads)
      dst[j] = valid[r] ? xcur[r * dim + j] : nan;
  }
#else
  __trap();
#endif
}

}  // namespace cuda_kernels
}  // namespace ddpm_ops
