// Device code of ddpm::fused_sample on CUDA: two kernels, no torch headers
// (so they compile-check standalone). fused_sample_cuda.cu picks one per call.
//
// cluster_sample_kernel (small and medium batch, exact fp32): a thread-block
//   cluster of up to 16 CTAs runs a tile of rows through all steps. CTA r owns
//   a slice of every layer's output neurons and keeps that slice of the weights
//   in shared memory for the whole call; each layer's outputs are pushed into
//   every CTA's shared memory (distributed shared memory) and one cluster
//   barrier per layer publishes them. The latency of a layer is one split-K dot
//   product per thread plus a warp-shuffle reduction plus one barrier.
//
// tiled_sample_kernel (large batch): each CTA owns 16*MT rows for all steps,
//   activations stay in shared memory, weights stream from L2 through a
//   double-buffered cp.async stage, and the products run on tensor cores:
//   mma.sync m16n8k8 tf32, three of them per product (3xTF32: big*big +
//   big*small + small*big) for fp32 accuracy, one for the opt-in fast modes.
#pragma once

#include <cooperative_groups.h>
#include <cstdint>

namespace ddpm_ops {
namespace cuda_kernels {

namespace cg = cooperative_groups;

// The schema allows any depth; kernel arguments carry a fixed-size table.
constexpr int kMaxLayers = 32;

struct LayerArgs {
  const float* weight;  // (out, in), row-major, global memory
  const float* bias;    // (out,)
  int in;
  int out;
};

struct SampleArgs {
  LayerArgs layers[kMaxLayers];
  int num_layers;
  const float* x;          // (batch, dim) contiguous
  const void* t_start;     // (batch,) int32 or int64
  bool t_is_int64;
  const float* sqrt_recip_alphas;
  const float* coef_eps;
  int table_length;
  float* out;              // (batch, dim) contiguous
  int batch;
  int dim;
  int num_steps;
  float total_timesteps;
};

// Loads t_start[row], reporting whether every timestep t_start - k, k < steps,
// indexes the tables. The returned start is clamped into [-1, table_length] so
// that later int arithmetic cannot overflow; reads clamp again per step.
__device__ __forceinline__ int load_t_start(const SampleArgs& a, int row, bool* valid) {
  const long long t = a.t_is_int64 ? static_cast<const long long*>(a.t_start)[row]
                                   : static_cast<long long>(static_cast<const int*>(a.t_start)[row]);
  *valid = t < a.table_length && t >= static_cast<long long>(a.num_steps) - 1;
  return static_cast<int>(t < -1 ? -1 : (t > a.table_length ? a.table_length : t));
}

__device__ __forceinline__ int clamp_index(int t, int length) {
  return t < 0 ? 0 : (t >= length ? length - 1 : t);
}

// Same formula as the CPU kernel (and F.silu): v * sigmoid(v).
__device__ __forceinline__ float silu(float v) { return v / (1.f + expf(-v)); }

// ---------------------------------------------------------------------------
// Cluster kernel
// ---------------------------------------------------------------------------

constexpr int kClusterThreads = 256;

// Shared-memory layout of one CTA (offsets in floats, multiples of 4 so that
// rows can be read as float4) and the work split, computed on the host
// (fused_sample_cuda.cu) so every CTA agrees.
struct ClusterPlan {
  int cluster_size;
  int rows_per_tile;
  int in0_ld;                    // round_up(dim + 1, 4)
  int hidden_ld;                 // round_up(widest hidden layer, 4)
  int weight_offset[kMaxLayers]; // slice of layer l in shared memory (row stride
                                 // round_up(in, 4), zero padded), or -1: global
  int bias_offset[kMaxLayers];   // its bias slice in shared memory (with the weights)
  int last_weight_offset;        // the whole last layer (padded rows), or -1: sliced
  int last_bias_offset;          // and its whole bias
  int in0_offset;                // rows x in0_ld: [x, t / T], the input of layer 0
  int hidden_offset[2];          // rows x hidden_ld, hidden outputs alternate between them
  int eps_offset[2];             // rows x dim, outputs of the last layer, by step parity
  int x_offset;                  // rows x dim, the current sample
  int coef_offset;               // rows x 2: this step's (c1, c2)
  int t_offset;                  // rows ints: clamped t_start
  int valid_offset;              // rows ints: 1 when every timestep is in range
};

__host__ __device__ inline int slice_size(int out, int cluster_size) {
  return (out + cluster_size - 1) / cluster_size;
}
__host__ __device__ inline int round_up4(int v) { return (v + 3) & ~3; }

// One layer's slice on one CTA: out_all[r][n0 + c] = act(bias + in[r] . w[c])
// for rows r < rows, slice columns c < ns, written into every CTA's out buffer.
// Each output tile (RT rows x CT columns) is computed by G consecutive lanes
// that split the inner dimension and reduce with shuffles; G is as large as
// the thread count allows, which keeps small-batch layers short.
// kVec: weight rows of stride round_up4(K), read as float4 along k (four
// times fewer load instructions): the padded copy in shared memory, or global
// weights when K % 4 == 0 and they are 16-byte aligned (a generic pointer
// serves both); otherwise scalar reads of the global weights (row stride K).
// local_only: this CTA computes the whole
// layer for itself and stores only into its own shared memory.
template <int RT, int CT, bool kVec>
__device__ __forceinline__ void cluster_layer(cg::cluster_group& cluster, const float* in, int in_ld,
                                              const float* w, const float* bias, int K, int rows,
                                              int ns, int n0, bool apply_silu, float* out,
                                              int out_ld, int cluster_size, bool local_only) {
  const int tiles_c = (ns + CT - 1) / CT;
  const int ntiles = ((rows + RT - 1) / RT) * tiles_c;
  if (ntiles == 0) return;
  const int steps_k = kVec ? round_up4(K) / 4 : K;
  const int w_ld = kVec ? round_up4(K) : K;
  int G = 32;
  while (G > 1 && (ntiles * G > kClusterThreads || G / 2 >= steps_k)) G >>= 1;
  const int lane_g = threadIdx.x & (G - 1);
  const int groups = kClusterThreads / G;
  const int warp_first_group = (threadIdx.x & ~31) / G;
  // Whole warps iterate together (the shuffles need every lane); a group past
  // the last tile computes a clamped duplicate and stores nothing.
  for (int base = 0; base + warp_first_group < ntiles; base += groups) {
    const int tile = base + threadIdx.x / G;
    const bool tile_ok = tile < ntiles;
    const int tc = (tile_ok ? tile : 0) % tiles_c;
    const int tr = (tile_ok ? tile : 0) / tiles_c;
    const float* a_row[RT];
    const float* w_row[CT];
#pragma unroll
    for (int i = 0; i < RT; ++i) a_row[i] = in + min(tr * RT + i, rows - 1) * in_ld;
#pragma unroll
    for (int j = 0; j < CT; ++j) w_row[j] = w + min(tc * CT + j, ns - 1) * w_ld;
    float acc[RT][CT];
#pragma unroll
    for (int i = 0; i < RT; ++i)
#pragma unroll
      for (int j = 0; j < CT; ++j) acc[i][j] = 0.f;
#pragma unroll 4
    for (int k = lane_g; k < steps_k; k += G) {
      if (kVec) {
        float4 a4[RT], b4[CT];
#pragma unroll
        for (int i = 0; i < RT; ++i) a4[i] = reinterpret_cast<const float4*>(a_row[i])[k];
#pragma unroll
        for (int j = 0; j < CT; ++j) b4[j] = reinterpret_cast<const float4*>(w_row[j])[k];
#pragma unroll
        for (int i = 0; i < RT; ++i)
#pragma unroll
          for (int j = 0; j < CT; ++j) {
            acc[i][j] = fmaf(a4[i].x, b4[j].x, acc[i][j]);
            acc[i][j] = fmaf(a4[i].y, b4[j].y, acc[i][j]);
            acc[i][j] = fmaf(a4[i].z, b4[j].z, acc[i][j]);
            acc[i][j] = fmaf(a4[i].w, b4[j].w, acc[i][j]);
          }
      } else {
        float a1[RT], b1[CT];
#pragma unroll
        for (int i = 0; i < RT; ++i) a1[i] = a_row[i][k];
#pragma unroll
        for (int j = 0; j < CT; ++j) b1[j] = __ldg(w_row[j] + k);
#pragma unroll
        for (int i = 0; i < RT; ++i)
#pragma unroll
          for (int j = 0; j < CT; ++j) acc[i][j] = fmaf(a1[i], b1[j], acc[i][j]);
      }
    }
#pragma unroll
    for (int i = 0; i < RT; ++i)
#pragma unroll
      for (int j = 0; j < CT; ++j)
        for (int off = G / 2; off > 0; off >>= 1)
          acc[i][j] += __shfl_xor_sync(0xffffffffu, acc[i][j], off);
    // Every lane of the group now holds the sums; the lanes share the remote
    // stores (one destination CTA each).
#pragma unroll
    for (int i = 0; i < RT; ++i) {
#pragma unroll
      for (int j = 0; j < CT; ++j) {
        const int r = tr * RT + i;
        const int c = tc * CT + j;
        if (!tile_ok || r >= rows || c >= ns) continue;
        float v = acc[i][j] + bias[c];
        if (apply_silu) v = silu(v);
        float* local = out + r * out_ld + n0 + c;
        if (local_only) {
          if (lane_g == 0) *local = v;
        } else {
          for (int d = lane_g; d < cluster_size; d += G) *cluster.map_shared_rank(local, d) = v;
        }
      }
    }
  }
}

// dst[r * ld + k] = src[r * width + k] for r < rows, k < width; zero for
// width <= k < ld. Each thread issues a batch of independent loads before its
// stores, so many loads are in flight (the copy sits on the latency path of a
// small-batch call).
__device__ __forceinline__ void copy_padded_rows(float* dst, const float* src, int rows, int width,
                                                 int ld) {
  constexpr int kBatch = 8;
  const int count = rows * ld;
  for (int base = threadIdx.x; base < count; base += kBatch * kClusterThreads) {
    float v[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = base + u * kClusterThreads;
      const int r = i / ld, k = i - r * ld;
      v[u] = i < count && k < width ? __ldg(src + r * width + k) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = base + u * kClusterThreads;
      if (i < count) dst[i] = v[u];
    }
  }
}

template <int RT, int CT>
__global__ void __launch_bounds__(kClusterThreads, 1)
    cluster_sample_kernel(const __grid_constant__ SampleArgs a, const __grid_constant__ ClusterPlan p) {
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

  // This CTA's weight slices: rows [n0, n0 + ns) of each layer, copied once
  // with rows padded to a multiple of 4 by zeros, and their biases.
  for (int l = 0; l < L; ++l) {
    if (p.weight_offset[l] < 0) continue;
    const LayerArgs& la = a.layers[l];
    const int s = slice_size(la.out, cs);
    const int n0 = rank * s;
    const int ns = max(0, min(s, la.out - n0));
    const int ld = round_up4(la.in);
    copy_padded_rows(smem + p.weight_offset[l], la.weight + static_cast<size_t>(n0) * la.in, ns,
                     la.in, ld);
    copy_padded_rows(smem + p.bias_offset[l], la.bias + n0, 1, ns, ns);
  }
  if (p.last_weight_offset >= 0) {
    const LayerArgs& la = a.layers[L - 1];
    copy_padded_rows(smem + p.last_weight_offset, la.weight, la.out, la.in, round_up4(la.in));
    copy_padded_rows(smem + p.last_bias_offset, la.bias, 1, la.out, la.out);
  }
  // Zero the layer inputs: float4 reads cover the padding columns, which
  // must hold finite values (the weights there are zero).
  for (int i = threadIdx.x; i < p.hidden_offset[1] + p.rows_per_tile * p.hidden_ld - p.in0_offset;
       i += kClusterThreads)
    in0[i] = 0.f;
  __syncthreads();
  for (int r = threadIdx.x; r < rows; r += kClusterThreads) {
    bool ok;
    t0[r] = load_t_start(a, row0 + r, &ok);
    valid[r] = ok;
    in0[r * in0_ld + dim] = static_cast<float>(t0[r]) / a.total_timesteps;
  }
  for (int i = threadIdx.x; i < rows * dim; i += kClusterThreads) {
    const int r = i / dim, j = i - r * dim;
    const float v = __ldg(a.x + static_cast<size_t>(row0) * dim + i);
    xcur[i] = v;
    in0[r * in0_ld + j] = v;
  }
  // Every CTA of the cluster must be running before anyone stores into its
  // shared memory; this also publishes the local setup to the CTA's threads.
  cluster.sync();

  for (int k = 0; k < a.num_steps; ++k) {
    // This step's coefficients, loaded now so that their latency hides behind
    // the layers (the layer barriers make them visible to the update).
    for (int r = threadIdx.x; r < rows; r += kClusterThreads) {
      const int t = clamp_index(t0[r] - k, a.table_length);
      coef[2 * r] = __ldg(a.sqrt_recip_alphas + t);
      coef[2 * r + 1] = __ldg(a.coef_eps + t);
    }
    const float* in = in0;
    int in_ld = in0_ld;
    const bool replicated = p.last_weight_offset >= 0;
    float* eps = smem + p.eps_offset[replicated ? 0 : k & 1];
    for (int l = 0; l < L; ++l) {
      const LayerArgs& la = a.layers[l];
      const bool last = l + 1 == L;
      if (last && replicated) {
        // The whole last layer on every CTA: saves one cluster barrier a step.
        cluster_layer<RT, CT, true>(cluster, in, in_ld, smem + p.last_weight_offset,
                                    smem + p.last_bias_offset, la.in, rows, la.out, 0, false, eps,
                                    dim, cs, true);
        __syncthreads();
        break;
      }
      const int s = slice_size(la.out, cs);
      const int n0 = rank * s;
      const int ns = max(0, min(s, la.out - n0));
      // Hidden outputs alternate between two buffers across layers and steps.
      float* out = last ? eps : smem + p.hidden_offset[(k * (L - 1) + l) & 1];
      const int out_ld = last ? dim : p.hidden_ld;
      const float* w_global = la.weight + static_cast<size_t>(n0) * la.in;
      if (p.weight_offset[l] >= 0) {
        cluster_layer<RT, CT, true>(cluster, in, in_ld, smem + p.weight_offset[l],
                                    smem + p.bias_offset[l], la.in, rows, ns, n0, !last, out,
                                    out_ld, cs, false);
      } else if (la.in % 4 == 0 && (reinterpret_cast<uintptr_t>(la.weight) & 15) == 0) {
        cluster_layer<RT, CT, true>(cluster, in, in_ld, w_global, la.bias + n0, la.in, rows, ns,
                                    n0, !last, out, out_ld, cs, false);
      } else {
        cluster_layer<RT, CT, false>(cluster, in, in_ld, w_global, la.bias + n0, la.in, rows, ns,
                                     n0, !last, out, out_ld, cs, false);
      }
      // Publishes this layer's outputs everywhere. A buffer is written again
      // only two barriers after it was written, and every CTA has finished
      // reading it before it arrives at the second: this one barrier per layer
      // also orders all reads before the next remote write.
      cluster.sync();
      in = out;
      in_ld = out_ld;
    }
    // x <- c1 * (x - c2 * eps), redundantly on every CTA (cheaper than another
    // exchange), and the next step's layer-0 input.
    for (int i = threadIdx.x; i < rows * dim; i += kClusterThreads) {
      const int r = i / dim, j = i - r * dim;
      const float v = coef[2 * r] * (xcur[i] - coef[2 * r + 1] * eps[i]);
      xcur[i] = v;
      in0[r * in0_ld + j] = v;
    }
    for (int r = threadIdx.x; r < rows; r += kClusterThreads)
      in0[r * in0_ld + dim] = static_cast<float>(t0[r] - (k + 1)) / a.total_timesteps;
    __syncthreads();
  }

  // Every CTA holds the result; they share the writing by row.
  for (int r = rank; r < rows; r += cs) {
    float* dst = a.out + static_cast<size_t>(row0 + r) * dim;
    const float nan = __int_as_float(0x7fc00000);
    for (int j = threadIdx.x; j < dim; j += kClusterThreads)
      dst[j] = valid[r] ? xcur[r * dim + j] : nan;
  }
}

// ---------------------------------------------------------------------------
// Tiled tensor-core kernel
// ---------------------------------------------------------------------------

constexpr int kTileThreads = 256;          // 8 warps
constexpr int kTileWarpCols = 32;          // each warp: all rows x 32 output columns
constexpr int kTilePassCols = 8 * kTileWarpCols;  // output columns per pass
constexpr int kTileKChunk = 32;            // inner-dimension chunk per stage
constexpr int kTileStageLd = kTileKChunk + 4;     // == 4 mod 32: conflict-free fragments
constexpr int kTileStageFloats = kTilePassCols * kTileStageLd;

struct TilePlan {
  int act_ld;          // == 4 mod 32, >= every width rounded up to kTileKChunk
  int act_offset[2];   // rows x act_ld each
  int x_offset;        // rows x dim
  int stage_offset;    // 2 stages
  int t_offset;
  int valid_offset;
  bool vec4[kMaxLayers];  // weight rows 16-byte aligned: copy with 16-byte cp.async
};

__device__ __forceinline__ void cp_async4(float* dst, const float* src, bool pred) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(src), "r"(pred ? 4 : 0));
}
__device__ __forceinline__ void cp_async16(float* dst, const float* src, bool pred) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(pred ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ uint32_t to_tf32(float v) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(v));
  return r;
}

