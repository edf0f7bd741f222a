// Device code of ddpm::fused_sample on CUDA: two kernels, no torch headers
// (so they compile-check standalone). fused_sample_cuda.cu picks one per call
// (or the bf16 kernel of wgmma_kernel.cuh).
//
// cluster_sample_kernel (small and medium batch, exact fp32): a thread-block
//   cluster of up to 16 CTAs runs a tile of rows through all steps. CTA r owns
//   a slice of every layer's output neurons and keeps that slice of the weights
//   in shared memory for the whole call. Each warp reduces its outputs with a
//   transposing shuffle butterfly and stores them straight into every CTA's
//   shared memory with st.async, which completes on the receiver's mbarrier;
//   a CTA waits only for the bytes it needs, so there is no cluster-wide
//   barrier per layer, nor a CTA barrier. The latency of a layer is one
//   split-K dot product per lane, 5 levels of shuffles and one one-way trip
//   through distributed shared memory.
// tiled_sample_kernel (large batch, and medium batch for nets too big for the
//   cluster kernel's shared memory): a row tile of 16*MT rows stays in shared
//   memory for all steps, weights stream from L2 through a ring of chunks
//   (one TMA tensor copy each, or cp.async where TMA cannot address the
//   layer), and the products run on tensor cores: mma.sync m16n8k8 tf32,
//   three of them per product (3xTF32: big*big + big*small + small*big) for
//   fp32 accuracy, one for the opt-in fast modes. A cluster of CTAs may share
//   a row tile, each computing a share of every layer's columns and sending
//   it to all of them with the bulk-copy engine (completing on mbarriers); the
//   last layer is then split over its inner dimension instead, so the layer
//   before it is never exchanged and only small partial sums are.
#pragma once

#include <cooperative_groups.h>
#include <cuda.h>  // CUtensorMap
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

// Row threadIdx.x's DDPM coefficients (c1, c2), loaded one step ahead so that
// their global-memory latency hides behind the layers (threads past the
// tile's rows hold none).
struct CoefPrefetch {
  bool active;
  float c1 = 0.f, c2 = 0.f;
  __device__ CoefPrefetch(const SampleArgs& a, const int* t0, int rows)
      : active(static_cast<int>(threadIdx.x) < rows) {
    if (active) load(a, t0[threadIdx.x]);
  }
  __device__ void load(const SampleArgs& a, int t) {
    t = clamp_index(t, a.table_length);
    c1 = __ldg(a.sqrt_recip_alphas + t);
    c2 = __ldg(a.coef_eps + t);
  }
  // coef[2 * row .. + 1] <- step k's (c1, c2); then loads step k + 1's.
  __device__ void publish(const SampleArgs& a, const int* t0, float* coef, int k) {
    if (!active) return;
    coef[2 * threadIdx.x] = c1;
    coef[2 * threadIdx.x + 1] = c2;
    if (k + 1 < a.num_steps) load(a, t0[threadIdx.x] - (k + 1));
  }
};

// Same formula as the CPU kernel (and F.silu): v * sigmoid(v). The fast
// division (2 ulp) skips IEEE division's slow-path branch; it returns 0 once
// the denominator passes 2^126, where silu(v) is below 1e-36 anyway.
__device__ __forceinline__ float silu(float v) { return __fdividef(v, 1.f + expf(-v)); }
// v * sigmoid(v) from the hardware's approximate exp2 and reciprocal (about
// 1e-6 relative, a few ulp: the exact kernels' errors against float64 stay
// at 1.5e-7; the bf16 rounding of the wgmma kernel is 500 times coarser),
// a third of the instructions of the exact-rounding formula. Large -v:
// 1 / inf = 0, so v * 0 = 0, as it should.
__device__ __forceinline__ float silu_approx(float v) {
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(v * -1.4426950408889634f));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.f + e));
  return v * r;
}

