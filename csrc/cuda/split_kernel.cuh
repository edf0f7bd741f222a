// The exact fp32 tensor-core kernel of ddpm::fused_sample (from batch 265 in
// every precision, "bf16" excepted where its own kernel runs; Hopper's wgmma,
// compiled only for sm_90a).
//
// split_sample_kernel<kOwn, kCs, kBuffers>: the bf16 kernel's design (wgmma_kernel.cuh:
// 64-row tiles carried through all steps with every activation in registers)
// at fp32 accuracy. Every operand v is held as two bf16 numbers, big =
// bf16(v) and small = bf16(v - big), and every product as three wgmmas:
// big*big + small*big + big*small, accumulated in fp32. That leaves about
// 2^-16 of each operand and the small*small term out, which the fp32
// accumulation of 256-term sums and the fp32 update of x already exceed
// (measured: the same error against float64 as the fp32 kernels, 1.5e-7 at
// the seed shape). SiLU is the bf16 kernel's ex2.approx / rcp.approx form: a
// few ulp, like the cluster kernel's expf and fast division.
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
// Shape envelope (host: split_shape): the bf16 kernel's (dim <= 64, hidden
// widths <= 256, at least 2 layers) and both planes of the CTA's share, plus
// the exchange buffer, within the shared memory (seed shape: 226 KB in
// clusters of 2; in clusters of 4 145 KB, 193 KB with two exchange buffers).
#pragma once

#include "wgmma_kernel.cuh"

namespace ddpm_ops {
namespace cuda_kernels {

constexpr int kSplitThreads = 128;  // one warpgroup: the weights leave no room for a second tile's exchange

// Whether a cluster of kCs reduce-scatters eps (the columns each CTA sums:
// kEpsBlock, 8 accumulators of a thread) rather than sending every partner
// its whole partial sum.
template <int kCs>
constexpr bool kScatterEps = kCs == 4;
constexpr int kEpsBlock = 16;

// Where everything sits in the (1024-byte aligned) shared memory of a CTA
// keeping kOwn columns of each hidden layer in a cluster of cs; host and
// device both use it. Each layer's weights are a big and a small plane in
// the bf16 kernel's swizzled layout.
struct SplitLayout {
  int own;
  int cs;
  int num_layers;
  int buffers = 1;  // exchange buffers, used in turn (ClusterLink)
  __host__ __device__ constexpr int hidden() const { return own * cs; }
  __host__ __device__ constexpr int rows(int l) const { return l + 1 == num_layers ? kWgmmaDimPad : own; }
  __host__ __device__ constexpr int depth(int l) const {
    return l == 0 ? kWgmmaDimPad : (l + 1 == num_layers ? own : hidden());
  }
  __host__ __device__ constexpr int plane_bytes(int l) const { return 2 * rows(l) * depth(l); }
  // Layer l's big plane; its small plane follows it. (Layers 1 to L - 2 are
  // all the same size.)
  __host__ __device__ constexpr int weight_offset(int l) const {
    return l == 0 ? 0 : 2 * plane_bytes(0) + 4 * (l - 1) * own * hidden();
  }
  // 32-bit words a thread receives from one partner per exchange: a hidden
  // block (both planes of kOwn / 16 A fragments) or a partial eps (32 fp32
  // accumulators).
  __host__ __device__ constexpr int exchange_words() const { return own / 2 > 32 ? own / 2 : 32; }
  // Bytes of one partner's slot in the buffer (thread-minor uint4s).
  __host__ __device__ constexpr int slot_bytes() const { return 4 * exchange_words() * kSplitThreads; }
  // The partners' data, cs - 1 slots a buffer; none without a partner.
  __host__ __device__ constexpr int buffer_offset() const {
    return weight_offset(num_layers - 1) + 2 * plane_bytes(num_layers - 1);
  }
  // fp32 biases of this CTA's columns: layer l's at l * own, the last one's 64 wide.
  __host__ __device__ constexpr int buffer_bytes() const { return (cs - 1) * slot_bytes(); }
  __host__ __device__ constexpr int bias_offset() const { return buffer_offset() + buffers * buffer_bytes(); }
  // Layer 0's time column (this CTA's columns), fp32.
  __host__ __device__ constexpr int time_weight_offset() const {
    return bias_offset() + 4 * ((num_layers - 1) * own + kWgmmaDimPad);
  }
  // One mbarrier per warp and buffer: its 32 threads' share of the buffer.
  __host__ __device__ constexpr int barrier_offset() const { return time_weight_offset() + 4 * own; }
  __host__ __device__ constexpr int bytes() const { return barrier_offset() + 8 * buffers * (kSplitThreads / 32); }
};

// bf16 of the column pair (lo, hi), and bf16 of what that leaves of it: the
// big and small planes.
__device__ __forceinline__ void split_bf16(float lo, float hi, uint32_t* big, uint32_t* small) {
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
// bf16(w)) at small, in the bf16 kernel's layout (its stage_net). That loop
// is kept apart, though it is this one without rotation and small plane:
// sharing this function changed the bf16 kernel's register allocation and
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
  for (int i0 = threadIdx.x; i0 < groups; i0 += kStageBatch * kSplitThreads) {
    float v[kStageBatch][8];
#pragma unroll
    for (int b = 0; b < kStageBatch; ++b) {
      const int i = i0 + b * kSplitThreads, n = i / groups_per_row, kk = 8 * (i - n * groups_per_row);
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
      const int i = i0 + b * kSplitThreads, n = i / groups_per_row, k8 = i - n * groups_per_row;
      if (i >= groups) break;
      // The 16-byte chunks of a 128-byte row are permuted by the row's
      // index within its 8-row group.
      const int at = (k8 / 8) * t.rows * 128 + n * 128 + (((k8 % 8) ^ (n & 7)) * 16);
      uint32_t hi[4], lo[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) split_bf16(v[b][2 * e], v[b][2 * e + 1], hi + e, lo + e);
      *reinterpret_cast<uint4*>(big + at) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
      *reinterpret_cast<uint4*>(small + at) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    }
  }
}

// A fragments (both planes) of the values a thread holds in accumulator
// layout: pair i / 2 of v is word i / 2.
template <int N>
__device__ __forceinline__ void split_fragments(const float (&v)[N], uint32_t* big, uint32_t* small) {
#pragma unroll
  for (int i = 0; i < N; i += 2) split_bf16(v[i], v[i + 1], big + i / 2, small + i / 2);
}

// acc[j * kKSplit + kb % kKSplit] += (big, small) fragments kb in [kKb0, kKb1)
// times the weights' columns [64 j, 64 (j + 1)), three products each. The
// weights' planes start at w_big and w_small (`rows` rows, swizzled blocks
// of 64 deep). kKSplit > 1 spreads one chain's products over independent
// accumulators, which the caller adds.
template <int kChains, int kKSplit, int kKb0, int kKb1>
__device__ __forceinline__ void issue_split_products(float (&acc)[kChains * kKSplit][32], const uint32_t* big,
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
      wgmma_m64n64k16(acc[j * kKSplit + kb % kKSplit], big + 4 * kb, wgmma_descriptor(w_big + at), 1);
    }
#pragma unroll
    for (int j = 0; j < kChains; ++j) {
      const uint32_t at = (kb / 4) * rows * 128 + j * kWgmmaCols * 128 + (kb % 4) * 32;
      wgmma_m64n64k16(acc[j * kKSplit + kb % kKSplit], small + 4 * kb, wgmma_descriptor(w_big + at), 1);
    }
#pragma unroll
    for (int j = 0; j < kChains; ++j) {
      const uint32_t at = (kb / 4) * rows * 128 + j * kWgmmaCols * 128 + (kb % 4) * 32;
      wgmma_m64n64k16(acc[j * kKSplit + kb % kKSplit], big + 4 * kb, wgmma_descriptor(w_small + at), 1);
    }
  }
  wgmma_commit();
}