__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The weight stream is the same for every step: (layer, pass, chunk) in
// order. Walking it as one sequence lets the copy of the next chunk, even the
// next layer's first, overlap the current chunk's products.
struct ChunkCursor {
  int layer, pass, chunk;
  __device__ void advance(const SampleArgs& a) {
    const LayerArgs& la = a.layers[layer];
    if (++chunk < (la.in + kTileKChunk - 1) / kTileKChunk) return;
    chunk = 0;
    if (++pass < (la.out + kTilePassCols - 1) / kTilePassCols) return;
    pass = 0;
    if (++layer == a.num_layers) layer = 0;
  }
};

// Stage <- W[pass cols, chunk k-range] as [n][k], zero outside the matrix.
__device__ __forceinline__ void load_chunk(const SampleArgs& a, const TilePlan& p, const ChunkCursor& c,
                                           float* stage) {
  const LayerArgs& la = a.layers[c.layer];
  const int n_base = c.pass * kTilePassCols;
  const int k_base = c.chunk * kTileKChunk;
  if (p.vec4[c.layer]) {
    for (int i = threadIdx.x; i < kTilePassCols * (kTileKChunk / 4); i += kTileThreads) {
      const int n = i / (kTileKChunk / 4), k = (i % (kTileKChunk / 4)) * 4;
      const bool ok = n_base + n < la.out && k_base + k < la.in;
      const float* src = ok ? la.weight + static_cast<size_t>(n_base + n) * la.in + k_base + k : la.weight;
      cp_async16(stage + n * kTileStageLd + k, src, ok);
    }
  } else {
    for (int i = threadIdx.x; i < kTilePassCols * kTileKChunk; i += kTileThreads) {
      const int n = i / kTileKChunk, k = i % kTileKChunk;
      const bool ok = n_base + n < la.out && k_base + k < la.in;
      const float* src = ok ? la.weight + static_cast<size_t>(n_base + n) * la.in + k_base + k : la.weight;
      cp_async4(stage + n * kTileStageLd + k, src, ok);
    }
  }
  cp_async_commit();
}