// ---------------------------------------------------------------------------
// Asynchronous copies and cluster messages (sm_90 PTX)
// ---------------------------------------------------------------------------

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

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// The shared-memory address `local` of this CTA, in CTA `rank` of the cluster.
__device__ __forceinline__ uint32_t cluster_address(uint32_t local, int rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(bar)), "r"(arrivals)
               : "memory");
}
// This thread's arrival on this CTA's own mbarrier, announcing the bytes that
// copies into this CTA will complete on it (its TMA copy, the bulk copies of
// the other CTAs, or the cluster's st.async stores). CTA scope: only this CTA
// waits on it.
__device__ __forceinline__ void mbarrier_expect_local(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void st_async(uint32_t cluster_addr, float v, uint32_t cluster_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n" ::"r"(
                   cluster_addr),
               "r"(__float_as_uint(v)), "r"(cluster_bar)
               : "memory");
}
// dst (in the shared memory of a CTA of the cluster) <- `bytes` (a multiple
// of 16) of this CTA's shared memory at src, by the bulk-copy engine; the
// bytes complete on the receiver's mbarrier. The writes that src holds must
// have been ordered before it with fence_proxy_async (and a CTA barrier).
__device__ __forceinline__ void bulk_copy_to_cluster(uint32_t dst, const void* src, uint32_t bytes,
                                                     uint32_t cluster_bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
      "r"(smem_address(src)), "r"(bytes), "r"(cluster_bar)
      : "memory");
}
// dst (this CTA's shared memory) <- the box of `map` at coordinates (k, n),
// by the TMA unit; the bytes complete on this CTA's mbarrier at bar, which
// must expect them (the whole box, zero-filled parts included).
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int k, int n, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(k), "r"(n), "r"(bar)
      : "memory");
}
// Orders this thread's earlier shared-memory writes before later reads of
// the asynchronous proxy (the bulk-copy engine).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Plain stores into the shared memory of a CTA of the cluster (ordered by
// the next cluster barrier's release).
__device__ __forceinline__ void st_cluster(uint32_t cluster_addr, float v) {
  asm volatile("st.shared::cluster.f32 [%0], %1;\n" ::"r"(cluster_addr), "f"(v) : "memory");
}
__device__ __forceinline__ void st_cluster(uint32_t cluster_addr, float4 v) {
  asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(cluster_addr), "f"(v.x), "f"(v.y),
               "f"(v.z), "f"(v.w)
               : "memory");
}
// Waits until the phase of `bar` with this parity has completed. CTA scope:
// every phase waited for here completes by data landing in this CTA's shared
// memory (TMA copies, bulk copies and st.async from the cluster), which the
// completion itself makes visible; a cluster-scope acquire would also
// invalidate the L1 cache (CCTL.IVALL) at every wait, for no data of ours.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = smem_address(bar);
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
  } while (!done);
}

// ---------------------------------------------------------------------------
// Cluster kernel
// ---------------------------------------------------------------------------

constexpr int kClusterThreads = 256;
constexpr int kClusterWarps = kClusterThreads / 32;
// log2 of the widest column tile of a warp in the instantiation whose tiles
// have vr rows: at most 32 outputs per tile (the host's split and the
// kernel's dispatch both read it).
__host__ __device__ constexpr int cluster_widest_vc_log2(int vr) { return vr == 4 ? 3 : 4; }
// Rows one cluster carries; one thread per row handles its coefficients.
constexpr int kMaxClusterRows = 64;
static_assert(kMaxClusterRows <= kClusterThreads, "one thread per row");

// The exchanged buffers, each with one mbarrier per CTA (phases alternate).
enum ExchangeBuffer { kHidden0 = 0, kHidden1 = 1, kEps0 = 2, kEps1 = 3, kExchangeBuffers = 4 };

// How one layer's outputs are split over a CTA's warps, fixed for the whole
// call and computed on the host, so that the step loop spends its
// instructions on the products rather than on integer division. A warp
// computes one tile of VR rows (the kernel's) x 2^vc_log2 columns at a time.
struct LayerSplit {
  int cols;                // output columns per CTA (a multiple of 4 unless the whole layer)
  int vc_log2;             // log2 of the columns of a warp's tile (1 to 4)
  int tiles_c;             // column tiles per CTA
  uint32_t tiles_c_magic;  // magic_divisor(tiles_c)
  int ntiles;              // row tiles x tiles_c
};

