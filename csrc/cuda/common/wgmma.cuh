// wgmma (sm_90a) wrappers, descriptors and the aligned shared memory of the
// wgmma kernels.
#pragma once

#include "ptx.cuh"
#include "../../plan/shapes/wgmma.h"

#include <cuda_bf16.h>

namespace ddpm_ops {
namespace cuda_kernels {

// The wgmma kernels' geometry, which the plan owns (csrc/plan/shapes/wgmma.h).
using shapes::kWgmmaAlign;

// The dynamic shared memory from its first kWgmmaAlign boundary (the swizzle
// of the tiles in it repeats every 1024 bytes); traps where the launch left no
// room for that (wgmma_request).
template <typename Layout>  // Bf16WgmmaLayout, Bf16x3Layout or SwapabLayout
__device__ __forceinline__ char* aligned_shared_memory(const Layout& lay) {
  extern __shared__ float4 smem_f4[];
  char* smem = reinterpret_cast<char*>(smem_f4);
  const uint32_t misalignment = smem_address(smem) & (kWgmmaAlign - 1);
  uint32_t requested;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(requested));
  if (misalignment != 0 && lay.bytes() + kWgmmaAlign - misalignment > requested) __trap();
  return smem + ((kWgmmaAlign - misalignment) & (kWgmmaAlign - 1));
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
template <int kLen>
__device__ __forceinline__ void fence_accumulators(float (&d)[kLen]) {
#pragma unroll
  for (int i = 0; i < kLen; ++i) asm volatile("" : "+f"(d[i])::"memory");
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

// A thread's place in its warpgroup's accumulators: element i of a 64-column
// block is row g + 8 * ((i >> 1) & 1), column 8 * (i >> 2) + 2 * q + (i & 1).
__device__ __forceinline__ int acc_col(int i, int q) { return 8 * (i >> 2) + 2 * q + (i & 1); }

template <int N, int kLen>
__device__ __forceinline__ void wait_products(float (&acc)[N][kLen]) {
  wgmma_wait_all();
#pragma unroll
  for (int j = 0; j < N; ++j) fence_accumulators(acc[j]);
}

}  // namespace cuda_kernels
}  // namespace ddpm_ops
