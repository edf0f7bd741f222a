// The bf16 tensor-core kernel of ddpm::fused_sample (precision "bf16",
// Hopper's wgmma; compiled only for sm_90a, see setup.py).
//
// bf16_wgmma_kernel<H>: every CTA copies the whole net into shared memory
// once, as bf16 in the 128-byte-swizzled K-major layout that wgmma reads its
// B operand from, and then each of its two warpgroups carries 64-row tiles
// through all steps with every activation in registers:
//   - a layer is H / 64 independent m64n64k16 wgmma chains, interleaved so
//     that the tensor cores overlap them, with the A operand (the layer's
//     input) taken from registers;
//   - the accumulator layout of m64nN is, pair for pair, the A-fragment
//     layout of the next layer's m64k16 (as FlashAttention-3 does with P), so
//     bias, SiLU and the bf16 rounding turn one layer's accumulators into the
//     next one's operand with no shuffle and no shared-memory round trip;
//   - x stays in fp32 (in shared memory, so that the products have the
//     registers), the time input is a rank-1 term in layer 0's epilogue, and
//     the DDPM update runs in fp32: the products see bf16 operands.
// Nothing is exchanged between threads after the weights are staged, so the
// two warpgroups of an SM overlap one's epilogue with the other's products.
// A lone warpgroup (one tile per SM: batch up to 64 x SMs) has one warp per
// scheduler to issue its epilogue: at small batch the exact fp32_smem kernel is
// faster (the rule: csrc/plan/plan.cpp).
// Shape envelope (host: bf16_wgmma_shape, csrc/plan): at least 2 layers, dim <= 64 (padded
// to 64), hidden widths <= H (padded with zero weights, which is exact), and
// the bf16 net within the shared memory (seed shape: 192 KB).
#pragma once

#include "../common/rows.cuh"
#include "../common/wgmma.cuh"
#include "../../plan/shapes/bf16_wgmma.h"

