// Operands as two bf16 planes (big = bf16(v), small = bf16(v - big)) and
// the staging of a CTA's share of the net, shared by both bf16x3 kernels.
#pragma once

#include "../../plan/shapes/bf16x3.h"
#include "rows.cuh"
#include "wgmma.cuh"

namespace ddpm_ops {
namespace cuda_kernels {

// The bf16x3 kernels' layout, which the plan owns (csrc/plan/shapes/bf16x3.h).
using shapes::Bf16x3Layout;
using shapes::kBf16x3Threads;

// Whether a cluster of kCs reduce-scatters eps (the columns each CTA sums:
// kEpsBlock, 8 accumulators of a thread) rather than sending every partner
// its whole partial sum.
template <int kCs>
constexpr bool kScatterEps = kCs == 4;
constexpr int kEpsBlock = 16;

// bf16 of the column pair (lo, hi), and bf16 of what that leaves of it: the
// big and small planes.
__device__ __forceinline__ void bf16_planes(float lo, float hi, uint32_t* big, uint32_t* small) {
  *big = pack_bf16(lo, hi);
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(big));
  *small = pack_bf16(lo - b.x, hi - b.y);
}

// Which part of a layer's weights a CTA keeps, in the swizzled K-major
// layout wgmma reads: its row n < rows is weight row row0 + n with its
// block of row_block rows permuted, (n / row_block ^ row_xor) row_block + n
// % row_block; its inner index kk < depth is weight column kk with its block
// of k_block columns permuted the same way by k_xor; zero past the layer's
// rows and from column `used` on.
struct WeightTile {
  int row0 = 0;
  int rows;
  int row_block = 1 << 30;
  int row_xor = 0;
  int depth;
  int k_block = 1 << 30;
  int k_xor = 0;
  int used;
};

// Copies tile t of layer la into shared memory: bf16(w) at big, bf16(w -
// bf16(w)) at small, in the bf16_wgmma kernel's layout (its stage_net). That loop
// is kept apart, though it is this one without rotation and small plane:
// sharing this function changed the bf16_wgmma kernel's register allocation and
// cost it 15% at batch 32768 (285 -> 329 us on the H200). kStageBatch
// 16-byte stores (8 deep each) per thread at a time, with all their loads in
// flight first: staging is a chain of load latencies. Each group of 8 loads
// as two float4 where the layer's rows are 16-byte aligned and it lies
// within them.
template <int kStageBatch = 4>
__device__ __forceinline__ void stage_weight_tile(const LayerArgs& la, const WeightTile& t, char* big, char* small) {
  const int groups_per_row = t.depth / 8;
  const bool rows_aligned = la.in % 4 == 0 && reinterpret_cast<uintptr_t>(la.weight) % 16 == 0;
  const int groups = t.rows * groups_per_row;
  for (int i0 = threadIdx.x; i0 < groups; i0 += kStageBatch * kBf16x3Threads) {
    float v[kStageBatch][8];
#pragma unroll
    for (int b = 0; b < kStageBatch; ++b) {
      const int i = i0 + b * kBf16x3Threads, n = i / groups_per_row, kk = 8 * (i - n * groups_per_row);
      // The permutation moves whole 8-column groups (k_block is a multiple of 8).
      const int k0 = (kk / t.k_block ^ t.k_xor) * t.k_block + kk % t.k_block;
      const int row = t.row0 + (n / t.row_block ^ t.row_xor) * t.row_block + n % t.row_block;
      const float* w = la.weight + static_cast<size_t>(row) * la.in + k0;
      const bool in_rows = i < groups && row < la.out;
      if (rows_aligned && in_rows && k0 + 8 <= t.used) {
        const float4 p = __ldg(reinterpret_cast<const float4*>(w)), q = __ldg(reinterpret_cast<const float4*>(w) + 1);
        v[b][0] = p.x, v[b][1] = p.y, v[b][2] = p.z, v[b][3] = p.w;
        v[b][4] = q.x, v[b][5] = q.y, v[b][6] = q.z, v[b][7] = q.w;
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) v[b][e] = in_rows && k0 + e < t.used ? __ldg(w + e) : 0.f;
      }
    }
#pragma unroll
    for (int b = 0; b < kStageBatch; ++b) {
      const int i = i0 + b * kBf16x3Threads, n = i / groups_per_row, k8 = i - n * groups_per_row;
      if (i >= groups) break;
      // The 16-byte chunks of a 128-byte row are permuted by the row's
      // index within its 8-row group.
      const int at = (k8 / 8) * t.rows * 128 + n * 128 + (((k8 % 8) ^ (n & 7)) * 16);
      uint32_t hi[4], lo[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) bf16_planes(v[b][2 * e], v[b][2 * e + 1], hi + e, lo + e);
      *reinterpret_cast<uint4*>(big + at) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
      *reinterpret_cast<uint4*>(small + at) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    }
  }
}

