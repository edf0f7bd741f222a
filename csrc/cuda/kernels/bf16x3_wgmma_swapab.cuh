// The exact fp32 tensor-core kernel of ddpm::fused_sample for medium batches
// (Hopper's wgmma, compiled only for sm_90a).
//
// bf16x3_wgmma_swapab_kernel<kOwn, kCs, kN>: the bf16x3_wgmma_m64 kernel's arithmetic
// (bf16x3_wgmma_m64.cuh: both planes of every operand, big*big + small*big +
// big*small in fp32, the net split over a cluster of kCs CTAs with kOwn
// columns of each hidden layer each) with the operands swapped: the weights
// are wgmma's A (M = 64 output columns of a layer) and the activations its
// B (N = kN rows of the batch), both read from shared memory. wgmma's M is
// at least 64, its N as small as 8, so a cluster carries a tile of kN = 8 to
// 32 rows where the bf16x3_wgmma_m64 kernel needs 64: 4 to 8 times the clusters on the
// same batch, and a CTA sends a quarter to an eighth of the bytes per step,
// which bound the bf16x3_wgmma_m64 kernel's steps (docs/kernels.md).
//   - A layer's accumulators (columns x rows) are split into both bf16
//     planes and written with stmatrix.trans straight into the next layer's
//     B tile (K-major, 128-byte swizzle, the weights' layout); a hidden
//     layer's tile holds the cluster's whole width, CTA r ^ p's columns in
//     block p (the weights' inner dimension is permuted the same way), so a
//     CTA writes its own block 0 and one bulk copy per partner puts it into
//     the partner's block p, completing on the partner's mbarrier.
//   - The output layer runs over the CTA's own block of the last hidden
//     layer (never exchanged): a partial eps, which every CTA sends to every
//     partner (thread to thread, st.async). Every CTA adds the kCs partials
//     in the same order (commutative pairs: ((P0 + P1) + (P2 + P3)) whatever
//     its rank), so every CTA holds the same eps and the same x, bit for bit.
//   - x stays in fp32 registers, in the output layer's accumulator layout.
// No barrier guards a send: each exchange's data are computed from the
// partners' previous one (the proof at SwapabLayout::act_buffers).
// Shape envelope (host: bf16x3_wgmma_swapab_shape, csrc/plan): the bf16x3_wgmma_m64 kernel's (2 to kMaxLayers
// layers, dim <= 64, hidden widths <= kOwn kCs) and the CTA's share within
// the shared memory.
#pragma once

#include "../common/bf16x3.cuh"
#include "../../plan/shapes/bf16x3_wgmma_swapab.h"

#include <cooperative_groups.h>

namespace ddpm_ops {
namespace cuda_kernels {

// The shape the plan chooses for this kernel (csrc/plan/shapes/bf16x3_wgmma_swapab.h).
using shapes::Bf16x3Layout;
using shapes::SwapabLayout;
using shapes::kSwapabThreads;
using shapes::kWgmmaDimPad;

namespace cg = cooperative_groups;

// d (+)= A (64 x 16 at desc_a) * B (16 x kN at desc_b), both in shared memory.
template <int kN>
__device__ __forceinline__ void wgmma_ss(float (&d)[kN / 2], uint64_t desc_a, uint64_t desc_b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // (scale-d is a predicate: always accumulate, the bias starts the sums)
  if constexpr (kN == 8) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\nwgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "l"(desc_a), "l"(desc_b), "r"(1));
  } else if constexpr (kN == 16) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\nwgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, "
        "0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(desc_a), "l"(desc_b), "r"(1));
  } else if constexpr (kN == 24) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %14, 0;\nwgmma.mma_async.sync.aligned.m64n24k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11}, "
        "%12, %13, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11])
        : "l"(desc_a), "l"(desc_b), "r"(1));
  } else {
    static_assert(kN == 32, "tiles of 8, 16, 24 or 32 rows");
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\nwgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
        "%12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(desc_a), "l"(desc_b), "r"(1));
  }
#endif
}

// A B tile in shared memory: kBlock columns per CTA block (kOwn, or 64 for
// x), kN rows, [block][plane][64-column part][row][128 bytes].
template <int kN, int kBlock>
struct BTile {
  uint32_t base;  // shared-memory address
  // Where plane `plane` of k-block kb (16 deep) starts, from base.
  static constexpr uint32_t offset(int kb, int plane) {
    return (16 * kb / kBlock) * 4 * kBlock * kN + plane * 2 * kBlock * kN + (16 * kb % kBlock / 64) * kN * 128 +
           (16 * kb % 64) / 16 * 32;
  }
};