namespace ddpm_ops {
namespace cuda_kernels {

// The shape the plan chooses for this kernel (csrc/plan/shapes/bf16_wgmma.h).
using shapes::Bf16WgmmaLayout;
using shapes::kBf16Threads;
using shapes::kBf16Warpgroups;
using shapes::kWgmmaCols;
using shapes::kWgmmaDimPad;
using shapes::kWgmmaRows;

// Issues acc[j] += in (kDepth / 16 k-blocks of A fragments) times columns
// [64 j, 64 (j + 1)) of the layer whose weights start at `weights` (`rows`
// weight rows, swizzled blocks of 64 deep), for j < kChains. The chains are
// independent and interleaved: a single n64 chain is latency-bound.
template <int kDepth, int kChains>
__device__ __forceinline__ void issue_layer(float (&acc)[kChains][32], const uint32_t* in, uint32_t weights,
                                            int rows) {
  wgmma_fence();
#pragma unroll
  for (int kb = 0; kb < kDepth / 16; ++kb) {
#pragma unroll
    for (int j = 0; j < kChains; ++j) {
      const uint32_t at = weights + (kb / 4) * rows * 128 + j * kWgmmaCols * 128 + (kb % 4) * 32;
      wgmma_m64n64k16(acc[j], in + 4 * kb, wgmma_descriptor(at), 1);
    }
  }
  wgmma_commit();
  wgmma_wait_all();
#pragma unroll
  for (int j = 0; j < kChains; ++j) fence_accumulators(acc[j]);
}

// A layer's bias and, for layer 0, its time column (shared memory, zero past
// the layer's width).
struct LayerBias {
  const float* bias;
  const __nv_bfloat162* time_weight;  // layer 0's, in column pairs; null elsewhere
};

// acc[j] <- the bias term of columns [64 j, 64 (j + 1)): the products then
// accumulate onto it, so no register holds it across them. tn: the time
// input of the thread's two rows.
template <int kChains>
__device__ __forceinline__ void start_layer(float (&acc)[kChains][32], const LayerBias& b, const float* tn, int q) {
#pragma unroll
  for (int j = 0; j < kChains; ++j) {
#pragma unroll
    for (int i = 0; i < 32; i += 2) {
      const int col = j * kWgmmaCols + acc_col(i, q);  // even: a column pair
      float2 v = *reinterpret_cast<const float2*>(b.bias + col);
      if (b.time_weight != nullptr) {
        const float2 w = __bfloat1622float2(b.time_weight[col / 2]);
        const float t = tn[(i >> 1) & 1];
        v = make_float2(fmaf(t, w.x, v.x), fmaf(t, w.y, v.y));
      }
      acc[j][i] = v.x;
      acc[j][i + 1] = v.y;
    }
  }
}

// A hidden layer (kDepth deep, kH wide): out (the next layer's A fragments)
// <- bf16(silu(in W^T + b [+ time w_t])).
template <int kH, int kDepth>
__device__ __forceinline__ void hidden_layer(uint32_t (&out)[kH / 4], const uint32_t* in, uint32_t weights,
                                             const LayerBias& bias, const float* tn, int q) {
  constexpr int kChains = kH / kWgmmaCols;
  float acc[kChains][32];
  start_layer<kChains>(acc, bias, tn, q);
  issue_layer<kDepth, kChains>(acc, in, weights, kH);
#pragma unroll
  for (int j = 0; j < kChains; ++j) {
#pragma unroll
    for (int i = 0; i < 32; i += 2) out[16 * j + i / 2] = pack_bf16(silu_approx(acc[j][i]), silu_approx(acc[j][i + 1]));
  }
}

// Copies the net into shared memory: bf16 weights in wgmma's layout (layer
// 0's time column apart), fp32 biases, zeros wherever the padding reaches.
__device__ __forceinline__ void stage_net(const SampleArgs& a, const Bf16WgmmaLayout& lay, char* smem) {
  const int L = a.num_layers;
  for (int l = 0; l < L; ++l) {
    const LayerArgs& la = a.layers[l];
    const int rows = lay.rows(l), groups_per_row = lay.depth(l) / 8;
    const int used = l == 0 ? a.dim : la.in;  // layer 0's last column (time) has its own place
    char* base = smem + lay.weight_offset(l);
    // kStageBatch 16-byte stores (8 deep each) per thread at a time, with all
    // their loads in flight first: staging is a chain of load latencies.
    constexpr int kStageBatch = 4;
    const int groups = rows * groups_per_row;
    for (int i0 = threadIdx.x; i0 < groups; i0 += kStageBatch * kBf16Threads) {
      float v[kStageBatch][8];
#pragma unroll
      for (int b = 0; b < kStageBatch; ++b) {
        const int i = i0 + b * kBf16Threads, n = i / groups_per_row, k0 = 8 * (i - n * groups_per_row);
        const float* w = la.weight + static_cast<size_t>(n) * la.in + k0;
#pragma unroll
        for (int e = 0; e < 8; ++e) v[b][e] = i < groups && n < la.out && k0 + e < used ? __ldg(w + e) : 0.f;
      }
#pragma unroll
      for (int b = 0; b < kStageBatch; ++b) {
        const int i = i0 + b * kBf16Threads, n = i / groups_per_row, k8 = i - n * groups_per_row;
        if (i >= groups) break;
        // The 16-byte chunks of a 128-byte row are permuted by the row's
        // index within its 8-row group.
        const int block = k8 / 8, chunk = k8 % 8;
        *reinterpret_cast<uint4*>(base + block * rows * 128 + n * 128 + ((chunk ^ (n & 7)) * 16)) =
            make_uint4(pack_bf16(v[b][0], v[b][1]), pack_bf16(v[b][2], v[b][3]), pack_bf16(v[b][4], v[b][5]),
                       pack_bf16(v[b][6], v[b][7]));
      }
    }
    float* bias = reinterpret_cast<float*>(smem + lay.bias_offset()) + l * lay.h;
    for (int n = threadIdx.x; n < lay.rows(l); n += kBf16Threads) bias[n] = n < la.out ? __ldg(la.bias + n) : 0.f;
  }
  __nv_bfloat16* time_weight = reinterpret_cast<__nv_bfloat16*>(smem + lay.time_weight_offset());
  const LayerArgs& first = a.layers[0];
  for (int n = threadIdx.x; n < lay.h; n += kBf16Threads) {
    time_weight[n] = __float2bfloat16_rn(n < first.out ? __ldg(first.weight + static_cast<size_t>(n) * first.in + a.dim)
                                                       : 0.f);
  }
}

// All steps for the 64-row tile at row0 on this warpgroup; x_tile is its
// shared x (the thread's element i in float4 i / 4, thread-minor: no bank
// conflicts), kept out of registers so that the products can have them.
template <int kH>
__device__ __forceinline__ void run_bf16_tile(const SampleArgs& a, const Bf16WgmmaLayout& lay, const char* smem,
                                               float4* x_tile, int row0) {
  const uint32_t weights = smem_address(smem);
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4, tid = threadIdx.x % 128;
  const int g = lane / 4, q = lane % 4;
  const int L = a.num_layers, dim = a.dim;
  auto bias_of = [&](int l) {
    return LayerBias{reinterpret_cast<const float*>(smem + lay.bias_offset()) + l * kH,
                     l == 0 ? reinterpret_cast<const __nv_bfloat162*>(smem + lay.time_weight_offset()) : nullptr};
  };

  const int my_row0 = row0 + 16 * warp + g;
  int t[2];
  load_row_pair(a, my_row0, t);
  auto x_at = [&](int i) {
    const int r = my_row0 + 8 * ((i >> 1) & 1), col = acc_col(i, q);
    return r < a.batch && col < dim ? __ldg(a.x + static_cast<size_t>(r) * dim + col) : 0.f;
  };
#pragma unroll
  for (int v = 0; v < 8; ++v) x_tile[v * 128 + tid] = make_float4(x_at(4 * v), x_at(4 * v + 1), x_at(4 * v + 2), x_at(4 * v + 3));

  for (int k = 0; k < a.num_steps; ++k) {
    const StepCoefficients coef(a, t, k);
    const float c1[2] = {coef.c1[0], coef.c1[1]}, c2[2] = {coef.c2[0], coef.c2[1]};
    const float tn[2] = {coef.tn[0], coef.tn[1]};
    uint32_t x_frag[kWgmmaDimPad / 4];
#pragma unroll
    for (int v = 0; v < 8; ++v) {
      const float4 x = x_tile[v * 128 + tid];
      x_frag[2 * v] = pack_bf16(x.x, x.y);
      x_frag[2 * v + 1] = pack_bf16(x.z, x.w);
    }
    uint32_t act[kH / 4];
    hidden_layer<kH, kWgmmaDimPad>(act, x_frag, weights, bias_of(0), tn, q);
    for (int l = 1; l + 1 < L; ++l) {
      uint32_t next[kH / 4];
      hidden_layer<kH, kH>(next, act, weights + lay.weight_offset(l), bias_of(l), tn, q);
#pragma unroll
      for (int i = 0; i < kH / 4; ++i) act[i] = next[i];
    }
    float eps[1][32];
    start_layer<1>(eps, bias_of(L - 1), tn, q);
    issue_layer<kH, 1>(eps, act, weights + lay.weight_offset(L - 1), kWgmmaDimPad);
#pragma unroll
    for (int v = 0; v < 8; ++v) {
      float4 x = x_tile[v * 128 + tid];
      // (elements 4v, 4v + 1 are in the thread's first row, 4v + 2, 4v + 3 in its second)
      x.x = c1[0] * (x.x - c2[0] * eps[0][4 * v]);
      x.y = c1[0] * (x.y - c2[0] * eps[0][4 * v + 1]);
      x.z = c1[1] * (x.z - c2[1] * eps[0][4 * v + 2]);
      x.w = c1[1] * (x.w - c2[1] * eps[0][4 * v + 3]);
      x_tile[v * 128 + tid] = x;
    }
  }

  const float nan = __int_as_float(0x7fc00000);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = my_row0 + 8 * h;
    if (r >= a.batch) continue;
    bool valid;  // read again: flags held across the steps would take registers the products need
    load_t_start(a, r, &valid);
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int col = acc_col(i, q);
      const float x = reinterpret_cast<const float*>(&x_tile[(i / 4) * 128 + tid])[i % 4];
      if (((i >> 1) & 1) == h && col < dim) a.out[static_cast<size_t>(r) * dim + col] = valid ? x : nan;
    }
  }
}