template <int N, int kLen>
__device__ __forceinline__ void wait_products(float (&acc)[N][kLen]) {
  wgmma_wait_all();
#pragma unroll
  for (int j = 0; j < N; ++j) fence_accumulators(acc[j]);
}

__device__ __forceinline__ void st_async(uint32_t cluster_addr, uint4 v, uint32_t cluster_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(
                   cluster_addr),
               "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(cluster_bar)
               : "memory");
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
  static constexpr int kWarps = kSplitThreads / 32;
  uint4* buffer = nullptr;                 // this CTA's first, thread-minor
  uint64_t* bar = nullptr;                 // this warp's mbarrier of the first buffer in this CTA
  uint32_t remote_buffer[kPartners] = {};  // partner r ^ (p + 1)'s slot p of its first buffer, this thread's first uint4
  uint32_t remote_bar[kPartners] = {};     // partner r ^ (p + 1)'s mbarrier of this warp and the first buffer
  int slot_uint4s = 0;                     // a slot's stride in `buffer`
  int buffer_uint4s = 0;                   // a buffer's
  uint32_t exchanges = 0;

  __device__ void connect(char* smem, const SplitLayout& lay, int rank) {
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
        st_async(dst + 16 * v * kSplitThreads, make_uint4(w[4 * v], w[4 * v + 1], w[4 * v + 2], w[4 * v + 3]),
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
        const uint4 w = in[p * slot_uint4s + v * kSplitThreads + threadIdx.x];
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
__device__ __forceinline__ void start_split_layer(float (*acc)[32], const float* bias,
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
    split_fragments(acc[j], big + 16 * j, small + 16 * j);
  }
}

// Copies this CTA's share of the net into shared memory: both planes of its
// weights (zero wherever the padding reaches), its biases and time column;
// with kScatter x's, eps's and layer 0's inner blocks of kEpsBlock permuted;
// kStageBatch: stage_weight_tile's.
template <int kOwn, int kCs, bool kScatter = kScatterEps<kCs>, int kStageBatch = 4>
__device__ __forceinline__ void stage_split_net(const SampleArgs& a, const SplitLayout& lay, char* smem, int rank) {
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
    for (int n = threadIdx.x; n < tile.rows; n += kSplitThreads) {
      // The output layer's bias goes into rank 0's partial sum only (whose
      // blocks are not permuted).
      const int col = tile.row0 + n;
      bias[l * kOwn + n] = col < la.out && (!last || rank == 0) ? __ldg(la.bias + col) : 0.f;
    }
  }
  float* time_weight = reinterpret_cast<float*>(smem + lay.time_weight_offset());
  const LayerArgs& first = a.layers[0];
  for (int n = threadIdx.x; n < kOwn; n += kSplitThreads) {
    const int col = rank * kOwn + n;
    time_weight[n] = col < first.out ? __ldg(first.weight + static_cast<size_t>(col) * first.in + a.dim) : 0.f;
  }
}