// A matrix descriptor (wgmma_descriptor) is a constant high word and a low
// word that grows by 1 every 16 bytes of the address (shared memory is far
// below the 256 KB where it would carry): the descriptors of a tile's parts
// are its base's low word plus constants, not each one masked and shifted
// again (that took 6 instructions per wgmma, most of a step's).
__device__ __forceinline__ uint32_t descriptor_low(uint32_t addr) {
  return static_cast<uint32_t>(wgmma_descriptor(addr));
}
__device__ __forceinline__ uint64_t descriptor_at(uint32_t low, uint32_t bytes) {
  return (wgmma_descriptor(0) & 0xFFFFFFFF00000000ull) | (low + (bytes >> 4));
}

// acc[m * kKChains + kb % kKChains] += A rows [64 m, 64 (m + 1)) of the weights
// (planes from descriptor low words w_big, w_small; kWRows rows, swizzled
// blocks of 64 deep) times k-blocks [kKb0, kKb1) of the B tile whose base
// has descriptor low word `in`, three products each.
template <int kN, int kM, int kKChains, int kKb0, int kKb1, int kBlock, int kWRows>
__device__ __forceinline__ void issue_swapab_products(float (&acc)[kM * kKChains][kN / 2], uint32_t w_big,
                                                      uint32_t w_small, uint32_t in) {
  using Tile = BTile<kN, kBlock>;
  wgmma_fence();
#pragma unroll
  for (int kb = kKb0; kb < kKb1; ++kb) {
    const uint64_t b_big = descriptor_at(in, Tile::offset(kb, 0)), b_small = descriptor_at(in, Tile::offset(kb, 1));
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      const uint32_t at = (kb / 4) * kWRows * 128 + m * 64 * 128 + (kb % 4) * 32;
      float(&d)[kN / 2] = acc[m * kKChains + kb % kKChains];
      wgmma_ss<kN>(d, descriptor_at(w_big, at), b_big);
      wgmma_ss<kN>(d, descriptor_at(w_big, at), b_small);
      wgmma_ss<kN>(d, descriptor_at(w_small, at), b_big);
    }
  }
  wgmma_commit();
}

// 0, in a register of its own: the compiler would otherwise let the chains
// that start at zero share one, which wgmma then both reads and writes (it
// inserts a wait on the products to allow that).
__device__ __forceinline__ float opaque_zero() {
  float v;
  asm volatile("mov.b32 %0, 0;\n" : "=f"(v));
  return v;
}

__device__ __forceinline__ void stmatrix_x2_trans(uint32_t addr, uint32_t r0, uint32_t r1) {
  asm volatile("stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1, %2};\n" ::"r"(addr), "r"(r0), "r"(r1)
               : "memory");
}

// Both planes of v (kM blocks of 64 columns x kN rows, accumulator layout)
// into block 0 of the B tile: element (column c, row n) at row n, column c.
// A thread's pair of rows (2q, 2q + 1) in one column is one b16x2 of an 8 x 8
// stmatrix fragment, so .trans writes each row's 8 columns as one 16-byte
// chunk (permuted within its 128-byte row by the row's index: the swizzle).
template <int kN, int kM, int kBlock>
__device__ __forceinline__ void store_swapab_tile(const float (&v)[kM][kN / 2], const BTile<kN, kBlock>& out) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int h = (lane / 8) % 2, r = lane % 8;  // the row of fragment h that this lane addresses
  const int chunk = 2 * warp + h;
#pragma unroll
  for (int m = 0; m < kM; ++m) {
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) {
      uint32_t big[2], small[2];
      bf16_planes(v[m][4 * j], v[m][4 * j + 1], big, small);
      bf16_planes(v[m][4 * j + 2], v[m][4 * j + 3], big + 1, small + 1);
      const int n = 8 * j + r;
      const uint32_t at = m * kN * 128 + n * 128 + ((chunk ^ r) * 16);
      stmatrix_x2_trans(out.base + at, big[0], big[1]);
      stmatrix_x2_trans(out.base + 2 * kBlock * kN + at, small[0], small[1]);
    }
  }
}