// Grid: one CTA per SM at most; tile i goes to warpgroup i / gridDim.x (mod
// 2) of CTA i % gridDim.x, so that up to one tile per SM no SM runs two.
template <int kH>
__global__ void __launch_bounds__(kBf16Threads, 1) bf16_wgmma_kernel(const __grid_constant__ SampleArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const Bf16WgmmaLayout lay{kH, a.num_layers};
  char* smem = aligned_shared_memory(lay);
  stage_net(a, lay, smem);
  fence_proxy_async();  // the generic-proxy stores above, before wgmma reads them
  __syncthreads();
  const int tiles = (a.batch + kWgmmaRows - 1) / kWgmmaRows;
  // Warp-uniform as far as the compiler can tell (a plain threadIdx.x / 128
  // makes the tile loop divergent to it, and it then serialises the wgmmas).
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  float4* x_tile = reinterpret_cast<float4*>(smem + lay.x_offset()) + wg * (kWgmmaRows * kWgmmaDimPad / 4);
  for (int tile = blockIdx.x + wg * gridDim.x; tile < tiles; tile += kBf16Warpgroups * gridDim.x) {
    run_bf16_tile<kH>(a, lay, smem, x_tile, tile * kWgmmaRows);
  }
#endif
}

}  // namespace cuda_kernels
}  // namespace ddpm_ops
