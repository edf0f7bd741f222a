// The bf16 tensor-core kernel of ddpm::fused_sample (precision "bf16",
// Hopper's wgmma; compiled only for sm_90a, see setup.py).
//
// wgmma_sample_kernel<H>: every CTA copies the whole net into shared memory
// once, as bf16 in the 128-byte-swizzled K-major layout that wgmma reads its
// B operand from, and then each of its two warpgroups carries 64-row tiles
// through all steps with every activation in registers:
//   - a layer is one m64n64k16 wgmma chain per 64 output columns, its A
//     operand (the layer's input) taken from registers;
//   - the accumulator layout of m64nN is, pair for pair, the A-fragment
//     layout of the next layer's m64k16 (as FlashAttention-3 does with P), so
//     bias, SiLU and the bf16 rounding turn one layer's accumulators into the
//     next one's operand with no shuffle and no shared-memory round trip;
//   - x stays in fp32 registers in the last layer's accumulator layout, the
//     time input is a rank-1 fp32 term in layer 0's epilogue, and the DDPM
//     update runs in fp32: only the products see bf16 operands.
// Nothing is exchanged between threads after the weights are staged, so the
// two warpgroups of an SM overlap one's epilogue with the other's products.
// Shape envelope (host: wgmma_hidden): at least 2 layers, dim <= 64 (padded
// to 64), hidden widths <= H (padded with zero weights, which is exact), and
// the bf16 net within the shared memory (seed shape: 192 KB).
#pragma once

#include "fused_sample_kernels.cuh"

#include <cuda_bf16.h>