// The accumulator layout of a warpgroup's m64nN: element i of a thread is
// column (M) 16 warp + g + 8 ((i >> 1) & 1) of its 64, row (N) 8 (i >> 2) +
// 2 q + (i & 1); rows are numbered by slot s = 2 (i >> 2) + (i & 1).
__device__ __forceinline__ int swapab_col(int i, int warp, int g) { return 16 * warp + g + 8 * ((i >> 1) & 1); }
__device__ __forceinline__ int swapab_slot(int i) { return 2 * (i >> 2) + (i & 1); }
__device__ __forceinline__ int swapab_row(int s, int q) { return 8 * (s / 2) + 2 * q + (s & 1); }

// All steps for the kN-row tile at row0 (shared by the kCs CTAs of the cluster).
template <int kOwn, int kCs, int kN>
__device__ __forceinline__ void run_swapab_tile(const SampleArgs& a, const SwapabLayout& lay, char* smem, int rank,
                                                int row0, uint32_t& exchanges, uint32_t& eps_exchanges) {
  constexpr int kH = kOwn * kCs;
  constexpr int kM = kOwn / 64;  // 64-column blocks of a hidden layer per CTA
  constexpr int kV = kN / 2;     // accumulators of a thread per block
  constexpr int kSlots = kN / 4; // rows of a thread
  constexpr int kPartners = kCs - 1;
  const Bf16x3Layout wl = lay.weights();
  const uint32_t base = smem_address(smem);
  const float* bias = reinterpret_cast<const float*>(smem + wl.bias_offset());
  const float* time_weight = reinterpret_cast<const float*>(smem + wl.time_weight_offset());
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, q = lane % 4;
  const int L = a.num_layers, dim = a.dim;
  auto big_plane = [&](int l) { return descriptor_low(base + wl.weight_offset(l)); };
  auto small_plane = [&](int l) { return descriptor_low(base + wl.weight_offset(l) + wl.plane_bytes(l)); };
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + lay.barrier_offset());
  const BTile<kN, 64> x_tile{base + lay.x_offset()};
  const BTile<kN, kOwn> last_in{base + lay.last_in_offset()};
  auto act = [&](int b) { return BTile<kN, kOwn>{base + lay.act_offset() + b * lay.act_bytes()}; };

  int t[kSlots];
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    const int r = row0 + swapab_row(s, q);
    bool ok;
    t[s] = r < a.batch ? load_t_start(a, r, &ok) : 0;
  }
  float x[kV];
