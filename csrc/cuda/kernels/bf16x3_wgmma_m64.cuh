// The exact fp32 tensor-core kernel of ddpm::fused_sample (from batch 265 in
// every precision, "bf16" excepted where its own kernel runs; Hopper's wgmma,
// compiled only for sm_90a).
//
// bf16x3_wgmma_m64_kernel<kOwn, kCs, kBuffers>: the bf16_wgmma kernel's design (bf16_wgmma.cuh:
// 64-row tiles carried through all steps with every activation in registers)
// at fp32 accuracy. Every operand v is held as two bf16 numbers, big =
// bf16(v) and small = bf16(v - big), and every product as three wgmmas:
// big*big + small*big + big*small, accumulated in fp32. That leaves about
// 2^-16 of each operand and the small*small term out, which the fp32
// accumulation of 256-term sums and the fp32 update of x already exceed
// (measured: the same error against float64 as the fp32 kernels, 1.5e-7 at
// the seed shape). SiLU is the bf16_wgmma kernel's ex2.approx / rcp.approx form: a
// few ulp, like the fp32_smem kernel's expf and fast division.
//
// Both planes of the seed shape's weights take 384 KB, more than an SM holds,
// so a cluster of kCs = 2 or 4 CTAs shares each tile (kCs = 1 where the
// whole net fits one CTA; 4 while the tiles fit one wave of clusters of 4:
// each CTA then has half the work of a step). CTA r keeps, big and small:
//   - columns [r kOwn, (r + 1) kOwn) of every hidden layer (kOwn = H / kCs),
//     with the layer's inner dimension permuted in blocks of kOwn: block b
//     holds CTA r ^ b's columns, so its own come first. After a hidden layer
//     a thread holds its block of the next layer's A fragments, and the
//     partner threads (same index, CTAs r ^ p) hold blocks p, in the same
//     registers, so the exchange is thread to thread (st.async into each
//     partner's buffer, completing on its mbarrier; no shuffle, no layout
//     change);
//   - the inner block [r kOwn, (r + 1) kOwn) of the output layer, all of its
//     columns: each CTA computes a partial eps from its own block of the last
//     hidden layer, which therefore is never exchanged. In a cluster of 2
//     the CTAs swap their partial sums and add them (commutative in fp32:
//     both get the same eps bit for bit); in a cluster of 4, where that
//     would send each partial to 3 partners, CTA c sums the partials of
//     eps's columns [16 c, 16 (c + 1)) only and sends the sums to the
//     others (a reduce-scatter and an all-gather: half the bytes, which
//     bound a step there). For that, CTA r holds x, eps and layer 0's
//     inner dimension with their blocks of 16 columns permuted, block b
//     holding columns 16 (b ^ r) on, so that the block it sums is block 0
//     and the block of partner r ^ p is block p, whatever r.
//   So every CTA keeps the whole x in registers and updates it identically;
//   a step exchanges the outputs of the hidden layers but the last, and eps.
// A layer first issues the products of its own block of the inner
// dimension, then waits for the partners' blocks, so the exchange overlaps
// the tensor cores. A CTA's buffer has one slot per partner (slot p - 1 holds
// CTA r ^ p's data). With kBuffers = 2 (where they fit) exchanges use the
// two in turn and the data dependencies keep a send from overwriting data
// not yet read; with one, the split cluster barrier does (ClusterLink).
// Shape envelope (host: bf16x3_wgmma_m64_shape, csrc/plan): the bf16_wgmma kernel's (dim <= 64, hidden
// widths <= 256, at least 2 layers) and both planes of the CTA's share, plus
// the exchange buffer, within the shared memory (seed shape: 226 KB in
// clusters of 2; in clusters of 4 145 KB, 193 KB with two exchange buffers).
#pragma once

#include "../common/bf16x3.cuh"
#include "../common/rows.cuh"

#include <cooperative_groups.h>