// n / d as one multiply-high, exact for n * d < 2^32 (every index here).
__host__ __device__ inline uint32_t magic_divisor(uint32_t d) {
  return d <= 1 ? 0u : static_cast<uint32_t>(((1ull << 32) + d - 1) / d);
}
__device__ __forceinline__ int divide(int n, int d, uint32_t magic) {
  return d == 1 ? n : static_cast<int>(__umulhi(static_cast<uint32_t>(n), magic));
}

// Shared-memory layout of one CTA (offsets in floats, multiples of 4 so that
// rows can be read as float4) and the work split, computed on the host
// (fused_sample_cuda.cu) so every CTA agrees.
struct ClusterPlan {
  LayerSplit split[kMaxLayers];  // slice of layer l on each CTA
  LayerSplit last_split;         // the whole last layer, when every CTA computes it
  int cluster_size;
  int rows_per_tile;
  int in0_ld;                    // round_up(dim + 1, 4)
  int hidden_ld;                 // round_up(widest hidden layer, 4)
  int eps_ld;                    // round_up(dim, 4)
  int weight_offset[kMaxLayers]; // slice of layer l in shared memory (row stride
                                 // round_up(in, 4), zero padded), or -1: global
  int bias_offset[kMaxLayers];   // its bias slice in shared memory (with the weights)
  int last_weight_offset;        // the whole last layer (padded rows), or -1: sliced
  int last_bias_offset;          // and its whole bias
  int in0_offset;                // rows x in0_ld: [x, t / T], the input of layer 0
  int hidden_offset[2];          // rows x hidden_ld, hidden outputs alternate between them
  int eps_offset[2];             // rows x eps_ld, outputs of the last layer, by step parity
  int x_offset;                  // rows x dim, the current sample
  int coef_offset;               // rows x 2: this step's (c1, c2)
  int t_offset;                  // rows ints: clamped t_start
  int valid_offset;              // rows ints: 1 when every timestep is in range
  int barrier_offset;            // kExchangeBuffers mbarriers (8 bytes each)
};

