// The tf32x3_tiled kernel of the engine (large batches, medium batches of
// nets too wide for fp32_resident, and every batch on GPUs below 9.0): the
// general step of both overloads on tensor cores, exact in fp32.
//
// tf32x3_tiled_kernel, the mainloop: a row tile of 16*MT rows stays in shared
// memory for all steps, weights stream from L2 through a ring of chunks (one
// TMA tensor copy each, or cp.async where TMA cannot address the layer), and
// the products run on tensor cores: mma.sync m16n8k8 tf32, three of them per
// product (3xTF32: big*big + big*small + small*big) for fp32 accuracy, one
// for the opt-in fast modes. On 9.0 a cluster of CTAs may share a row tile,
// each computing a share of every layer's columns and sending it to all of
// them with the bulk-copy engine (completing on mbarriers); the last layer is
// then split over its inner dimension instead, so the layer before it is
// never exchanged and only small partial sums are. Below 9.0 (the portable
// path) a tile is one CTA and every chunk comes by cp.async: mma.sync,
// ldmatrix and cp.async are sm_80 instructions.
//
// Layer 0's outputs add the prologue's rows (prologue.cuh: first_layer_bias,
// the bias networks evaluated into shared memory), each hidden layer its
// activation, and x moves by the epilogue's step (epilogue.cuh).
#pragma once

#include "../common/activation.cuh"
#include "../common/prologue.cuh"
#include "../common/ptx.cuh"
#include "../common/rows.cuh"
#include "../common/epilogue.cuh"
#include "../../plan/shapes/tf32x3_tiled.h"

namespace ddpm_ops {
namespace cuda_kernels {

// The shape the plan chooses for this kernel (csrc/plan/shapes/tf32x3_tiled.h).
using shapes::TilePlan;
using shapes::kTileKChunk;
using shapes::kTileMaxSlots;
using shapes::kTileMaxWarpTiles;
using shapes::kTileStageLd;
using shapes::kTileSwizzleBytes;
using shapes::kTileThreads;
using shapes::kTileWarps;
using shapes::stage_index;
using shapes::tile_pass_cols;
using shapes::tile_passes;

// (TilePlan::tma): the weight matrix as a 2-D tensor (in, out), boxes of
// kTileKChunk x the layer's pass width, zero-filled outside the matrix,
// with the 128-byte swizzle above.
struct TileMaps {
  CUtensorMap weight[kMaxLayers];
};

// The part of layer l's product that CTA `rank` computes: output columns
// [col_begin, col_end) over the inner range [k_begin, k_end), in `chunks`
// chunks from k_begin (weights past k_end are staged as zeros). One place
// for the weight stream and the products to agree on.
struct LayerShare {
  int col_begin, col_end;
  int k_begin, k_end;
  int chunks;
};
__device__ inline LayerShare layer_share(const EngineArgs& a, const TilePlan& p, int l, int rank) {
  const LayerArgs& la = a.layers[l];
  LayerShare s;
  if (p.partial_last && l + 1 == a.num_layers) {
    // The plan makes every CTA's inner range lie inside the activation rows.
    const int k_share = p.cta_cols[l - 1];
    s.col_begin = 0;
    s.col_end = la.out;
    s.k_begin = rank * k_share;
    s.k_end = min(la.in, s.k_begin + k_share);
  } else {
    s.col_begin = rank * p.cta_cols[l];
    s.col_end = min(la.out, s.col_begin + p.cta_cols[l]);
    s.k_begin = 0;
    s.k_end = la.in;
  }
  // At least one (then all-zero) chunk: every pass moves the stream on.
  s.chunks = max(1, (s.k_end - s.k_begin + kTileKChunk - 1) / kTileKChunk);
  return s;
}

// The small part of v for 3xTF32: v - big, where big is v truncated to
// tf32. mma .tf32 reads only a register's 19 high bits (sign, exponent and
// 10 mantissa bits), so v's own bits serve as big, and small's low bits need
// no clearing either: |v - big - tf32(small)| <= 2^-20 |v| (the small * small
// product is below fp32 resolution and dropped).
__device__ __forceinline__ uint32_t tf32_small(uint32_t v) {
  return __float_as_uint(__uint_as_float(v) - __uint_as_float(v & 0xffffe000u));
}

// Four 8x4 fp32 matrices from shared memory, one register each: lane i gives
// the address (16-byte aligned) of row i % 8 of matrix i / 8 and receives
// element (lane / 4, lane % 4) of each, the layout of mma m16n8k8 tf32
// fragments. ("memory": the buffers are rewritten between barriers.)
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
// Two such matrices, addressed by lanes 0 to 15.
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr)
               : "memory");
}

