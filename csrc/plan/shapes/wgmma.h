// The wgmma kernels' shared geometry (bf16_wgmma, bf16x3_wgmma_m64,
// bf16x3_wgmma_swapab).
#pragma once

#include "../../common/host_device.h"

namespace ddpm_ops {
namespace shapes {

constexpr int kWgmmaRows = 64;  // rows of one warpgroup's tile (wgmma's M)
constexpr int kWgmmaDimPad = 64;  // layer 0's K and the last layer's N
constexpr int kWgmmaCols = 64;    // output columns per wgmma chain (n64)
constexpr int kWgmmaAlign = 1024;  // the 128-byte swizzle repeats every 8 rows of 128 bytes

// What a launch asks for: room to align the start too, where the limit allows
// (the kernel traps if its alignment would not fit; the start of dynamic
// shared memory is aligned in practice).
template <typename Layout>  // Bf16WgmmaLayout or Bf16x3Layout
DDPM_HD constexpr int wgmma_request(const Layout& lay, int max_smem) {
  return lay.bytes() + kWgmmaAlign < max_smem ? lay.bytes() + kWgmmaAlign : max_smem;
}

}  // namespace shapes
}  // namespace ddpm_ops
