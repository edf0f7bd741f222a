// The small-batch kernel of ddpm::fused_sample (exact fp32 on CUDA cores):
// resident_sample_kernel<kOpw, kRows, kLayers>, every weight in registers.
//
// At a handful of rows a step is a chain of dependent layers, each one short
// dot product per lane, a shuffle reduction and a trip through distributed
// shared memory; the time is that chain's instructions (BENCHMARKS.md). So
// this kernel keeps nothing on the chain but those: the cluster's CTAs split
// every hidden layer's outputs, 8 kOpw columns each, and every thread holds
// its share of the weights in registers for the whole call, loaded once. The
// layer loop, the shapes of the register arrays and every index are compile
// time constants; x stays in the registers of the lanes that update it.
//
//   - Hidden layer l (sliced): warp w of CTA r computes columns
//     r 8 kOpw + w kOpw + o, o < kOpw, for the kRows rows; lane i takes the
//     inner columns [4 i, 4 i + 4) and [128 + 4 i, 128 + 4 i + 4) (layer 0:
//     [2 i, 2 i + 2) of x; its time column is added with the bias), so the
//     float4 reads of a row are conflict-free. A transposing shuffle
//     butterfly (reduce_transposing) leaves each output on 32 / V lanes,
//     which share its st.async stores into every CTA of the cluster,
//     completing on the receiver's mbarrier: the cluster kernel's exchange.
//   - The last layer (dim columns) is computed whole by every CTA, from the
//     exchanged hidden outputs (no exchange of eps): warp w takes columns
//     [8 w, 8 w + 8). After the reduction each lane holds one eps of one row
//     and updates its own copy of that x, then writes it where layer 0 reads.
// So a step has one exchange per hidden layer and one CTA barrier.
// Envelope (host: resident_shape): 2 to 4 layers, dim <= 64, every hidden
// layer of the same width H <= 256 with H a multiple of 8 kOpw (the cluster
// has H / (8 kOpw) CTAs).
#pragma once

#include "fused_sample_kernels.cuh"