// All steps for the 64-row tile at row0 (shared by the kCs CTAs of the cluster).
template <int kOwn, int kCs, int kBuffers>
__device__ __forceinline__ void run_split_tile(const SampleArgs& a, const SplitLayout& lay, const char* smem,
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
      split_fragments(x, x_big, x_small);
      float acc[kChains][32];
      start_split_layer<kChains>(acc, bias, time_weight, tn, q);
      issue_split_products<kChains, 1, 0, kWgmmaDimPad / 16>(acc, x_big, x_small, big_plane(0), small_plane(0),
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
      start_split_layer<kChains>(acc, bias + l * kOwn, nullptr, tn, q);
      issue_split_products<kChains, 1, 0, kOwn / 16>(acc, big, small, big_plane(l), small_plane(l), kOwn);
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
        issue_split_products<kChains, 1, kOwn / 16, kH / 16>(acc, big, small, big_plane(l), small_plane(l), kOwn);
      }
      wait_products(acc);
      finish_hidden_layer<kChains>(acc, big, small);
    }
    // The output layer over this CTA's inner block: a partial eps.
    float part[2][32];
    start_split_layer<1>(part, bias + (L - 1) * kOwn, nullptr, tn, q);
#pragma unroll
    for (int i = 0; i < 32; ++i) part[1][i] = 0.f;
    issue_split_products<1, 2, 0, kOwn / 16>(part, big, small, big_plane(L - 1), small_plane(L - 1),
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
__global__ void __launch_bounds__(kSplitThreads, 1) split_sample_kernel(const __grid_constant__ SampleArgs a) {
  static_assert(kCs == 1 || kCs == 2 || kCs == 4, "the partners r ^ p and the eps exchange need 1, 2 or 4");
  static_assert(!kScatterEps<kCs> || kEpsBlock * kCs == kWgmmaDimPad, "a block of eps per CTA");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const SplitLayout lay{kOwn, kCs, a.num_layers, kBuffers};
  char* smem = aligned_shared_memory(lay);
  const int rank = kCs > 1 ? static_cast<int>(cg::this_cluster().block_rank()) : 0;
  stage_split_net<kOwn, kCs>(a, lay, smem, rank);
  fence_proxy_async();  // the generic-proxy stores above, before wgmma reads them
  ClusterLink<kCs, kBuffers> link;
  if constexpr (kCs > 1) {
    link.connect(smem, lay, rank);
    if (threadIdx.x % 32 == 0) {
      for (int b = 0; b < kBuffers; ++b) mbarrier_init(link.barrier(b), 1);
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    // Every CTA running, with its mbarriers initialized, before anyone sends.
    cluster_arrive();
    cluster_wait();
  } else {
    __syncthreads();
  }
  const int tiles = (a.batch + kWgmmaRows - 1) / kWgmmaRows;
  const int clusters = gridDim.x / kCs;
  for (int tile = blockIdx.x / kCs; tile < tiles; tile += clusters) {
    run_split_tile<kOwn, kCs, kBuffers>(a, lay, smem, link, rank, tile * kWgmmaRows);
    if constexpr (kCs > 1) link.end_tile();
  }
  if constexpr (kCs > 1) link.finish();
#endif
}

}  // namespace cuda_kernels
}  // namespace ddpm_ops