// Not volatile: independent products may be interleaved by the compiler.
__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The weight stream of one CTA is the same for every step: (layer, pass,
// chunk) in order. Walking it as one sequence lets the copies of the next
// chunks, even the next layer's first, overlap the current chunk's products.
// Which rows and columns a thread copies is fixed for a whole pass, so it is
// worked out once per pass (begin_pass); a chunk only moves a pointer on.
// A slot filled by TMA is complete when its mbarrier's phase is; one filled
// by cp.async when this thread's copy group is (and, after the per-chunk CTA
// barrier, everyone's).
struct WeightStream {
  int layer, pass;       // of the next chunk to copy
  int chunks_left;       // in that pass, the next one included
  const float* src;      // this thread's first source row at the next chunk
  const float* safe;     // a readable address for the copies predicated off
  size_t src_step;       // floats between this thread's source rows
  int k_left;            // columns of W from this thread's column at the next chunk on
  int copies;            // rows this thread copies per chunk
  int copies_inside;     // of those, rows of the matrix and of the CTA's share
  int dst;               // this thread's first destination in a slot
  int dst_step;          // floats between its destination rows
  bool vec;              // 16-byte copies (else 4-byte)
  bool tma;              // the pass's chunks come by TMA (the fields above unused)
  int box_k, box_n;      // TMA: coordinates of the next chunk in W
  int fill;              // slot the next chunk goes to
  int read;              // slot the products read
  uint32_t tma_slots;    // bit s: slot s's pending or current chunk came by TMA
  uint32_t phase;        // bit s: parity of the next phase of slot s's mbarrier
};

// Slot rows are the pass's output columns [n][k]: thread i copies one 16-byte
// (or 4-byte) column group of every (threads / groups)-th row.
__device__ void begin_pass(const EngineArgs& a, const TilePlan& p, int rank, WeightStream& ws) {
  const LayerArgs& la = a.layers[ws.layer];
  const LayerShare share = layer_share(a, p, ws.layer, rank);
  const int pass_cols = tile_pass_cols(p, ws.layer);
  const int n_base = share.col_begin + ws.pass * pass_cols;
  const int rows_left = share.col_end - n_base;  // rows of W to copy, if < pass_cols
  ws.chunks_left = share.chunks;
  ws.tma = p.tma[ws.layer];
  if (ws.tma) {
    // Columns past the share but inside W arrive too: their products are
    // not stored. Past W's edges the box is zero-filled.
    ws.box_k = share.k_begin;
    ws.box_n = n_base;
    return;
  }
  ws.vec = p.vec4[ws.layer];
  const int width = ws.vec ? 4 : 1;            // floats per copy
  const int groups = kTileKChunk / width;      // copies per row
  const int row_step = kTileThreads / groups;  // rows between one thread's copies
  const int n0 = threadIdx.x / groups;
  const int k = (threadIdx.x % groups) * width;
  ws.copies = n0 < pass_cols ? (pass_cols - n0 + row_step - 1) / row_step : 0;
  ws.copies_inside = n0 < rows_left ? min(ws.copies, (rows_left - n0 + row_step - 1) / row_step) : 0;
  ws.safe = la.weight;
  ws.k_left = share.k_end - share.k_begin - k;
  ws.src = ws.copies_inside > 0 && ws.k_left > 0
               ? la.weight + static_cast<size_t>(n_base + n0) * la.ld + share.k_begin + k
               : la.weight;
  ws.src_step = static_cast<size_t>(row_step) * la.ld;
  // row_step is a multiple of 8, so every row this thread copies has the
  // same swizzle as its first.
  ws.dst = stage_index(n0, k);
  ws.dst_step = row_step * kTileStageLd;
}

// Slot `fill` <- the next chunk: W[the pass's columns, the chunk's k-range],
// zero outside the matrix (and, for cp.async copies, the CTA's share); then
// the stream moves on. A TMA chunk is one copy issued by thread 0; every
// thread still commits a (then empty) cp.async group, so that the groups
// pending stay one per slot.
__device__ __forceinline__ void load_chunk(const EngineArgs& a, const TilePlan& p, const TileMaps& maps,
                                           int rank, float* stages, uint64_t* slot_bars, WeightStream& ws) {
  float* slot = stages + ws.fill * p.slot_floats;
  if (ws.tma) {
    if (threadIdx.x == 0) {
      const uint32_t bar = smem_address(slot_bars + ws.fill);
      mbarrier_expect_local(bar, tile_pass_cols(p, ws.layer) * kTileKChunk * sizeof(float));
      tma_load_2d(smem_address(slot), &maps.weight[ws.layer], ws.box_k, ws.box_n, bar);
    }
    ws.tma_slots |= 1u << ws.fill;
    ws.box_k += kTileKChunk;
  } else {
    const int inside = ws.k_left > 0 ? ws.copies_inside : 0;
    const float* src = ws.src;
    float* dst = slot + ws.dst;
    if (ws.vec) {
      // A group straddling the layer's inner width copies its columns below
      // it alone (layer 0 of the time-column overload: the time column
      // follows x in the row, and the activations past x are not zero).
      const int bytes = static_cast<int>(sizeof(float)) * min(ws.k_left, 4);
      for (int i = 0; i < ws.copies; ++i, src += ws.src_step, dst += ws.dst_step)
        cp_async16_prefix(dst, i < inside ? src : ws.safe, i < inside ? bytes : 0);
    } else {
      for (int i = 0; i < ws.copies; ++i, src += ws.src_step, dst += ws.dst_step)
        cp_async4(dst, i < inside ? src : ws.safe, i < inside);
    }
    ws.tma_slots &= ~(1u << ws.fill);
    ws.src += kTileKChunk;
    ws.k_left -= kTileKChunk;
  }
  cp_async_commit();
  ws.fill = (ws.fill + 1) & (p.slots - 1);
  if (--ws.chunks_left > 0) return;
  if (++ws.pass == tile_passes(p, ws.layer)) {
    ws.pass = 0;
    if (++ws.layer == a.num_layers) ws.layer = 0;
  }
  begin_pass(a, p, rank, ws);
}

// Waits until the chunk in the read slot has landed: its TMA copy, or all
// cp.async groups but the slots - 2 most recent (the slot read last is
// refilled only afterwards).
__device__ __forceinline__ void wait_for_chunk(int slots, uint64_t* slot_bars, WeightStream& ws) {
  if ((ws.tma_slots >> ws.read) & 1u) {
    mbarrier_wait(slot_bars + ws.read, (ws.phase >> ws.read) & 1u);
    ws.phase ^= 1u << ws.read;
    return;
  }
  switch (slots) {
    case 2:
      cp_async_wait<0>();
      break;
    case 4:
      cp_async_wait<2>();
      break;
    default:
      cp_async_wait<kTileMaxSlots - 2>();
  }
}

// What one layer's passes share.
struct TilePass {
  const EngineArgs& a;
  const TilePlan& p;
  const TileMaps& maps;
  int layer;
  const LayerArgs& la;
  LayerShare share;
  const float* in;
  int in_ld;
  float* out;          // activations, or this CTA's slot of the partial sums
  int out_ld;
  float* stages;
  uint64_t* slot_bars;
  int rank;
  bool last;
  int destinations;    // CTAs the outputs are stored into: the cluster, or 1
  bool first_remote;   // the step's first stores into other CTAs
  // Layer 0's prologue: the step, the tile's first row, its rows' first
  // step indices and the bias networks' rows.
  int k;
  int row0;
  const int* t0;
  const BiasNetRows& nets;
};

// Sends this CTA's share of layer l's outputs (its columns of every row of
// buf) to the same place in every other CTA of the cluster with the
// bulk-copy engine (one copy per row and CTA), and waits until the other
// shares have landed here: their bytes complete on this CTA's mbarrier for
// buf, which expects them. Replaces the stores into every CTA and a cluster
// barrier. All threads call it after their stores into buf. A sender reuses
// its share only after the next exchange, by which time every receiver has
// waited for this one.
template <int kRows>
__device__ __forceinline__ void exchange_shares(const EngineArgs& a, const TilePlan& p, int l, int rank,
                                                float* buf, int ld, uint64_t* bar, uint32_t parity,
                                                bool first_remote) {
  const int cs = p.cluster_size;
  const int share = p.cta_cols[l];
  // Padded to whole 16-byte copies; the columns past the layer's width hold
  // finite values (zero weights meet them), as everywhere in these buffers.
  auto width = [&](int q) {
    const LayerShare s = layer_share(a, p, l, q);
    return round_up4(max(0, s.col_end - s.col_begin));
  };
  fence_proxy_async();
  if (first_remote) cluster_wait();  // as in tile_pass
  __syncthreads();
  const uint32_t bar_local = smem_address(bar);
  const int own = width(rank);
  if (own > 0) {
    for (int i = threadIdx.x; i < cs * kRows; i += kTileThreads) {
      const int d = i / kRows, r = i - d * kRows;
      if (d == rank) continue;
      const float* src = buf + r * ld + rank * share;
      bulk_copy_to_cluster(cluster_address(smem_address(src), d), src, own * sizeof(float),
                           cluster_address(bar_local, d));
    }
  }
  if (threadIdx.x == 0) {
    uint32_t bytes = 0;
    for (int q = 0; q < cs; ++q) bytes += q == rank ? 0u : width(q) * kRows * sizeof(float);
    mbarrier_expect_local(bar_local, bytes);
  }
  mbarrier_wait(bar, parity);
}

// out[row][col .. col + 3] <- v (the columns before col_end) in every CTA of
// the cluster, this one included (a CTA's own shared addresses are valid
// cluster addresses of itself).
__device__ __forceinline__ void store_quad(const TilePass& t, int row, int col, int col_end, float4 v) {
  const int inside = col_end - col;
  if (inside <= 0) return;
  const int cs = t.destinations;
  float* const out = t.out + row * t.out_ld + col;
  if (cs == 1) {  // plain stores: the portable path has no cluster addresses
    if (inside >= 4) {
      *reinterpret_cast<float4*>(out) = v;
      return;
    }
    out[0] = v.x;
    if (inside > 1) out[1] = v.y;
    if (inside > 2) out[2] = v.z;
    return;
  }
  const uint32_t local = smem_address(out);
  for (int d = 0; d < cs; ++d) {
    const uint32_t at = cluster_address(local, d);
    if (inside >= 4) {
      st_cluster(at, v);
      continue;
    }
    st_cluster(at, v.x);
    if (inside > 1) st_cluster(at + sizeof(float), v.y);
    if (inside > 2) st_cluster(at + 2 * sizeof(float), v.z);
  }
}

// One pass of a layer: this CTA's rows x (8 warps x NT tiles of 8 columns)
// of its column share, accumulated over its inner range chunk by chunk, then
// bias (layer 0: first_layer_bias), activation and the stores: into this CTA
// (the caller exchanges the shares), or, for the partial sums of a split last
// layer, into every CTA.
// A warp with NT <= 2 tiles spreads consecutive k-steps over the spare
// accumulators (4 / NT chains per tile), so that its products do not wait
// on one another; the chains are summed at the end.
template <int MT, int kProducts, int NT>
__device__ __forceinline__ void tile_pass(const TilePass& t, int pass, WeightStream& stream) {
  constexpr int kChains = kTileMaxWarpTiles / NT;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int in_ld = t.in_ld;
  const int col_end = t.share.col_end;
  const int warp_n = t.share.col_begin + pass * (kTileWarps * 8 * NT) + warp * 8 * NT;
  const bool warp_active = warp_n < col_end;  // warp-uniform
  // The biases, loaded now so that their latency hides behind the products
  // (partial sums: only CTA 0's include them; layer 0's come with its rows).
  const bool with_bias = (!(t.p.partial_last && t.last) || t.rank == 0) && t.layer != 0;
  float bias[NT][2];
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const int col = warp_n + n * 8 + 2 * t4;
    bias[n][0] = with_bias && col < col_end ? __ldg(t.la.bias + col) : 0.f;
    bias[n][1] = with_bias && col + 1 < col_end ? __ldg(t.la.bias + col + 1) : 0.f;
  }
  float acc[MT][kTileMaxWarpTiles][4];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int s = 0; s < kTileMaxWarpTiles; ++s)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[m][s][e] = 0.f;
  // Fragment rows by ldmatrix: A's four 8x4 matrices are rows 0-7 and 8-15
  // at k 0-3, then at k 4-7; B's are n-tile n at k 0-3 and 4-7, then n + 1.
  // A lane's B row is lane % 8 past a multiple of 8, which fixes its swizzle:
  // k-step ks reads 16-byte unit (2 ks + (lane / 8) % 2) ^ (lane % 8).
  const uint32_t a_lane =
      smem_address(t.in) + (((lane & 7) + (lane & 8)) * in_ld + (lane >> 4) * 4) * sizeof(float);
  const uint32_t b_lane = ((lane >> 4) * 8 + (lane & 7)) * kTileStageLd * sizeof(float);
  const uint32_t b_unit = ((lane >> 3) & 1) ^ (lane & 7);
  for (int chunk = 0; chunk < t.share.chunks; ++chunk) {
    // This chunk has landed (each thread waits for its own copies or the
    // TMA copy's mbarrier, the barrier shows everyone's cp.async copies) and
    // every warp is done with the slot read last, which is refilled now: one
    // barrier per chunk.
    wait_for_chunk(t.p.slots, t.slot_bars, stream);
    __syncthreads();
    load_chunk(t.a, t.p, t.maps, t.rank, t.stages, t.slot_bars, stream);
    const uint32_t ws =
        smem_address(t.stages + stream.read * t.p.slot_floats + warp * 8 * NT * kTileStageLd) + b_lane;
    if (warp_active) {
      // Past a layer's width (up to the chunk's end) the staged weights are
      // zero and the activations finite: those products add nothing.
#pragma unroll
      for (int ks = 0; ks < kTileKChunk / 8; ++ks) {
        const int kc = t.share.k_begin + chunk * kTileKChunk + ks * 8;
        const int chain = ks % kChains;
        uint32_t a_big[MT][4], a_small[MT][4];
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          ldmatrix_x4(a_big[m], a_lane + (m * 16 * in_ld + kc) * sizeof(float));
          if (kProducts == 3) {
#pragma unroll
            for (int e = 0; e < 4; ++e) a_small[m][e] = tf32_small(a_big[m][e]);
          }
        }
        uint32_t b_big[NT][2], b_small[NT][2];
#pragma unroll
        for (int n = 0; n < NT; n += 2) {
          const uint32_t at = ws + n * 8 * kTileStageLd * sizeof(float) + (((2 * ks) ^ b_unit) << 4);
          if (n + 1 == NT) {  // an odd tile count's last tile
            ldmatrix_x2(b_big[n], at);
          } else {
            uint32_t q[4];
            ldmatrix_x4(q, at);
            b_big[n][0] = q[0];
            b_big[n][1] = q[1];
            b_big[n + 1][0] = q[2];
            b_big[n + 1][1] = q[3];
          }
        }
        if (kProducts == 3) {
#pragma unroll
          for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) b_small[n][e] = tf32_small(b_big[n][e]);
        }
        // The correction products first, each over every tile, so that
        // consecutive products never feed one another.
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
          for (int m = 0; m < MT; ++m) {
            if (kProducts == 3) {
              mma_tf32(acc[m][n + NT * chain], a_small[m], b_big[n]);
              mma_tf32(acc[m][n + NT * chain], a_big[m], b_small[n]);
            }
          }
        }
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
          for (int m = 0; m < MT; ++m) mma_tf32(acc[m][n + NT * chain], a_big[m], b_big[n]);
        }
      }
    }
    stream.read = (stream.read + 1) & (t.p.slots - 1);
  }
  // Before the first store into other CTAs this step: they have finished the
  // previous step's update, which read the buffer stored into here (this
  // matches their arrival after it).
  if (t.first_remote && t.destinations > 1 && pass == 0) cluster_wait();
  if (!warp_active) return;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int c = 1; c < kChains; ++c)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[m][n][e] += acc[m][n + NT * c][e];
    // Lanes t4 and t4 ^ 1 trade pairs, so that each holds four consecutive
    // columns of one row (row g for even t4, g + 8 for odd): one 16-byte
    // store per CTA instead of two 8-byte ones.
    const bool odd = t4 & 1;
    const int quad_col = warp_n + n * 8 + 4 * (t4 >> 1);
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      float2 v[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        v[h] = make_float2(acc[m][n][2 * h] + bias[n][0], acc[m][n][2 * h + 1] + bias[n][1]);
        if (t.layer == 0) {
          // Rows past the batch compute on its last row's terms (never stored).
          const int r = m * 16 + g + 8 * h, row = min(t.row0 + r, t.a.batch - 1), col = warp_n + n * 8 + 2 * t4;
          const int step = t.t0[r] - t.k;
          if (col < col_end) v[h].x += first_layer_bias(t.a, t.nets, r, row, step, t.k, col);
          if (col + 1 < col_end) v[h].y += first_layer_bias(t.a, t.nets, r, row, step, t.k, col + 1);
        }
        if (!t.last) {
          const Activation act = t.a.activations[t.layer];
          v[h] = make_float2(activate(v[h].x, act), activate(v[h].y, act));
        }
      }
      const float2 send = odd ? v[0] : v[1];
      const float2 got = make_float2(__shfl_xor_sync(0xffffffffu, send.x, 1),
                                     __shfl_xor_sync(0xffffffffu, send.y, 1));
      const float4 quad = odd ? make_float4(got.x, got.y, v[1].x, v[1].y)
                              : make_float4(v[0].x, v[0].y, got.x, got.y);
      store_quad(t, m * 16 + g + (odd ? 8 : 0), quad_col, col_end, quad);
    }
  }
}