// kSplit = 3: 3xTF32 (fp32 accuracy); kSplit = 1: plain tf32.
template <int MT, int kSplit>
__global__ void __launch_bounds__(kTileThreads, 1)
    tiled_sample_kernel(const __grid_constant__ SampleArgs a, const __grid_constant__ TilePlan p) {
  constexpr int kRows = 16 * MT;
  extern __shared__ float4 smem_f4[];
  float* smem = reinterpret_cast<float*>(smem_f4);
  const int row0 = blockIdx.x * kRows;
  const int rows = min(kRows, a.batch - row0);
  const int dim = a.dim;
  const int ld = p.act_ld;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t4 = lane & 3;
  float* act0 = smem + p.act_offset[0];  // layer-0 input; layer l reads act0 when l is even
  float* act1 = smem + p.act_offset[1];
  float* xcur = smem + p.x_offset;
  float* stages = smem + p.stage_offset;
  int* t0 = reinterpret_cast<int*>(smem + p.t_offset);
  int* valid = reinterpret_cast<int*>(smem + p.valid_offset);

  ChunkCursor cursor{0, 0, 0};
  int stage = 0;
  load_chunk(a, p, cursor, stages);  // overlaps the setup below

  // Zero both buffers: the products read up to the next chunk boundary past a
  // layer's width, where the staged weights are zero; the activations there
  // must be finite. Rows past the batch compute on zeros and are not stored.
  for (int i = threadIdx.x; i < kRows * ld; i += kTileThreads) act0[i] = act1[i] = 0.f;
  __syncthreads();
  for (int r = threadIdx.x; r < kRows; r += kTileThreads) {
    bool ok = false;
    t0[r] = r < rows ? load_t_start(a, row0 + r, &ok) : 0;
    valid[r] = ok;
    act0[r * ld + dim] = static_cast<float>(t0[r]) / a.total_timesteps;
  }
  for (int i = threadIdx.x; i < kRows * dim; i += kTileThreads) {
    const int r = i / dim, j = i - r * dim;
    const float v = r < rows ? __ldg(a.x + static_cast<size_t>(row0) * dim + i) : 0.f;
    xcur[i] = v;
    act0[r * ld + j] = v;
  }
  // (the first barrier of the chunk loop publishes the setup)

  for (int k = 0; k < a.num_steps; ++k) {
    for (int l = 0; l < a.num_layers; ++l) {
      const LayerArgs& la = a.layers[l];
      const bool last = l + 1 == a.num_layers;
      const float* in = (l & 1) ? act1 : act0;
      float* out = (l & 1) ? act0 : act1;
      const int nchunks = (la.in + kTileKChunk - 1) / kTileKChunk;
      const int npasses = (la.out + kTilePassCols - 1) / kTilePassCols;
      for (int pass = 0; pass < npasses; ++pass) {
        const int warp_n = pass * kTilePassCols + warp * kTileWarpCols;
        const bool warp_active = warp_n < la.out;  // warp-uniform
        float acc[MT][4][4];
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
          for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.f;
        for (int chunk = 0; chunk < nchunks; ++chunk) {
          // Prefetch the next chunk of the stream into the other stage; that
          // stage was last read before the trailing barrier of the previous
          // iteration.
          cursor.advance(a);
          load_chunk(a, p, cursor, stages + (stage ^ 1) * kTileStageFloats);
          cp_async_wait<1>();
          __syncthreads();
          const float* ws = stages + stage * kTileStageFloats + warp * kTileWarpCols * kTileStageLd;
          if (warp_active) {
#pragma unroll
            for (int ks = 0; ks < kTileKChunk / 8; ++ks) {
              const int kc = chunk * kTileKChunk + ks * 8;
              uint32_t a_big[MT][4], a_small[MT][4];
#pragma unroll
              for (int m = 0; m < MT; ++m) {
                const float* base = in + (m * 16 + g) * ld + kc + t4;
                const float v[4] = {base[0], base[8 * ld], base[4], base[8 * ld + 4]};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                  a_big[m][e] = to_tf32(v[e]);
                  if (kSplit == 3) a_small[m][e] = to_tf32(v[e] - __uint_as_float(a_big[m][e]));
                }
              }
#pragma unroll
              for (int n = 0; n < 4; ++n) {
                const float* wb = ws + (n * 8 + g) * kTileStageLd + ks * 8 + t4;
                const float v[2] = {wb[0], wb[4]};
                uint32_t b_big[2], b_small[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                  b_big[e] = to_tf32(v[e]);
                  if (kSplit == 3) b_small[e] = to_tf32(v[e] - __uint_as_float(b_big[e]));
                }
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                  if (kSplit == 3) {
                    mma_tf32(acc[m][n], a_small[m], b_big);
                    mma_tf32(acc[m][n], a_big[m], b_small);
                  }
                  mma_tf32(acc[m][n], a_big[m], b_big);
                }
              }
            }
          }
          __syncthreads();
          stage ^= 1;
        }
        if (warp_active) {
#pragma unroll
          for (int n = 0; n < 4; ++n) {
            const int col = warp_n + n * 8 + 2 * t4;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              if (col + e >= la.out) continue;
              const float b = __ldg(la.bias + col + e);
#pragma unroll
              for (int m = 0; m < MT; ++m) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                  float v = acc[m][n][2 * h + e] + b;
                  if (!last) v = silu(v);
                  out[(m * 16 + g + 8 * h) * ld + col + e] = v;
                }
              }
            }
          }
        }
      }
      __syncthreads();  // outputs visible before the next layer reads them
    }
    // eps is in act0 or act1 by the parity of the depth; the next input goes
    // to act0 (element-wise, so in place is fine when they coincide).
    const float* eps = (a.num_layers & 1) ? act1 : act0;
    for (int i = threadIdx.x; i < kRows * dim; i += kTileThreads) {
      const int r = i / dim, j = i - r * dim;
      const int t = clamp_index(t0[r] - k, a.table_length);
      const float c1 = __ldg(a.sqrt_recip_alphas + t);
      const float c2 = __ldg(a.coef_eps + t);
      const float v = c1 * (xcur[i] - c2 * eps[r * ld + j]);
      xcur[i] = v;
      act0[r * ld + j] = v;
    }
    for (int r = threadIdx.x; r < kRows; r += kTileThreads)
      act0[r * ld + dim] = static_cast<float>(t0[r] - (k + 1)) / a.total_timesteps;
    __syncthreads();
  }
  cp_async_wait<0>();  // the last prefetch, unused, must land before exit

  const float nan = __int_as_float(0x7fc00000);
  for (int i = threadIdx.x; i < rows * dim; i += kTileThreads) {
    const int r = i / dim;
    a.out[static_cast<size_t>(row0) * dim + i] = valid[r] ? xcur[i] : nan;
  }
}

}  // namespace cuda_kernels
}  // namespace ddpm_ops
