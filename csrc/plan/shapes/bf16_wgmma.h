// The bf16_wgmma kernel's block and its shared-memory layout.
#pragma once

#include "wgmma.h"

namespace ddpm_ops {
namespace shapes {

constexpr int kBf16Warpgroups = 2;
constexpr int kBf16Threads = 128 * kBf16Warpgroups;

// Where everything sits in the (1024-byte aligned) shared memory, for padded
// hidden width h and L layers; host and device both use it.
struct Bf16WgmmaLayout {
  int h;
  int num_layers;
  DDPM_HD constexpr int rows(int l) const { return l + 1 == num_layers ? kWgmmaDimPad : h; }
  DDPM_HD constexpr int depth(int l) const { return l == 0 ? kWgmmaDimPad : h; }
  // Layer l's bf16 weights: depth(l) / 64 blocks of rows(l) x 128 bytes.
  DDPM_HD constexpr int weight_offset(int l) const {
    return l == 0 ? 0 : 2 * h * kWgmmaDimPad + 2 * (l - 1) * h * h;
  }
  // x of each warpgroup's tile, fp32: 8 float4 per thread, thread-minor.
  DDPM_HD constexpr int x_offset() const { return weight_offset(num_layers - 1) + 2 * kWgmmaDimPad * h; }
  // fp32 biases, layer l's at l * h (the last one's 64 wide), padded with zeros.
  DDPM_HD constexpr int bias_offset() const {
    return x_offset() + kBf16Warpgroups * kWgmmaRows * kWgmmaDimPad * 4;
  }
  // Layer 0's time column, bf16 (an operand like the others; at the seed
  // shape fp32 would not fit).
  DDPM_HD constexpr int time_weight_offset() const {
    return bias_offset() + 4 * ((num_layers - 1) * h + kWgmmaDimPad);
  }
  DDPM_HD constexpr int bytes() const { return time_weight_offset() + 2 * h; }
};

}  // namespace shapes
}  // namespace ddpm_ops