// The exchange's and the slots' mbarriers, and the TMA descriptors
// prefetched so that their first use finds them cached (thread 0).
// Without a cluster or a TMA copy no mbarrier is waited on (the portable
// path, whose architectures lack the cluster fence).
__device__ __forceinline__ void init_barriers(const TilePlan& p, const TileMaps& maps, uint64_t* bars, int L) {
  bool tma = false;
  for (int l = 0; l < L; ++l) tma = tma || p.tma[l];
  if (p.cluster_size == 1 && !tma) return;
  for (int b = 0; b < 2 + kTileMaxSlots; ++b) mbarrier_init(bars + b, 1);
  fence_mbarrier_init();
  for (int l = 0; l < L; ++l) {
    if (p.tma[l]) DDPM_OPS_SM90_ONLY(asm volatile("prefetch.tensormap [%0];\n" ::"l"(&maps.weight[l]) : "memory"));
  }
}

// The prefetches past the end, unused, must land before exit.
__device__ __forceinline__ void drain_stream(const TilePlan& p, uint64_t* slot_bars, WeightStream& stream) {
  cp_async_wait<0>();
  for (int s = 0; s + 1 < p.slots; ++s) {
    wait_for_chunk(p.slots, slot_bars, stream);
    stream.read = (stream.read + 1) & (p.slots - 1);
  }
}