// A fragments (both planes) of the values a thread holds in accumulator
// layout: pair i / 2 of v is word i / 2.
template <int N>
__device__ __forceinline__ void plane_fragments(const float (&v)[N], uint32_t* big, uint32_t* small) {
#pragma unroll
  for (int i = 0; i < N; i += 2) bf16_planes(v[i], v[i + 1], big + i / 2, small + i / 2);
}


// Copies this CTA's share of the net into shared memory: both planes of its
// weights (zero wherever the padding reaches), its biases and time column;
// with kScatter x's, eps's and layer 0's inner blocks of kEpsBlock permuted;
// kStageBatch: stage_weight_tile's.
template <int kOwn, int kCs, bool kScatter = kScatterEps<kCs>, int kStageBatch = 4>
__device__ __forceinline__ void stage_bf16x3_net(const SampleArgs& a, const Bf16x3Layout& lay, char* smem, int rank) {
  const int L = a.num_layers;
  float* bias = reinterpret_cast<float*>(smem + lay.bias_offset());
  for (int l = 0; l < L; ++l) {
    const LayerArgs& la = a.layers[l];
    const bool last = l + 1 == L;
    char* big = smem + lay.weight_offset(l);
    // Hidden layers: this CTA's columns, the inner dimension's blocks
    // permuted to start at its own (layer 0's input, x, is whole on every
    // CTA). The last layer: every column, this CTA's inner block.
    WeightTile tile;
    tile.row0 = last ? 0 : rank * kOwn;
    tile.rows = lay.rows(l);
    tile.depth = lay.depth(l);
    if (l > 0) {
      tile.k_block = kOwn;
      tile.k_xor = rank;
    } else if (kScatter) {  // x's blocks permuted
      tile.k_block = kEpsBlock;
      tile.k_xor = rank;
    }
    if (last && kScatter) {  // eps's blocks permuted
      tile.row_block = kEpsBlock;
      tile.row_xor = rank;
    }
    tile.used = l == 0 ? a.dim : la.in;  // layer 0's last column (time) has its own place
    stage_weight_tile<kStageBatch>(la, tile, big, big + lay.plane_bytes(l));
    for (int n = threadIdx.x; n < tile.rows; n += kBf16x3Threads) {
      // The output layer's bias goes into rank 0's partial sum only (whose
      // blocks are not permuted).
      const int col = tile.row0 + n;
      bias[l * kOwn + n] = col < la.out && (!last || rank == 0) ? __ldg(la.bias + col) : 0.f;
    }
  }
  float* time_weight = reinterpret_cast<float*>(smem + lay.time_weight_offset());
  const LayerArgs& first = a.layers[0];
  for (int n = threadIdx.x; n < kOwn; n += kBf16x3Threads) {
    const int col = rank * kOwn + n;
    time_weight[n] = col < first.out ? __ldg(first.weight + static_cast<size_t>(col) * first.in + a.dim) : 0.f;
  }
}

}  // namespace cuda_kernels
}  // namespace ddpm_ops