__host__ __device__ inline int round_up4(int v) { return (v + 3) & ~3; }
// Output columns per CTA, a multiple of 4 so that every slice starts on a
// 16-byte boundary (its weight rows are copied as float4).
__host__ __device__ inline int slice_size(int out, int cluster_size) {
  return round_up4((out + cluster_size - 1) / cluster_size);
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

// The transposing levels of cluster_layer's reduction, while a lane holds N
// of the tile's V sums: at offset o = 16 N / V the lanes with bit o set keep
// the upper half of their values and take their partner's share of it.
// Recursive on N so that every index is a constant (the array stays in
// registers).
template <int V, int N>
__device__ __forceinline__ void reduce_transposing(float (&v)[V], int lane) {
  if constexpr (N > 1) {
    constexpr int half = N / 2;
    constexpr int o = 16 * N / V;
    const bool upper = (lane & o) != 0;
#pragma unroll
    for (int q = 0; q < half; ++q) {
      // By value: a conditional of two array elements would select their
      // addresses and put the array in local memory.
      const float lo = v[q], hi = v[q + half];
      const float send = upper ? lo : hi;
      const float keep = upper ? hi : lo;
      v[q] = keep + __shfl_xor_sync(0xffffffffu, send, o);
    }
    reduce_transposing<V, half>(v, lane);
  }
}

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
__device__ __forceinline__ void cluster_layer(const LayerSplit& sp, const float* in, int in_ld, const float* w,
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
  for (int tile = warp; tile < sp.ntiles; tile += kClusterWarps) {  // warp-uniform
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

// cluster_layer with the column tile the host chose for this layer.
template <int VR, bool kVec, bool kL2>
__device__ __forceinline__ void cluster_layer_tiled(const LayerSplit& sp, const float* in, int in_ld,
                                                    const float* w, const float* bias, int K, int rows, int ns,
                                                    bool apply_silu, const LayerSink& sink) {
  constexpr int kWidest = 1 << cluster_widest_vc_log2(VR);
  switch (sp.vc_log2) {
    case 1: return cluster_layer<VR, 2, kVec, kL2>(sp, in, in_ld, w, bias, K, rows, ns, apply_silu, sink);
    case 2: return cluster_layer<VR, 4, kVec, kL2>(sp, in, in_ld, w, bias, K, rows, ns, apply_silu, sink);
    case 3: return cluster_layer<VR, 8, kVec, kL2>(sp, in, in_ld, w, bias, K, rows, ns, apply_silu, sink);
    default: return cluster_layer<VR, kWidest, kVec, kL2>(sp, in, in_ld, w, bias, K, rows, ns, apply_silu, sink);
  }
}

// dst[r * ld + k] = src[r * width + k] for r < rows, k < width; zero for
// width <= k < ld, as asynchronous copies that all go in flight at once (16
// bytes each where the layout allows). The caller waits for them.
__device__ __forceinline__ void stage_padded_rows(float* dst, const float* src, int rows, int width,
                                                  int ld) {
  if (width == ld && width % 4 == 0 && (reinterpret_cast<uintptr_t>(src) & 15) == 0) {
    for (int i = threadIdx.x; i < rows * width / 4; i += kClusterThreads)
      cp_async16(dst + 4 * i, src + 4 * i, true);
    return;
  }
  for (int i = threadIdx.x; i < rows * ld; i += kClusterThreads) {
    const int r = i / ld, k = i - r * ld;
    const bool inside = k < width;
    cp_async4(dst + i, inside ? src + r * width + k : src, inside);
  }
}

// VR: the rows of a warp's output tile (1, 2 or 4; the host picks it from the
// rows per cluster).
template <int VR>
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
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + p.barrier_offset);

  // This CTA's weight slices: rows [n0, n0 + ns) of each layer, copied once
  // with rows padded to a multiple of 4 by zeros, and their biases.
  for (int l = 0; l < L; ++l) {
    if (p.weight_offset[l] < 0) continue;
    const LayerArgs& la = a.layers[l];
    const int s = p.split[l].cols;
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
  cp_async_commit();
  // Zero the layer inputs: float4 reads cover the padding columns, which
  // must hold finite values (the weights there are zero).
  for (int i = threadIdx.x; i < p.hidden_offset[1] + p.rows_per_tile * p.hidden_ld - p.in0_offset;
       i += kClusterThreads)
    in0[i] = 0.f;
  if (threadIdx.x == 0) {
    // One arrival per phase, this CTA's own (exchange below); the senders'
    // bytes complete it.
    for (int b = 0; b < kExchangeBuffers; ++b) mbarrier_init(bars + b, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
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
        cluster_layer_tiled<VR, true, false>(p.last_split, in, in_ld, smem + p.last_weight_offset,
                                             smem + p.last_bias_offset, la.in, rows, la.out, false, sink);
        in_buffer = -1;
        break;
      }
      const LayerSplit& sp = p.split[l];
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
        cluster_layer_tiled<VR, true, false>(sp, in, in_ld, smem + p.weight_offset[l], smem + p.bias_offset[l],
                                             la.in, rows, ns, !last, sink);
      } else if (la.in % 4 == 0 && (reinterpret_cast<uintptr_t>(la.weight) & 15) == 0) {
        cluster_layer_tiled<VR, true, true>(sp, in, in_ld, w_global, la.bias + n0, la.in, rows, ns, !last,
                                            sink);
      } else {
        cluster_layer_tiled<VR, false, true>(sp, in, in_ld, w_global, la.bias + n0, la.in, rows, ns, !last,
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
    for (int i = threadIdx.x; i < rows * dim; i += kClusterThreads) {
      const int r = i / dim, j = i - r * dim;
      const float v = coef[2 * r] * (xcur[i] - coef[2 * r + 1] * eps[r * p.eps_ld + j]);
      xcur[i] = v;
      in0[r * in0_ld + j] = v;
    }
    for (int r = threadIdx.x; r < rows; r += kClusterThreads)
      in0[r * in0_ld + dim] = static_cast<float>(t0[r] - (k + 1)) / a.total_timesteps;
    __syncthreads();
  }

  // Every CTA holds the result; they share the writing by row. Nothing is in
  // flight towards this CTA: it has waited for every phase sent to it.
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
constexpr int kTileWarps = kTileThreads / 32;
// Each warp computes all rows x up to kTileMaxWarpTiles mma tiles of 8
// output columns; a layer's pass covers kTileWarps times that.
constexpr int kTileMaxWarpTiles = 4;
constexpr int kTileMaxPassCols = kTileWarps * 8 * kTileMaxWarpTiles;
// Inner-dimension chunk per stage slot: one 128-byte row per output column,
// its eight 16-byte units stored in the order unit ^ (column % 8) (the TMA
// unit's 128-byte swizzle, which cp.async copies follow too), so that the
// eight rows an ldmatrix reads at one k fall in eight different bank groups.
constexpr int kTileKChunk = 32;
constexpr int kTileStageLd = kTileKChunk;
constexpr int kTileSwizzleBytes = 1024;  // the swizzle repeats every 8 rows; slots start on it
// The weight stream's ring: room for two chunks of the widest pass, or for
// more chunks of narrower passes (more copies in flight).
constexpr int kTileStageFloats = 2 * kTileMaxPassCols * kTileStageLd;
constexpr int kTileMaxSlots = 8;
// Float offset of element k of row n in a slot.
__host__ __device__ inline int stage_index(int n, int k) {
  return n * kTileStageLd + ((((k >> 2) ^ n) & 7) << 2) + (k & 3);
}

// One TMA descriptor per layer whose chunks the TMA unit copies
// (TilePlan::tma): the weight matrix as a 2-D tensor (in, out), boxes of
// kTileKChunk x the layer's pass width, zero-filled outside the matrix,
// with the 128-byte swizzle above.
struct TileMaps {
  CUtensorMap weight[kMaxLayers];
};

struct TilePlan {
  int cluster_size;    // CTAs sharing one row tile, each computing a column share
  int act_ld;          // == 4 mod 32, >= every width rounded up to kTileKChunk
  int act_offset[2];   // rows x act_ld each
  int x_offset;        // rows x dim
  int stage_offset;    // the ring: slots x slot_floats, plus room to align it to kTileSwizzleBytes
  int slots;           // 2, 4 or 8
  int slot_floats;     // the widest pass x kTileStageLd
  int t_offset;
  int valid_offset;
  int coef_offset;     // rows x 2: this step's (c1, c2)
  int barrier_offset;  // 2 + kTileMaxSlots mbarriers: in a cluster, one per activation
                       // buffer; then one per slot, completed by its TMA copy
  bool vec4[kMaxLayers];  // weight rows 16-byte aligned: copy with 16-byte cp.async
  bool tma[kMaxLayers];   // chunks of layer l by TMA (TileMaps::weight[l]), else cp.async
  // Output columns of layer l per CTA of a cluster (a multiple of 8), and the
  // 8-column tiles per warp (1 to 4): narrow shares spread over every warp
  // instead of leaving most of them idle.
  int cta_cols[kMaxLayers];
  int warp_tiles[kMaxLayers];
  // In a cluster, the last layer may be split over its inner dimension
  // instead of its columns: CTA r multiplies its own share of the previous
  // layer's outputs (cta_cols[L - 2] columns from r * cta_cols[L - 2]) by
  // every column, so that layer's outputs are never exchanged; the CTAs then
  // exchange their partial sums of the dim-wide result (cluster_size x rows x
  // partial_ld floats at partial_offset, slot r from CTA r), which the update
  // adds up in rank order. cta_cols[L - 1] is then the whole (padded) layer.
  bool split_last;
  int partial_offset;
  int partial_ld;
};

__host__ __device__ inline int tile_pass_cols(const TilePlan& p, int layer) {
  return kTileWarps * 8 * p.warp_tiles[layer];
}
__host__ __device__ inline int tile_passes(const TilePlan& p, int layer) {
  return (p.cta_cols[layer] + tile_pass_cols(p, layer) - 1) / tile_pass_cols(p, layer);
}

// The part of layer l's product that CTA `rank` computes: output columns
// [col_begin, col_end) over the inner range [k_begin, k_end), in `chunks`
// chunks from k_begin (weights past k_end are staged as zeros). One place
// for the weight stream and the products to agree on.
struct LayerShare {
  int col_begin, col_end;
  int k_begin, k_end;
  int chunks;
};
__device__ inline LayerShare layer_share(const SampleArgs& a, const TilePlan& p, int l, int rank) {
  const LayerArgs& la = a.layers[l];
  LayerShare s;
  if (p.split_last && l + 1 == a.num_layers) {
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

// Cluster barrier, split: arrive releases this thread's earlier writes
// (local and remote), wait acquires everyone's. All threads execute both.
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
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
__device__ void begin_pass(const SampleArgs& a, const TilePlan& p, int rank, WeightStream& ws) {
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
               ? la.weight + static_cast<size_t>(n_base + n0) * la.in + share.k_begin + k
               : la.weight;
  ws.src_step = static_cast<size_t>(row_step) * la.in;
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
__device__ __forceinline__ void load_chunk(const SampleArgs& a, const TilePlan& p, const TileMaps& maps,
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
      for (int i = 0; i < ws.copies; ++i, src += ws.src_step, dst += ws.dst_step)
        cp_async16(dst, i < inside ? src : ws.safe, i < inside);
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
  const SampleArgs& a;
  const TilePlan& p;
  const TileMaps& maps;
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
__device__ __forceinline__ void exchange_shares(const SampleArgs& a, const TilePlan& p, int l, int rank,
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
  const uint32_t local = smem_address(t.out + row * t.out_ld + col);
  for (int d = 0; d < cs; ++d) {
    const uint32_t at = cs == 1 ? local : cluster_address(local, d);
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
// bias, SiLU and the stores: into this CTA (the caller exchanges the shares),
// or, for the partial sums of a split last layer, into every CTA.
// A warp with NT <= 2 tiles spreads consecutive k-steps over the spare
// accumulators (4 / NT chains per tile), so that its products do not wait
// on one another; the chains are summed at the end.
template <int MT, int kSplit, int NT>
__device__ __forceinline__ void tile_pass(const TilePass& t, int pass, WeightStream& stream) {
  constexpr int kChains = kTileMaxWarpTiles / NT;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int in_ld = t.in_ld;
  const int col_end = t.share.col_end;
  const int warp_n = t.share.col_begin + pass * (kTileWarps * 8 * NT) + warp * 8 * NT;
  const bool warp_active = warp_n < col_end;  // warp-uniform
  // The biases, loaded now so that their latency hides behind the products
  // (partial sums: only CTA 0's include them).
  const bool with_bias = !(t.p.split_last && t.last) || t.rank == 0;
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
          if (kSplit == 3) {
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
        if (kSplit == 3) {
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
            if (kSplit == 3) {
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
        if (!t.last) v[h] = make_float2(silu(v[h].x), silu(v[h].y));
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

// One CTA per 16 * MT rows, or a cluster of p.cluster_size CTAs per row tile:
// then CTA r computes the r-th share of every layer's output columns and
// copies it into every CTA's copy of the layer output (exchange_shares), and
// with p.split_last the last layer is a sum of per-CTA partial products
// (stored into every CTA, then one cluster barrier).
// kSplit = 3: 3xTF32 (fp32 accuracy); kSplit = 1: plain tf32.
template <int MT, int kSplit>
__global__ void __launch_bounds__(kTileThreads, 1)
    tiled_sample_kernel(const __grid_constant__ SampleArgs a, const __grid_constant__ TilePlan p,
                        const __grid_constant__ TileMaps maps) {
  constexpr int kRows = 16 * MT;
  extern __shared__ float4 smem_f4[];
  float* smem = reinterpret_cast<float*>(smem_f4);
  const int cs = p.cluster_size;
  const bool clustered = cs > 1;
  const int rank = clustered ? static_cast<int>(cg::this_cluster().block_rank()) : 0;
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
  float* partials = smem + p.partial_offset;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + p.barrier_offset);
  uint64_t* slot_bars = bars + 2;
  uint32_t parity = 0;  // bit b: parity of the next phase of bars[b] to complete
  const int L = a.num_layers;
  // With a split last layer, layer L - 2's outputs stay in their CTA, and the
  // step's first stores into other CTAs are those of layer 0 or, for L == 2,
  // the partial sums.
  const int first_remote_layer = p.split_last && L == 2 ? 1 : 0;

  // The slots' mbarriers before the first TMA copy (issued by this thread),
  // the exchange's before the cluster barrier below.
  if (threadIdx.x == 0) {
    for (int b = 0; b < 2 + kTileMaxSlots; ++b) mbarrier_init(bars + b, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    // The descriptors' first use then finds them cached.
    for (int l = 0; l < L; ++l) {
      if (p.tma[l]) asm volatile("prefetch.tensormap [%0];\n" ::"l"(&maps.weight[l]) : "memory");
    }
  }
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
  static_assert(kRows <= kTileThreads, "one thread per row");
  CoefPrefetch coefs(a, t0, kRows);
  // (the first barrier of the chunk loop publishes the setup; in a cluster,
  // the wait before the first remote store matches this arrival: every CTA
  // has zeroed its buffers before anyone stores into them)
  if (clustered) cluster_arrive();

  for (int k = 0; k < a.num_steps; ++k) {
    coefs.publish(a, t0, coef, k);  // read in the update, past a CTA barrier
    for (int l = 0; l < L; ++l) {
      const bool last = l + 1 == L;
      const bool partial = p.split_last && last;
      const bool local = p.split_last && l + 2 == L;
      const TilePass tp{a,
                        p,
                        maps,
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
                        clustered && l == first_remote_layer};
      for (int pass = 0; pass < tile_passes(p, l); ++pass) {
        switch (p.warp_tiles[l]) {
          case 1:
            tile_pass<MT, kSplit, 1>(tp, pass, stream);
            break;
          case 2:
            tile_pass<MT, kSplit, 2>(tp, pass, stream);
            break;
          case 3:
            tile_pass<MT, kSplit, 3>(tp, pass, stream);
            break;
          default:
            tile_pass<MT, kSplit, 4>(tp, pass, stream);
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
      if (p.split_last) {
        for (int q = 0; q < cs; ++q) e += partials[(q * kRows + r) * p.partial_ld + j];
      } else {
        e = eps[r * ld + j];
      }
      const float v = coef[2 * r] * (xcur[i] - coef[2 * r + 1] * e);
      xcur[i] = v;
      act0[r * ld + j] = v;
    }
    for (int r = threadIdx.x; r < kRows; r += kTileThreads)
      act0[r * ld + dim] = static_cast<float>(t0[r] - (k + 1)) / a.total_timesteps;
    __syncthreads();
    if (clustered) cluster_arrive();  // this CTA's update has read eps
  }
  if (clustered) cluster_wait();  // matches the last arrival
  // The prefetches past the end, unused, must land before exit.
  cp_async_wait<0>();
  for (int s = 0; s + 1 < p.slots; ++s) {
    wait_for_chunk(p.slots, slot_bars, stream);
    stream.read = (stream.read + 1) & (p.slots - 1);
  }

  // Every CTA of a cluster holds the result; they share the writing by row.
  const float nan = __int_as_float(0x7fc00000);
  for (int i = threadIdx.x; i < rows * dim; i += kTileThreads) {
    const int r = i / dim;
    if (r % cs != rank) continue;
    a.out[static_cast<size_t>(row0) * dim + i] = valid[r] ? xcur[i] : nan;
  }
}

}  // namespace cuda_kernels
}  // namespace ddpm_ops