namespace ddpm_ops {
namespace cuda_kernels {

constexpr int kWgmmaRows = 64;  // rows of one warpgroup's tile (wgmma's M)
constexpr int kWgmmaWarpgroups = 2;
constexpr int kWgmmaThreads = 128 * kWgmmaWarpgroups;
constexpr int kWgmmaDimPad = 64;  // layer 0's K and the last layer's N
constexpr int kWgmmaCols = 64;    // output columns per wgmma chain (n64)
constexpr int kWgmmaAlign = 1024;  // the 128-byte swizzle repeats every 8 rows of 128 bytes

// Where everything sits in the (1024-byte aligned) shared memory, for padded
// hidden width h and L layers; host and device both use it.
struct WgmmaLayout {
  int h;
  int num_layers;
  __host__ __device__ constexpr int rows(int l) const { return l + 1 == num_layers ? kWgmmaDimPad : h; }
  __host__ __device__ constexpr int depth(int l) const { return l == 0 ? kWgmmaDimPad : h; }
  // Layer l's bf16 weights: depth(l) / 64 blocks of rows(l) x 128 bytes.
  __host__ __device__ constexpr int weight_offset(int l) const {
    return l == 0 ? 0 : 2 * h * kWgmmaDimPad + 2 * (l - 1) * h * h;
  }
  // fp32: num_layers biases of h (padded with zeros), then layer 0's time column.
  __host__ __device__ constexpr int bias_offset() const { return weight_offset(num_layers - 1) + 2 * kWgmmaDimPad * h; }
  __host__ __device__ constexpr int time_weight_offset() const { return bias_offset() + 4 * num_layers * h; }
  __host__ __device__ constexpr int bytes() const { return time_weight_offset() + 4 * h + kWgmmaAlign; }
};

// Shared memory one CTA may have on sm_90, the only target of this kernel.
constexpr int kSm90MaxSmem = 227 * 1024;
__host__ __device__ constexpr bool wgmma_fits(int h, int num_layers) {
  return WgmmaLayout{h, num_layers}.bytes() <= kSm90MaxSmem;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // lo in the low half: the lower column
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Shared-memory matrix descriptor of a K-major, 128-byte-swizzled bf16 tile:
// 8-row groups 1024 bytes apart (the leading offset is unused in this mode).
__device__ __forceinline__ uint64_t wgmma_descriptor(uint32_t smem_addr) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(16 >> 4) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Keeps the compiler from moving reads of the accumulators above the wait.
__device__ __forceinline__ void fence_accumulators(float (&d)[32]) {
#pragma unroll
  for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d (+)= A (registers, this warpgroup's 64 x 16 rows) * B (64 columns x 16
// deep at desc); d is overwritten when accumulate is 0.
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], const uint32_t* a, uint64_t desc, int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
#endif
}

// Issues acc += in (kDepth / 16 k-blocks of A fragments, starting at k-block
// kb0 of the layer) times columns [64 c, 64 c + 64) of the layer whose
// weights start at `weights` (`rows` weight rows, swizzled blocks of 64 deep).
template <int kDepth>
__device__ __forceinline__ void issue_columns(float (&acc)[32], const uint32_t* in, uint32_t weights, int rows,
                                              int c, int kb0) {
  wgmma_fence();
#pragma unroll
  for (int kb = 0; kb < kDepth / 16; ++kb) {
    const int k = kb0 + kb;
    const uint32_t at = weights + (k / 4) * rows * 128 + c * kWgmmaCols * 128 + (k % 4) * 32;
    wgmma_m64n64k16(acc, in + 4 * kb, wgmma_descriptor(at), 1);
  }
  wgmma_commit();
}

__device__ __forceinline__ void wait_columns(float (&acc)[32]) {
  wgmma_wait_all();
  fence_accumulators(acc);
}

// A thread's place in its warpgroup's accumulators: element i of a 64-column
// block is row g + 8 * ((i >> 1) & 1), column 8 * (i >> 2) + 2 * q + (i & 1).
__device__ __forceinline__ int acc_col(int i, int q) { return 8 * (i >> 2) + 2 * q + (i & 1); }

// Columns [64 c, 64 c + 64) of a hidden layer: out (16 A-fragment registers
// of the next layer) <- bf16(silu(in * W^T + b [+ time * w_t])).
template <int kDepth>
__device__ __forceinline__ void hidden_columns(uint32_t* out, const uint32_t* in, uint32_t weights, int h, int c,
                                               const float* bias, const float* time_weight, const float* tn,
                                               int q) {
  // The accumulators start at the bias (and time) term: no registers held
  // for it across the products.
  float acc[32];
#pragma unroll
  for (int i = 0; i < 32; i += 2) {
    const int col = c * kWgmmaCols + acc_col(i, q);
    const float2 b = *reinterpret_cast<const float2*>(bias + col);
    acc[i] = b.x;
    acc[i + 1] = b.y;
    if (time_weight != nullptr) {
      const float2 w = *reinterpret_cast<const float2*>(time_weight + col);
      const float t = tn[(i >> 1) & 1];
      acc[i] = fmaf(t, w.x, acc[i]);
      acc[i + 1] = fmaf(t, w.y, acc[i + 1]);
    }
  }
  issue_columns<kDepth>(acc, in, weights, h, c, 0);
  wait_columns(acc);
#pragma unroll
  for (int i = 0; i < 32; i += 2) out[i / 2] = pack_bf16(silu(acc[i]), silu(acc[i + 1]));
}

// A hidden layer (kDepth deep, kH wide) whose outputs feed another hidden layer.
template <int kH, int kDepth>
__device__ __forceinline__ void hidden_layer(uint32_t (&out)[kH / 4], const uint32_t* in, uint32_t weights,
                                             const float* bias, const float* time_weight, const float* tn,
                                             int q) {
#pragma unroll
  for (int c = 0; c < kH / kWgmmaCols; ++c) {
    hidden_columns<kDepth>(out + 16 * c, in, weights, kH, c, bias, time_weight, tn, q);
  }
}

// The last hidden layer and the output layer together: each 64 columns of
// the hidden layer are multiplied into eps as soon as they exist, so its
// outputs never all need registers at once (the input, one block of outputs,
// eps and x fit beside each other at kH = 256).
template <int kH, int kDepth>
__device__ __forceinline__ void last_layers(float (&eps)[32], const uint32_t* in, uint32_t hidden_weights,
                                            uint32_t last_weights, const float* bias, const float* time_weight,
                                            const float* tn, const float* last_bias, int q) {
#pragma unroll
  for (int c = 0; c < kH / kWgmmaCols; ++c) {
    uint32_t block[16];
    hidden_columns<kDepth>(block, in, hidden_weights, kH, c, bias, time_weight, tn, q);
    if (c == 0) {  // eps starts at the output layer's bias
#pragma unroll
      for (int i = 0; i < 32; i += 2) {
        const float2 b = *reinterpret_cast<const float2*>(last_bias + acc_col(i, q));
        eps[i] = b.x;
        eps[i + 1] = b.y;
      }
    }
    issue_columns<kWgmmaCols>(eps, block, last_weights, kWgmmaDimPad, 0, 4 * c);
    wait_columns(eps);
  }
}

// Copies the net into shared memory: bf16 weights in wgmma's layout, fp32
// biases and layer 0's time column, zeros wherever the padding reaches.
__device__ __forceinline__ void stage_net(const SampleArgs& a, const WgmmaLayout& lay, char* smem) {
  const int L = a.num_layers;
  for (int l = 0; l < L; ++l) {
    const LayerArgs& la = a.layers[l];
    const int rows = lay.rows(l), groups_per_row = lay.depth(l) / 8;
    const int used = l == 0 ? a.dim : la.in;  // layer 0's last column (time) stays fp32
    char* base = smem + lay.weight_offset(l);
    for (int i = threadIdx.x; i < rows * groups_per_row; i += kWgmmaThreads) {
      const int n = i / groups_per_row, k8 = i - n * groups_per_row;
      uint32_t packed[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int k = 8 * k8 + 2 * e;
        const float* w = la.weight + static_cast<size_t>(n) * la.in + k;
        const bool row_ok = n < la.out;
        packed[e] = pack_bf16(row_ok && k < used ? __ldg(w) : 0.f, row_ok && k + 1 < used ? __ldg(w + 1) : 0.f);
      }
      // 16 bytes (8 deep) per store; the 16-byte chunks of a 128-byte row
      // are permuted by the row's index within its 8-row group.
      const int block = k8 / 8, chunk = k8 % 8;
      *reinterpret_cast<uint4*>(base + block * rows * 128 + n * 128 + ((chunk ^ (n & 7)) * 16)) =
          make_uint4(packed[0], packed[1], packed[2], packed[3]);
    }
    float* bias = reinterpret_cast<float*>(smem + lay.bias_offset()) + l * lay.h;
    for (int n = threadIdx.x; n < lay.h; n += kWgmmaThreads) bias[n] = n < la.out ? __ldg(la.bias + n) : 0.f;
  }
  float* time_weight = reinterpret_cast<float*>(smem + lay.time_weight_offset());
  const LayerArgs& first = a.layers[0];
  for (int n = threadIdx.x; n < lay.h; n += kWgmmaThreads) {
    time_weight[n] = n < first.out ? __ldg(first.weight + static_cast<size_t>(n) * first.in + a.dim) : 0.f;
  }
}

// All steps for the 64-row tile at row0 on this warpgroup.
template <int kH>
__device__ __forceinline__ void run_wgmma_tile(const SampleArgs& a, const WgmmaLayout& lay, char* smem,
                                               int row0) {
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  const int g = lane / 4, q = lane % 4;
  const int L = a.num_layers, dim = a.dim;
  const uint32_t weights = smem_address(smem);
  const float* bias = reinterpret_cast<const float*>(smem + lay.bias_offset());
  const float* time_weight = reinterpret_cast<const float*>(smem + lay.time_weight_offset());

  // Rows g and g + 8 of this warp's 16: the thread's two rows (h = 0, 1).
  const int my_row0 = row0 + 16 * warp + g;
  int t[2];
  float xr[32];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    bool ok;
    t[h] = my_row0 + 8 * h < a.batch ? load_t_start(a, my_row0 + 8 * h, &ok) : 0;
  }
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const int r = my_row0 + 8 * ((i >> 1) & 1), col = acc_col(i, q);
    xr[i] = r < a.batch && col < dim ? __ldg(a.x + static_cast<size_t>(r) * dim + col) : 0.f;
  }