namespace ddpm_ops {
namespace cuda_kernels {

// The shape the plan chooses for this kernel (csrc/plan/shapes/bf16x3.h, wgmma.h).
using shapes::Bf16x3Layout;
using shapes::kBf16x3Threads;
using shapes::kWgmmaCols;
using shapes::kWgmmaDimPad;
using shapes::kWgmmaRows;

namespace cg = cooperative_groups;

// acc[j * kKChains + kb % kKChains] += (big, small) fragments kb in [kKb0, kKb1)
// times the weights' columns [64 j, 64 (j + 1)), three products each. The
// weights' planes start at w_big and w_small (`rows` rows, swizzled blocks
// of 64 deep). kKChains > 1 spreads one chain's products over independent
// accumulators, which the caller adds.
template <int kChains, int kKChains, int kKb0, int kKb1>
__device__ __forceinline__ void issue_m64_products(float (&acc)[kChains * kKChains][32], const uint32_t* big,
                                                     const uint32_t* small, uint32_t w_big, uint32_t w_small,
                                                     int rows) {
  wgmma_fence();
  // (No operand is chosen by a conditional: selecting between two register
  // arrays takes their addresses, which puts them in local memory.)
#pragma unroll
  for (int kb = kKb0; kb < kKb1; ++kb) {
#pragma unroll
    for (int j = 0; j < kChains; ++j) {
      const uint32_t at = (kb / 4) * rows * 128 + j * kWgmmaCols * 128 + (kb % 4) * 32;
      wgmma_m64n64k16(acc[j * kKChains + kb % kKChains], big + 4 * kb, wgmma_descriptor(w_big + at), 1);
    }
#pragma unroll
    for (int j = 0; j < kChains; ++j) {
      const uint32_t at = (kb / 4) * rows * 128 + j * kWgmmaCols * 128 + (kb % 4) * 32;
      wgmma_m64n64k16(acc[j * kKChains + kb % kKChains], small + 4 * kb, wgmma_descriptor(w_big + at), 1);
    }
#pragma unroll
    for (int j = 0; j < kChains; ++j) {
      const uint32_t at = (kb / 4) * rows * 128 + j * kWgmmaCols * 128 + (kb % 4) * 32;
      wgmma_m64n64k16(acc[j * kKChains + kb % kKChains], big + 4 * kb, wgmma_descriptor(w_small + at), 1);
    }
  }
  wgmma_commit();
}

// The thread-to-thread exchange with the partner CTAs r ^ p, p = 1 ..
// kCs - 1: send() puts this thread's words into slot p - 1 of each partner's
// buffer, receive() takes the partners' from this CTA's slots (slot p - 1:
// CTA r ^ p's words). Exchanges alternate send, receive, and exchange n uses
// buffer n % kBuffers (and its mbarrier), so a send must not overwrite the
// data of exchange n - kBuffers before the partner has read it:
//   - kBuffers = 1: the cluster barrier between a receive (arrive: this
//     thread has read the buffer) and the next send (wait: so have the
//     partner threads) orders it;
//   - kBuffers = 2: no barrier within a tile. Send n comes after receive
//     n - 1, which saw the partner's send n - 1 complete, and the partner
//     issued that after its receive n - 2 had read buffer n % 2: the words
//     it sent in n - 1 come from the products of those it read (a load
//     that has returned its value cannot see a later store). Between tiles,
//     where the first send does not depend on the last receive, a cluster
//     barrier orders them (end_tile).
template <int kCs, int kBuffers>
struct ClusterLink {
  static constexpr int kPartners = kCs - 1;
  static constexpr int kWarps = kBf16x3Threads / 32;
  uint4* buffer = nullptr;                 // this CTA's first, thread-minor
  uint64_t* bar = nullptr;                 // this warp's mbarrier of the first buffer in this CTA
  uint32_t remote_buffer[kPartners] = {};  // partner r ^ (p + 1)'s slot p of its first buffer, this thread's first uint4
  uint32_t remote_bar[kPartners] = {};     // partner r ^ (p + 1)'s mbarrier of this warp and the first buffer
  int slot_uint4s = 0;                     // a slot's stride in `buffer`
  int buffer_uint4s = 0;                   // a buffer's
  uint32_t exchanges = 0;