#pragma unroll
  for (int i = 0; i < kV; ++i) {
    const int r = row0 + swapab_row(swapab_slot(i), q), col = swapab_col(i, warp, g);
    x[i] = r < a.batch && col < dim ? __ldg(a.x + static_cast<size_t>(r) * dim + col) : 0.f;
  }

  // acc[m] <- layer l's bias (and for layer 0 the time term) over the
  // thread's elements of block m of this CTA's columns.
  auto start_layer = [&](float(&acc)[kM * 2][kV], int l, const float* tn) {
#pragma unroll
    for (int m = 0; m < kM; ++m) {
#pragma unroll
      for (int i = 0; i < kV; ++i) {
        const int col = 64 * m + swapab_col(i, warp, g);
        float v = bias[l * kOwn + col];
        if (l == 0) v = fmaf(tn[swapab_slot(i)], time_weight[col], v);
        acc[2 * m][i] = v;
        acc[2 * m + 1][i] = opaque_zero();
      }
    }
  };
  // silu of the sum of each block's two chains.
  auto finish_hidden = [&](const float(&acc)[kM * 2][kV], float(&out)[kM][kV]) {
#pragma unroll
    for (int m = 0; m < kM; ++m) {
#pragma unroll
      for (int i = 0; i < kV; ++i) out[m][i] = silu_approx(acc[2 * m][i] + acc[2 * m + 1][i]);
    }
  };
  // After a layer's stores into block 0 of tile b: visible to the CTA's
  // wgmmas, then sent to the partners.
  auto publish = [&](bool send, int b) {
    fence_proxy_async();
    __syncthreads();
    if (kCs > 1 && send && threadIdx.x == 0) {
      const char* own = smem + lay.act_offset() + b * lay.act_bytes();  // block 0 of tile b
#pragma unroll
      for (int p = 1; p < kCs; ++p) {
        const uint32_t dst = cluster_address(smem_address(own) + p * lay.block_bytes(), rank ^ p);
        bulk_copy_to_cluster(dst, own, lay.block_bytes(), cluster_address(smem_address(bars + b), rank ^ p));
      }
    }
  };

  for (int k = 0; k < a.num_steps; ++k) {
    float c1[kSlots], c2[kSlots], tn[kSlots];
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int ti = clamp_index(t[s] - k, a.table_length);
      c1[s] = __ldg(a.sqrt_recip_alphas + ti);
      c2[s] = __ldg(a.coef_eps + ti);
      tn[s] = static_cast<float>(t[s] - k) / a.total_timesteps;
    }
    {
      float xv[1][kV];
#pragma unroll
      for (int i = 0; i < kV; ++i) xv[0][i] = x[i];
      store_swapab_tile<kN, 1, 64>(xv, x_tile);
    }
    fence_proxy_async();
    __syncthreads();
    // Layer 0, then the hidden layers: each writes its output into the next
    // exchanged tile (or, the last hidden layer, into last_in).
    for (int l = 0; l + 1 < L; ++l) {
      float acc[kM * 2][kV];
      start_layer(acc, l, tn);
      if (l == 0) {
        issue_swapab_products<kN, kM, 2, 0, kWgmmaDimPad / 16, 64, kOwn>(acc, big_plane(0), small_plane(0),
                                                                       descriptor_low(x_tile.base));
      } else {
        const int b = (exchanges - 1) % lay.act_buffers();
        const uint32_t in = descriptor_low(act(b).base), w_big = big_plane(l), w_small = small_plane(l);
        issue_swapab_products<kN, kM, 2, 0, kOwn / 16, kOwn, kOwn>(acc, w_big, w_small, in);
        if constexpr (kCs > 1) {
          const uint32_t parity = ((exchanges - 1) / lay.act_buffers()) & 1u;
          if (threadIdx.x == 0) mbarrier_expect_local(smem_address(bars + b), kPartners * lay.block_bytes());
          mbarrier_wait(bars + b, parity);
          issue_swapab_products<kN, kM, 2, kOwn / 16, kH / 16, kOwn, kOwn>(acc, w_big, w_small, in);
        }
      }
      wait_products(acc);
      float out[kM][kV];
      finish_hidden(acc, out);
      if (l + 2 < L) {
        const int b = exchanges % lay.act_buffers();
        store_swapab_tile<kN, kM, kOwn>(out, act(b));
        publish(true, b);
        ++exchanges;
      } else {
        store_swapab_tile<kN, kM, kOwn>(out, last_in);
        publish(false, 0);
      }
    }
    // The output layer over this CTA's block: a partial eps (rank 0's with
    // the bias).
    float part[2][kV];
#pragma unroll
    for (int i = 0; i < kV; ++i) {
      part[0][i] = bias[(L - 1) * kOwn + swapab_col(i, warp, g)];
      part[1][i] = opaque_zero();
    }
    issue_swapab_products<kN, 1, 2, 0, kOwn / 16, kOwn, kWgmmaDimPad>(part, big_plane(L - 1), small_plane(L - 1),
                                                                     descriptor_low(last_in.base));
    wait_products(part);
    float eps[kV];