namespace ddpm_ops {
namespace cuda_kernels {

constexpr int kResidentThreads = 256;
constexpr int kResidentWarps = kResidentThreads / 32;
constexpr int kResidentMaxDim = 64;      // layer 0: 2 columns of x per lane; last layer: 8 outputs per warp
constexpr int kResidentMaxHidden = 256;  // 2 float4 per lane
constexpr int kResidentMaxLayers = 4;    // the registers of 3 hidden layers' slices and the last layer

// A lane's inner columns of a hidden layer: float4 q = lane + 32 i, i < 2 (so
// the reads of a row are conflict-free), element j of its 8 at column
// hidden_column(lane, j).
constexpr int kHiddenPerLane = 8;
__device__ __forceinline__ int hidden_column(int lane, int j) { return 4 * (lane + 32 * (j / 4)) + j % 4; }
// Layer 0's: x columns 2 lane and 2 lane + 1 (a float2).
constexpr int kInputPerLane = 2;

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

// w[o][j] <- weight[n0 + o][hidden_column(lane, j)] (row stride ld), zero past
// the K inner columns or the `rows` rows.
template <int C>
__device__ __forceinline__ void load_hidden_weights(float (&w)[C][kHiddenPerLane], const float* weight, int n0,
                                                    int rows, int K, int ld, int lane) {
#pragma unroll
  for (int o = 0; o < C; ++o) {
#pragma unroll
    for (int j = 0; j < kHiddenPerLane; ++j) {
      const int k = hidden_column(lane, j);
      w[o][j] = n0 + o < rows && k < K ? __ldg(weight + static_cast<size_t>(n0 + o) * ld + k) : 0.f;
    }
  }
}

// The shared memory of a CTA of resident_sample_kernel<kOpw, kRows, L>.
template <int kRows>
struct ResidentBuffers {
  float in0[kRows][kResidentMaxDim];
  float hidden[2][kRows][kResidentMaxHidden];
  uint64_t bars[2];
};

template <int kOpw, int kRows, int kLayers>
__global__ void __launch_bounds__(kResidentThreads, 1) resident_sample_kernel(const __grid_constant__ SampleArgs a) {
  static_assert(kLayers >= 2 && kLayers <= kResidentMaxLayers, "2 to 4 layers");
  static_assert(kHiddenPerLane * 32 == kResidentMaxHidden && kInputPerLane * 32 == kResidentMaxDim, "lane split");
  constexpr int kSliced = kLayers - 1;  // the hidden layers, split over the cluster
  constexpr int kSliceV = kRows * kOpw;  // outputs of a warp's hidden-layer tile
  constexpr int kLastV = kRows * 8;      // and of its last-layer tile
  static_assert(kSliceV <= 32 && kLastV <= 32, "a warp's tile is at most 32 outputs");
  constexpr int kSliceReplicas = 32 / kSliceV;
  constexpr int kLastReplicas = 32 / kLastV;
  // Layer 0's input, x and zero padding (its time column goes with the
  // bias); the hidden outputs, alternating between two buffers across layers
  // and steps (the cluster kernel's exchange), zero past H. The launch asks
  // for all of the shared memory, though, so that a multiprocessor runs one
  // CTA, as the co-resident cluster counts assume (DeviceInfo).
  extern __shared__ float4 smem_f4[];
  ResidentBuffers<kRows>& buffers = *reinterpret_cast<ResidentBuffers<kRows>*>(smem_f4);
  auto& in0 = buffers.in0;
  auto& hidden = buffers.hidden;
  auto& bars = buffers.bars;

  cg::cluster_group cluster = cg::this_cluster();
  const int cs = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int row0 = static_cast<int>(blockIdx.x / cs) * kRows;
  const int dim = a.dim;
  const int H = a.layers[0].out;
  const int n_warp = (rank * kResidentWarps + warp) * kOpw;  // this warp's first hidden column

  // Every weight this thread multiplies, for the whole call.
  float w0[kOpw][kInputPerLane];
  float wh[kSliced > 1 ? kSliced - 1 : 1][kOpw][kHiddenPerLane];
  float wl[8][kHiddenPerLane];
#pragma unroll
  for (int o = 0; o < kOpw; ++o) {
#pragma unroll
    for (int j = 0; j < kInputPerLane; ++j) {
      const int k = kInputPerLane * lane + j;
      w0[o][j] = k < dim ? __ldg(a.layers[0].weight + static_cast<size_t>(n_warp + o) * (dim + 1) + k) : 0.f;
    }
  }
#pragma unroll
  for (int l = 1; l < kSliced; ++l) load_hidden_weights(wh[l - 1], a.layers[l].weight, n_warp, H, H, H, lane);
  load_hidden_weights(wl, a.layers[kLayers - 1].weight, 8 * warp, dim, H, H, lane);

  // What a lane needs for the output it ends a layer with. Hidden layers:
  // row s_row, column s_col, the biases and layer 0's time weight there.
  const int s_e = lane / kSliceReplicas;
  const int s_row = s_e / kOpw;
  const int s_col = n_warp + s_e % kOpw;
  const int s_replica = lane % kSliceReplicas;
  float s_bias[kSliced];
#pragma unroll
  for (int l = 0; l < kSliced; ++l) s_bias[l] = __ldg(a.layers[l].bias + s_col);
  const float s_time_weight = __ldg(a.layers[0].weight + static_cast<size_t>(s_col) * (dim + 1) + dim);
  bool valid;  // set again below: the output this lane writes is the last layer's
  const int s_t0 = load_t_start(a, min(row0 + s_row, a.batch - 1), &valid);
  // The last layer: row l_row, column l_col of eps and x, that bias and x.
  const int l_e = lane / kLastReplicas;
  const int l_row = l_e / 8;
  const int l_col = 8 * warp + l_e % 8;
  const bool l_owner = lane % kLastReplicas == 0 && l_col < dim;  // writes that x
  const bool l_inside = l_col < dim && row0 + l_row < a.batch;
  const float l_bias = l_col < dim ? __ldg(a.layers[kLayers - 1].bias + l_col) : 0.f;
  float x = l_inside ? __ldg(a.x + static_cast<size_t>(row0 + l_row) * dim + l_col) : 0.f;
  const int l_t0 = load_t_start(a, min(row0 + l_row, a.batch - 1), &valid);
  auto coefficient = [&](const float* table, int k) {
    return __ldg(table + clamp_index(l_t0 - k, a.table_length));
  };
  float c1 = coefficient(a.sqrt_recip_alphas, 0), c2 = coefficient(a.coef_eps, 0);

  // Zero the buffers (padding columns are read, against zero weights).
  for (int i = threadIdx.x; i < kRows * kResidentMaxDim; i += kResidentThreads) (&in0[0][0])[i] = 0.f;
  for (int i = threadIdx.x; i < 2 * kRows * kResidentMaxHidden; i += kResidentThreads)
    (&hidden[0][0][0])[i] = 0.f;
  __syncthreads();
  if (l_owner) in0[l_row][l_col] = x;
  if (threadIdx.x == 0) {
    // One arrival per phase, this CTA's own; the senders' bytes complete it.
    mbarrier_init(&bars[0], 1);
    mbarrier_init(&bars[1], 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  // Every CTA must be running, its mbarriers initialized, before anyone sends
  // to it; this also publishes in0.
  cluster.sync();

  const uint32_t phase_bytes = static_cast<uint32_t>(kRows * H * sizeof(float));
  uint32_t parity = 0;  // bit b: parity of the next phase of bars[b] to complete
  int buffer = 0;       // the hidden buffer the next hidden layer writes
  auto wait_for_inputs = [&](float (&in)[kRows][kHiddenPerLane]) {
    const int b = buffer ^ 1;
    mbarrier_wait(&bars[b], (parity >> b) & 1u);
    parity ^= 1u << b;
    load_hidden_inputs<kRows>(in, hidden[b], lane);
  };
  for (int k = 0; k < a.num_steps; ++k) {
    // The next step's coefficients, in flight during this one.
    const float next_c1 = coefficient(a.sqrt_recip_alphas, k + 1), next_c2 = coefficient(a.coef_eps, k + 1);
    const float time = static_cast<float>(s_t0 - k) / a.total_timesteps;
#pragma unroll
    for (int l = 0; l < kSliced; ++l) {
      float v[kSliceV];
      if (l == 0) {
        float in[kRows][kInputPerLane];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const float2 p = reinterpret_cast<const float2*>(in0[r])[lane];
          in[r][0] = p.x;
          in[r][1] = p.y;
        }
        resident_products<kRows, kOpw, kInputPerLane>(v, w0, in, lane);
        v[0] += fmaf(s_time_weight, time, s_bias[0]);
      } else {
        float in[kRows][kHiddenPerLane];
        wait_for_inputs(in);
        resident_products<kRows, kOpw, kHiddenPerLane>(v, wh[l - 1], in, lane);
        v[0] += s_bias[l];
      }
      const float out = silu_approx(v[0]);
      // The exchange (the cluster kernel's: why no barrier guards it). This
      // CTA's own arrival announces the phase's bytes, before or after they
      // land.
      if (threadIdx.x == 0) mbarrier_expect_local(smem_address(&bars[buffer]), phase_bytes);
      const uint32_t at = smem_address(&hidden[buffer][s_row][s_col]);
      const uint32_t bar = smem_address(&bars[buffer]);
      for (int d = s_replica; d < cs; d += kSliceReplicas)
        st_async(cluster_address(at, d), out, cluster_address(bar, d));
      buffer ^= 1;
    }
    float in[kRows][kHiddenPerLane];
    wait_for_inputs(in);
    float v[kLastV];
    resident_products<kRows, 8, kHiddenPerLane>(v, wl, in, lane);
    x = c1 * (x - c2 * (v[0] + l_bias));
    c1 = next_c1;
    c2 = next_c2;
    // Every warp has read in0 for this step: this lane's last-layer inputs
    // came from every warp's last hidden layer, which followed its layer 0.
    if (l_owner) in0[l_row][l_col] = x;
    __syncthreads();
  }
  // Every CTA holds the result; they share the writing by row. Nothing is in
  // flight towards this CTA: it has waited for every phase sent to it.
  if (l_owner && l_inside && (row0 + l_row) % cs == rank)
    a.out[static_cast<size_t>(row0 + l_row) * dim + l_col] = valid ? x : __int_as_float(0x7fc00000);
}

}  // namespace cuda_kernels
}  // namespace ddpm_ops