  __device__ void connect(char* smem, const Bf16x3Layout& lay, int rank) {
    const int tid = threadIdx.x, warp = tid / 32;
    buffer = reinterpret_cast<uint4*>(smem + lay.buffer_offset());
    bar = reinterpret_cast<uint64_t*>(smem + lay.barrier_offset()) + warp;
    slot_uint4s = lay.slot_bytes() / 16;
    buffer_uint4s = lay.buffer_bytes() / 16;
#pragma unroll
    for (int p = 0; p < kPartners; ++p) {
      remote_buffer[p] = cluster_address(smem_address(buffer + p * slot_uint4s + tid), rank ^ (p + 1));
      remote_bar[p] = cluster_address(smem_address(bar), rank ^ (p + 1));
    }
  }
  // This warp's mbarriers (one per buffer), to initialize.
  __device__ uint64_t* barrier(int b) const { return bar + b * kWarps; }
  // kWords words to every partner; with kScatter partner r ^ (p + 1) gets
  // words[p * kWords + i] instead.
  template <int kWords, bool kScatter = false>
  __device__ __forceinline__ void send(const uint32_t* words) {
    static_assert(kWords % 4 == 0, "whole uint4s");
    if (kBuffers == 1 && exchanges > 0) cluster_wait();
    const int b = exchanges % kBuffers;
#pragma unroll
    for (int p = 0; p < kPartners; ++p) {
      const uint32_t dst = remote_buffer[p] + 16 * b * buffer_uint4s, dst_bar = remote_bar[p] + 8 * b * kWarps;
      const uint32_t* w = kScatter ? words + p * kWords : words;
#pragma unroll
      for (int v = 0; v < kWords / 4; ++v) {
        st_async(dst + 16 * v * kBf16x3Threads, make_uint4(w[4 * v], w[4 * v + 1], w[4 * v + 2], w[4 * v + 3]),
                 dst_bar);
      }
    }
  }
  // words[p * kWords + i]: word i of partner r ^ (p + 1).
  template <int kWords>
  __device__ __forceinline__ void receive(uint32_t* words) {
    const int b = exchanges % kBuffers;
    // This phase's only arrival announces the warp's bytes; the partners'
    // stores may have landed before it (the count then goes below zero).
    if (threadIdx.x % 32 == 0) mbarrier_expect_local(smem_address(barrier(b)), kPartners * 32 * 4 * kWords);
    mbarrier_wait(barrier(b), (exchanges / kBuffers) & 1u);
    const uint4* in = buffer + b * buffer_uint4s;
#pragma unroll
    for (int p = 0; p < kPartners; ++p) {
#pragma unroll
      for (int v = 0; v < kWords / 4; ++v) {
        const uint4 w = in[p * slot_uint4s + v * kBf16x3Threads + threadIdx.x];
        words[p * kWords + 4 * v] = w.x;
        words[p * kWords + 4 * v + 1] = w.y;
        words[p * kWords + 4 * v + 2] = w.z;
        words[p * kWords + 4 * v + 3] = w.w;
      }
    }
    if (kBuffers == 1) cluster_arrive();
    ++exchanges;
  }
  __device__ __forceinline__ void end_tile() {
    if (kBuffers > 1) {
      cluster_arrive();
      cluster_wait();
    }
  }
  // Before the CTA exits: no partner may still write into it (with two
  // buffers the last end_tile waited for that).
  __device__ __forceinline__ void finish() {
    if (kBuffers == 1) cluster_wait();  // for the last receive's arrival
  }
};

// acc <- layer l's bias over the thread's elements of this CTA's columns (and
// for layer 0 the time term).
template <int kChains>
__device__ __forceinline__ void start_m64_layer(float (*acc)[32], const float* bias,
                                                  const float* time_weight, const float* tn, int q) {
#pragma unroll
  for (int j = 0; j < kChains; ++j) {
#pragma unroll
    for (int i = 0; i < 32; i += 2) {
      const int col = j * kWgmmaCols + acc_col(i, q);
      float2 v = *reinterpret_cast<const float2*>(bias + col);
      if (time_weight != nullptr) {
        const float2 w = *reinterpret_cast<const float2*>(time_weight + col);
        const float t = tn[(i >> 1) & 1];
        v = make_float2(fmaf(t, w.x, v.x), fmaf(t, w.y, v.y));
      }
      acc[j][i] = v.x;
      acc[j][i + 1] = v.y;
    }
  }
}

// big/small <- both planes of silu(acc): this CTA's half of the next layer's
// A fragments.
template <int kChains>
__device__ __forceinline__ void finish_hidden_layer(float (&acc)[kChains][32], uint32_t* big, uint32_t* small) {
#pragma unroll
  for (int j = 0; j < kChains; ++j) {
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[j][i] = silu_approx(acc[j][i]);
    plane_fragments(acc[j], big + 16 * j, small + 16 * j);
  }
}

// All steps for the 64-row tile at row0 (shared by the kCs CTAs of the cluster).
template <int kOwn, int kCs, int kBuffers>
__device__ __forceinline__ void run_m64_tile(const SampleArgs& a, const Bf16x3Layout& lay, const char* smem,
                                               ClusterLink<kCs, kBuffers>& link, int rank, int row0) {
  constexpr int kH = kOwn * kCs;
  constexpr int kChains = kOwn / kWgmmaCols;
  constexpr int kOwnWords = kOwn / 4;  // one plane of this CTA's block of a hidden layer's A fragments
  constexpr int kPartners = kCs - 1;
  const uint32_t base = smem_address(smem);
  const float* bias = reinterpret_cast<const float*>(smem + lay.bias_offset());
  const float* time_weight = reinterpret_cast<const float*>(smem + lay.time_weight_offset());
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, q = lane % 4;
  const int L = a.num_layers, dim = a.dim;
  auto big_plane = [&](int l) { return base + lay.weight_offset(l); };
  auto small_plane = [&](int l) { return base + lay.weight_offset(l) + lay.plane_bytes(l); };

  const int my_row0 = row0 + 16 * warp + g;
  int t[2];
  load_row_pair(a, my_row0, t);
  // The whole x of the thread's rows, in accumulator layout (element i:
  // column x_col(i), blocks permuted where eps is scattered).
  const int col_xor = kScatterEps<kCs> ? kEpsBlock * rank : 0;
  auto x_col = [&](int i) { return acc_col(i, q) ^ col_xor; };
  float x[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const int r = my_row0 + 8 * ((i >> 1) & 1), col = x_col(i);
    x[i] = r < a.batch && col < dim ? __ldg(a.x + static_cast<size_t>(r) * dim + col) : 0.f;
  }

  for (int k = 0; k < a.num_steps; ++k) {
    const StepCoefficients coef(a, t, k);
    const float c1[2] = {coef.c1[0], coef.c1[1]}, c2[2] = {coef.c2[0], coef.c2[1]};
    const float tn[2] = {coef.tn[0], coef.tn[1]};
    // Hidden activations, block p from CTA rank ^ p (both planes).
    uint32_t big[kH / 4], small[kH / 4];
    {
      uint32_t x_big[kWgmmaDimPad / 4], x_small[kWgmmaDimPad / 4];
      plane_fragments(x, x_big, x_small);
      float acc[kChains][32];
      start_m64_layer<kChains>(acc, bias, time_weight, tn, q);
      issue_m64_products<kChains, 1, 0, kWgmmaDimPad / 16>(acc, x_big, x_small, big_plane(0), small_plane(0),
                                                             kOwn);
      wait_products(acc);
      finish_hidden_layer<kChains>(acc, big, small);
    }
    for (int l = 1; l + 1 < L; ++l) {
      if constexpr (kCs > 1) {
        uint32_t words[2 * kOwnWords];
#pragma unroll
        for (int i = 0; i < kOwnWords; ++i) {
          words[i] = big[i];
          words[kOwnWords + i] = small[i];
        }
        link.send<2 * kOwnWords>(words);
      }
      float acc[kChains][32];
      start_m64_layer<kChains>(acc, bias + l * kOwn, nullptr, tn, q);
      issue_m64_products<kChains, 1, 0, kOwn / 16>(acc, big, small, big_plane(l), small_plane(l), kOwn);
      if constexpr (kCs > 1) {
        uint32_t words[kPartners * 2 * kOwnWords];
        link.receive<2 * kOwnWords>(words);
#pragma unroll
        for (int p = 0; p < kPartners; ++p) {
#pragma unroll
          for (int i = 0; i < kOwnWords; ++i) {
            big[(p + 1) * kOwnWords + i] = words[2 * p * kOwnWords + i];
            small[(p + 1) * kOwnWords + i] = words[(2 * p + 1) * kOwnWords + i];
          }
        }
        issue_m64_products<kChains, 1, kOwn / 16, kH / 16>(acc, big, small, big_plane(l), small_plane(l), kOwn);
      }
      wait_products(acc);
      finish_hidden_layer<kChains>(acc, big, small);
    }
    // The output layer over this CTA's inner block: a partial eps.
    float part[2][32];
    start_m64_layer<1>(part, bias + (L - 1) * kOwn, nullptr, tn, q);
#pragma unroll
    for (int i = 0; i < 32; ++i) part[1][i] = 0.f;
    issue_m64_products<1, 2, 0, kOwn / 16>(part, big, small, big_plane(L - 1), small_plane(L - 1),
                                             kWgmmaDimPad);
    wait_products(part);
    float eps[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) eps[i] = part[0][i] + part[1][i];
    if constexpr (kScatterEps<kCs>) {
      constexpr int kB = 8;  // a thread's accumulators of a block of eps
      // Partner r ^ (p + 1) sums block p + 1: send it that block, take this
      // CTA's, block 0, from every partner.
      uint32_t words[kPartners * kB];
#pragma unroll
      for (int i = 0; i < kPartners * kB; ++i) words[i] = __float_as_uint(eps[kB + i]);
      link.send<kB, true>(words);
      link.receive<kB>(words);
#pragma unroll
      for (int i = 0; i < kB; ++i) {
        eps[i] = (eps[i] + __uint_as_float(words[i])) +
                 (__uint_as_float(words[kB + i]) + __uint_as_float(words[2 * kB + i]));
        words[i] = __float_as_uint(eps[i]);
      }
      // Then the sums: partner r ^ (p + 1)'s is block p + 1.
      link.send<kB>(words);
      link.receive<kB>(words);
#pragma unroll
      for (int i = 0; i < kPartners * kB; ++i) eps[kB + i] = __uint_as_float(words[i]);
    } else if constexpr (kCs > 1) {
      uint32_t words[kPartners * 32];
#pragma unroll
      for (int i = 0; i < 32; ++i) words[i] = __float_as_uint(eps[i]);
      link.send<32>(words);
      link.receive<32>(words);
#pragma unroll
      for (int i = 0; i < 32; ++i) eps[i] += __uint_as_float(words[i]);
    }
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int h = (i >> 1) & 1;
      x[i] = c1[h] * (x[i] - c2[h] * eps[i]);
    }
  }