#pragma unroll
    for (int i = 0; i < kV; ++i) eps[i] = part[0][i] + part[1][i];
    if constexpr (kCs > 1) {
      const int b = eps_exchanges % lay.eps_buffers();
      uint64_t* bar = bars + lay.act_buffers() + b;
      const uint4* slots = reinterpret_cast<const uint4*>(smem + lay.eps_offset() +
                                                          b * kPartners * lay.eps_slot_bytes());
#pragma unroll
      for (int p = 1; p < kCs; ++p) {
        const uint32_t local = smem_address(slots + (p - 1) * (lay.eps_slot_bytes() / 16) + threadIdx.x);
        const uint32_t dst = cluster_address(local, rank ^ p), dst_bar = cluster_address(smem_address(bar), rank ^ p);
#pragma unroll
        for (int v = 0; v < kV / 4; ++v) {
          st_async(dst + 16 * v * kSwapabThreads,
                   make_uint4(__float_as_uint(eps[4 * v]), __float_as_uint(eps[4 * v + 1]),
                              __float_as_uint(eps[4 * v + 2]), __float_as_uint(eps[4 * v + 3])),
                   dst_bar);
        }
      }
      if (threadIdx.x == 0) mbarrier_expect_local(smem_address(bar), kPartners * lay.eps_slot_bytes());
      mbarrier_wait(bar, (eps_exchanges / lay.eps_buffers()) & 1u);
      ++eps_exchanges;
      // from[p - 1][i]: CTA r ^ p's partial.
      float from[kPartners][kV];
#pragma unroll
      for (int p = 0; p < kPartners; ++p) {
#pragma unroll
        for (int v = 0; v < kV / 4; ++v) {
          const uint4 w = slots[p * (lay.eps_slot_bytes() / 16) + v * kSwapabThreads + threadIdx.x];
          from[p][4 * v] = __uint_as_float(w.x);
          from[p][4 * v + 1] = __uint_as_float(w.y);
          from[p][4 * v + 2] = __uint_as_float(w.z);
          from[p][4 * v + 3] = __uint_as_float(w.w);
        }
      }
      // Pairs {r, r ^ 1} and {r ^ 2, r ^ 3} are {0, 1} and {2, 3} in some
      // order, and fp32 addition commutes: the same sum on every CTA.
#pragma unroll
      for (int i = 0; i < kV; ++i) {
        if constexpr (kCs == 2) {
          eps[i] += from[0][i];
        } else {
          eps[i] = (eps[i] + from[0][i]) + (from[1][i] + from[2][i]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kV; ++i) {
      const int s = swapab_slot(i);
      x[i] = c1[s] * (x[i] - c2[s] * eps[i]);
    }
  }

  const float nan = __int_as_float(0x7fc00000);
  // Each CTA stores the columns of its warps w with w kCs / 4 = r.
  if (warp * kCs / 4 != rank) return;
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    const int r = row0 + swapab_row(s, q);
    if (r >= a.batch) continue;
    bool valid;
    load_t_start(a, r, &valid);
#pragma unroll
    for (int i = 0; i < kV; ++i) {
      const int col = swapab_col(i, warp, g);
      if (swapab_slot(i) == s && col < dim) a.out[static_cast<size_t>(r) * dim + col] = valid ? x[i] : nan;
    }
  }
}

// Grid: clusters of kCs CTAs (one per SM); tile i goes to cluster i mod the
// clusters' count.
template <int kOwn, int kCs, int kN>
__global__ void __launch_bounds__(kSwapabThreads, 1) bf16x3_wgmma_swapab_kernel(const __grid_constant__ SampleArgs a) {
  static_assert(kCs == 1 || kCs == 2 || kCs == 4, "the partners r ^ p and the eps sum need 1, 2 or 4");
  static_assert(kOwn % 64 == 0, "whole 64-column blocks (wgmma's M)");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const SwapabLayout lay{kOwn, kCs, a.num_layers, kN};
  char* smem = aligned_shared_memory(lay);
  const int rank = kCs > 1 ? static_cast<int>(cg::this_cluster().block_rank()) : 0;
  stage_bf16x3_net<kOwn, kCs, false, 8>(a, lay.weights(), smem, rank);
  fence_proxy_async();  // the generic-proxy stores above, before wgmma reads them
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + lay.barrier_offset());
  if (threadIdx.x == 0) {
    for (int b = 0; b < lay.act_buffers() + lay.eps_buffers(); ++b) mbarrier_init(bars + b, 1);
    fence_mbarrier_init();
  }
  // Every CTA running, with its mbarriers initialized, before anyone sends.
  sync_cluster_or_cta<kCs>();
  const int tiles = (a.batch + kN - 1) / kN;
  const int clusters = gridDim.x / kCs;
  uint32_t exchanges = 0, eps_exchanges = 0;
  for (int tile = blockIdx.x / kCs; tile < tiles; tile += clusters) {
    run_swapab_tile<kOwn, kCs, kN>(a, lay, smem, rank, tile * kN, exchanges, eps_exchanges);
  }
  // No partner may still write into this CTA: every send to it is one this
  // CTA has waited for, but a partner still reading is harmless only while
  // this CTA exists.
  if constexpr (kCs > 1) {
    cluster_arrive();
    cluster_wait();
  }
#endif
}

}  // namespace cuda_kernels
}  // namespace ddpm_ops