// One CTA per 16 * MT rows, or a cluster of p.cluster_size CTAs per row tile:
// then CTA r computes the r-th share of every layer's output columns and
// copies it into every CTA's copy of the layer output (exchange_shares), and
// with p.partial_last the last layer is a sum of per-CTA partial products
// (stored into every CTA, then one cluster barrier).
// kProducts = 3: 3xTF32 (fp32 accuracy); kProducts = 1: plain tf32.
template <int MT, int kProducts>
__global__ void __launch_bounds__(kTileThreads, 1)
    tf32x3_tiled_kernel(const __grid_constant__ EngineArgs a, const __grid_constant__ TilePlan p,
                        const __grid_constant__ TileMaps maps) {
  constexpr int kRows = 16 * MT;
  extern __shared__ float4 smem_f4[];
  float* smem = reinterpret_cast<float*>(smem_f4);
  const int cs = p.cluster_size;
  const bool clustered = cs > 1;
  const int rank = clustered ? cluster_rank() : 0;
  const int row0 = static_cast<int>(blockIdx.x / cs) * kRows;
  const int rows = min(kRows, a.batch - row0);
  const int dim = a.dim;
  const int ld = p.act_ld;
  float* act0 = smem + p.act_offset[0];  // layer-0 input; layer l reads act0 when l is even
  float* act1 = smem + p.act_offset[1];
  float* xcur = smem + p.x_offset;
  // The swizzle is a function of the address: slots start on its period.
  float* stages = smem + p.stage_offset;
  stages += ((kTileSwizzleBytes - (smem_address(stages) & (kTileSwizzleBytes - 1))) & (kTileSwizzleBytes - 1)) /
            sizeof(float);
  int* t0 = reinterpret_cast<int*>(smem + p.t_offset);
  int* valid = reinterpret_cast<int*>(smem + p.valid_offset);
  float* coef = smem + p.coef_offset;
  float* x0_prev = p.x0_prev_offset >= 0 ? smem + p.x0_prev_offset : nullptr;
  float* partials = smem + p.partial_offset;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + p.barrier_offset);
  uint64_t* slot_bars = bars + 2;
  uint32_t parity = 0;  // bit b: parity of the next phase of bars[b] to complete
  const int L = a.num_layers;
  // This CTA's columns of layer 0 (those its bias networks' rows cover).
  const int c0 = rank * p.cta_cols[0];
  BiasNetRows nets(a.bias_rows, smem + p.bias_net_offset, kRows, max(0, min(p.cta_cols[0], a.layers[0].out - c0)),
                   c0);
  // With a split last layer, layer L - 2's outputs stay in their CTA, and the
  // step's first stores into other CTAs are those of layer 0 or, for L == 2,
  // the partial sums.
  const int first_remote_layer = p.partial_last && L == 2 ? 1 : 0;

  // The slots' mbarriers before the first TMA copy (issued by this thread),
  // the exchange's before the cluster barrier below.
  if (threadIdx.x == 0) init_barriers(p, maps, bars, L);
  // Fill all slots but one (overlapping the setup below); each chunk then
  // refills one.
  WeightStream stream = {};
  begin_pass(a, p, rank, stream);
  for (int s = 0; s + 1 < p.slots; ++s) load_chunk(a, p, maps, rank, stages, slot_bars, stream);

  // Zero both buffers: the products read up to the next chunk boundary past a
  // layer's width, where the staged weights are zero; the activations there
  // must be finite. Rows past the batch compute on zeros and are not stored.
  for (int i = threadIdx.x; i < kRows * ld; i += kTileThreads) act0[i] = act1[i] = 0.f;
  __syncthreads();
  static_assert(kRows <= kTileThreads, "one thread per row");
  for (int r = threadIdx.x; r < kRows; r += kTileThreads) {
    bool ok = false;
    t0[r] = r < rows ? load_t_start(a, row0 + r, &ok) : 0;
    valid[r] = ok;
  }
  for (int i = threadIdx.x; i < kRows * dim; i += kTileThreads) {
    const int r = i / dim, j = i - r * dim;
    const float v = r < rows ? __ldg(a.x + static_cast<size_t>(row0) * dim + i) : 0.f;
    xcur[i] = v;
    act0[r * ld + j] = v;
    if (x0_prev != nullptr) x0_prev[i] = 0.f;
  }
  __syncthreads();  // t0 and valid
  // Every CTA of a cluster holds every row; they share the writing by row.
  auto owns = [&](int r) { return r < rows && r % cs == rank; };
  for (int i = threadIdx.x; i < kRows * dim; i += kTileThreads) {
    const int r = i / dim;
    if (owns(r)) store_sample(a, 0, row0 + r, i - r * dim, xcur[i], valid[r]);
  }
  nets.evaluate_cond(a, row0);
  // (the first barrier of the chunk loop publishes the setup; in a cluster,
  // the wait before the first remote store matches this arrival: every CTA
  // has zeroed its buffers before anyone stores into them)
  if (clustered) cluster_arrive();

  for (int k = 0; k < a.num_steps; ++k) {
    // Read in the update, past a CTA barrier; the last step's update read
    // them before the barrier that ended it.
    for (int r = threadIdx.x; r < kRows; r += kTileThreads) {
      const int s = clamp_index(t0[r] - k, a.table_length);
#pragma unroll
      for (int q = 0; q < kStepTablesWithPrevious; ++q) coef[q * kRows + r] = step_coefficient(a.step, q, s);
    }
    if (nets.time_window_starts(k)) nets.evaluate_time(a, k, [&](int r) { return t0[r]; });
    for (int l = 0; l < L; ++l) {
      const bool last = l + 1 == L;
      const bool partial = p.partial_last && last;
      const bool local = p.partial_last && l + 2 == L;
      const TilePass tp{a,
                        p,
                        maps,
                        l,
                        a.layers[l],
                        layer_share(a, p, l, rank),
                        (l & 1) ? act1 : act0,
                        ld,
                        partial ? partials + rank * kRows * p.partial_ld : ((l & 1) ? act0 : act1),
                        partial ? p.partial_ld : ld,
                        stages,
                        slot_bars,
                        rank,
                        last,
                        partial ? cs : 1,
                        clustered && l == first_remote_layer,
                        k,
                        row0,
                        t0,
                        nets};
      for (int pass = 0; pass < tile_passes(p, l); ++pass) {
        switch (p.warp_tiles[l]) {
          case 1:
            tile_pass<MT, kProducts, 1>(tp, pass, stream);
            break;
          case 2:
            tile_pass<MT, kProducts, 2>(tp, pass, stream);
            break;
          case 3:
            tile_pass<MT, kProducts, 3>(tp, pass, stream);
            break;
          default:
            tile_pass<MT, kProducts, 4>(tp, pass, stream);
        }
      }
      // Outputs visible (in every CTA that needs them) before the next layer
      // reads them.
      if (!clustered || local) {
        __syncthreads();
      } else if (partial) {
        cluster_arrive();
        cluster_wait();
      } else {
        const int b = (l & 1) ^ 1;  // the buffer tp.out is
        exchange_shares<kRows>(a, p, l, rank, b ? act1 : act0, ld, bars + b, (parity >> b) & 1u,
                               tp.first_remote);
        parity ^= 1u << b;
      }
    }
    // eps is in act0 or act1 by the parity of the depth, or the sum of the
    // partial sums in rank order; the next input goes to act0 (element-wise,
    // so in place is fine when they coincide).
    const float* eps = (L & 1) ? act1 : act0;
    for (int i = threadIdx.x; i < kRows * dim; i += kTileThreads) {
      const int r = i / dim, j = i - r * dim;
      float e = 0.f;
      if (p.partial_last) {
        for (int q = 0; q < cs; ++q) e += partials[(q * kRows + r) * p.partial_ld + j];
      } else {
        e = eps[r * ld + j];
      }
      const auto coefficient = [&](int q) { return coef[q * kRows + r]; };
      float unused_x0 = 0.f;  // (x0_prev is null only without a P table)
      const float v = step_update(a, coefficient, xcur[i], e, x0_prev != nullptr ? x0_prev + i : &unused_x0, k,
                                  min(row0 + r, a.batch - 1), j);
      xcur[i] = v;
      act0[r * ld + j] = v;
      if (owns(r)) store_sample(a, k + 1, row0 + r, j, v, valid[r]);
    }
    __syncthreads();
    if (clustered) cluster_arrive();  // this CTA's update has read eps
  }
  if (clustered) cluster_wait();  // matches the last arrival
  drain_stream(p, slot_bars, stream);
}

}  // namespace cuda_kernels
}  // namespace ddpm_ops