  const float nan = __int_as_float(0x7fc00000);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = my_row0 + 8 * h;
    if (r >= a.batch) continue;
    bool valid;
    load_t_start(a, r, &valid);
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      // Each CTA stores its 1 / kCs of the columns (where eps is scattered,
      // block 0: the one it summed).
      const int col = x_col(i);
      const bool mine = kScatterEps<kCs> ? i < 8 : (i >> 2) * kCs / 8 == rank;
      if (((i >> 1) & 1) == h && col < dim && mine) {
        a.out[static_cast<size_t>(r) * dim + col] = valid ? x[i] : nan;
      }
    }
  }
}

// Grid: clusters of kCs CTAs (one per SM); tile i goes to cluster i mod the
// clusters' count. kBuffers: ClusterLink's.
template <int kOwn, int kCs, int kBuffers>
__global__ void __launch_bounds__(kBf16x3Threads, 1) bf16x3_wgmma_m64_kernel(const __grid_constant__ SampleArgs a) {
  static_assert(kCs == 1 || kCs == 2 || kCs == 4, "the partners r ^ p and the eps exchange need 1, 2 or 4");
  static_assert(!kScatterEps<kCs> || kEpsBlock * kCs == kWgmmaDimPad, "a block of eps per CTA");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const Bf16x3Layout lay{kOwn, kCs, a.num_layers, kBuffers};
  char* smem = aligned_shared_memory(lay);
  const int rank = kCs > 1 ? static_cast<int>(cg::this_cluster().block_rank()) : 0;
  stage_bf16x3_net<kOwn, kCs>(a, lay, smem, rank);
  fence_proxy_async();  // the generic-proxy stores above, before wgmma reads them
  ClusterLink<kCs, kBuffers> link;
  if constexpr (kCs > 1) {
    link.connect(smem, lay, rank);
    if (threadIdx.x % 32 == 0) {
      for (int b = 0; b < kBuffers; ++b) mbarrier_init(link.barrier(b), 1);
      fence_mbarrier_init();
    }
  }
  // Every CTA running, with its mbarriers initialized, before anyone sends.
  sync_cluster_or_cta<kCs>();
  const int tiles = (a.batch + kWgmmaRows - 1) / kWgmmaRows;
  const int clusters = gridDim.x / kCs;
  for (int tile = blockIdx.x / kCs; tile < tiles; tile += clusters) {
    run_m64_tile<kOwn, kCs, kBuffers>(a, lay, smem, link, rank, tile * kWgmmaRows);
    if constexpr (kCs > 1) link.end_tile();
  }
  if constexpr (kCs > 1) link.finish();
#endif
}

}  // namespace cuda_kernels
}  // namespace ddpm_ops