  for (int k = 0; k < a.num_steps; ++k) {
    // This step's coefficients: consumed after all layers, which hide the load.
    float c1[2], c2[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int ti = clamp_index(t[h] - k, a.table_length);
      c1[h] = __ldg(a.sqrt_recip_alphas + ti);
      c2[h] = __ldg(a.coef_eps + ti);
    }
    const float tn[2] = {static_cast<float>(t[0] - k) / a.total_timesteps,
                         static_cast<float>(t[1] - k) / a.total_timesteps};
    uint32_t x_frag[kWgmmaDimPad / 4];
#pragma unroll
    for (int i = 0; i < 32; i += 2) x_frag[i / 2] = pack_bf16(xr[i], xr[i + 1]);
    const uint32_t last_weights = weights + lay.weight_offset(L - 1);
    const float* last_bias = bias + (L - 1) * kH;
    float eps[32];
    if (L == 2) {
      last_layers<kH, kWgmmaDimPad>(eps, x_frag, weights, last_weights, bias, time_weight, tn, last_bias, q);
    } else {
      uint32_t act[kH / 4];
      hidden_layer<kH, kWgmmaDimPad>(act, x_frag, weights, bias, time_weight, tn, q);
      // Hidden layers between the first and the last (compiled only where
      // shared memory can hold them: they raise the register count).
      if constexpr (wgmma_fits(kH, 4)) {
        for (int l = 1; l + 2 < L; ++l) {
          uint32_t next[kH / 4];
          hidden_layer<kH, kH>(next, act, weights + lay.weight_offset(l), bias + l * kH, nullptr, nullptr, q);
#pragma unroll
          for (int i = 0; i < kH / 4; ++i) act[i] = next[i];
        }
      }
      last_layers<kH, kH>(eps, act, weights + lay.weight_offset(L - 2), last_weights, bias + (L - 2) * kH,
                          nullptr, nullptr, last_bias, q);
    }
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int h = (i >> 1) & 1;
      xr[i] = c1[h] * (xr[i] - c2[h] * eps[i]);
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
      const int col = acc_col(i, q);
      if (((i >> 1) & 1) == h && col < dim) a.out[static_cast<size_t>(r) * dim + col] = valid ? xr[i] : nan;
    }
  }
}

// Grid: one CTA per SM at most; tile i goes to warpgroup i / gridDim.x (mod
// 2) of CTA i % gridDim.x, so that up to one tile per SM no SM runs two.
template <int kH>
__global__ void __launch_bounds__(kWgmmaThreads, 1) wgmma_sample_kernel(const __grid_constant__ SampleArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ float4 smem_f4[];
  char* smem = reinterpret_cast<char*>(smem_f4);
  smem += (kWgmmaAlign - (smem_address(smem) & (kWgmmaAlign - 1))) & (kWgmmaAlign - 1);
  const WgmmaLayout lay{kH, a.num_layers};
  stage_net(a, lay, smem);
  fence_proxy_async();  // the generic-proxy stores above, before wgmma reads them
  __syncthreads();
  const int tiles = (a.batch + kWgmmaRows - 1) / kWgmmaRows;
  const int wg = threadIdx.x / 128;
  for (int tile = blockIdx.x + wg * gridDim.x; tile < tiles; tile += kWgmmaWarpgroups * gridDim.x) {
    run_wgmma_tile<kH>(a, lay, smem, tile * kWgmmaRows);
  }
#endif
}

}  // namespace cuda_kernels
}  // namespace ddpm_ops
