// The layout of a CTA's share of the net in the bf16x3 kernels
// (bf16x3_wgmma_m64, bf16x3_wgmma_swapab).
#pragma once

#include "wgmma.h"

namespace ddpm_ops {
namespace shapes {

constexpr int kBf16x3Threads = 128;  // one warpgroup: the weights leave no room for a second tile's exchange

// Where everything sits in the (1024-byte aligned) shared memory of a CTA
// keeping kOwn columns of each hidden layer in a cluster of cs; host and
// device both use it. Each layer's weights are a big and a small plane in
// the bf16_wgmma kernel's swizzled layout.
struct Bf16x3Layout {
  int own;
  int cs;
  int num_layers;
  int buffers = 1;  // exchange buffers, used in turn (ClusterLink)
  DDPM_HD constexpr int hidden() const { return own * cs; }
  DDPM_HD constexpr int rows(int l) const { return l + 1 == num_layers ? kWgmmaDimPad : own; }
  DDPM_HD constexpr int depth(int l) const {
    return l == 0 ? kWgmmaDimPad : (l + 1 == num_layers ? own : hidden());
  }
  DDPM_HD constexpr int plane_bytes(int l) const { return 2 * rows(l) * depth(l); }
  // Layer l's big plane; its small plane follows it. (Layers 1 to L - 2 are
  // all the same size.)
  DDPM_HD constexpr int weight_offset(int l) const {
    return l == 0 ? 0 : 2 * plane_bytes(0) + 4 * (l - 1) * own * hidden();
  }
  // 32-bit words a thread receives from one partner per exchange: a hidden
  // block (both planes of kOwn / 16 A fragments) or a partial eps (32 fp32
  // accumulators).
  DDPM_HD constexpr int exchange_words() const { return own / 2 > 32 ? own / 2 : 32; }
  // Bytes of one partner's slot in the buffer (thread-minor uint4s).
  DDPM_HD constexpr int slot_bytes() const { return 4 * exchange_words() * kBf16x3Threads; }
  // The partners' data, cs - 1 slots a buffer; none without a partner.
  DDPM_HD constexpr int buffer_offset() const {
    return weight_offset(num_layers - 1) + 2 * plane_bytes(num_layers - 1);
  }
  // fp32 biases of this CTA's columns: layer l's at l * own, the last one's 64 wide.
  DDPM_HD constexpr int buffer_bytes() const { return (cs - 1) * slot_bytes(); }
  DDPM_HD constexpr int bias_offset() const { return buffer_offset() + buffers * buffer_bytes(); }
  // Layer 0's time column (this CTA's columns), fp32.
  DDPM_HD constexpr int time_weight_offset() const {
    return bias_offset() + 4 * ((num_layers - 1) * own + kWgmmaDimPad);
  }
  // One mbarrier per warp and buffer: its 32 threads' share of the buffer.
  DDPM_HD constexpr int barrier_offset() const { return time_weight_offset() + 4 * own; }
  DDPM_HD constexpr int bytes() const { return barrier_offset() + 8 * buffers * (kBf16x3Threads / 32); }
};

}  // namespace shapes
}  // namespace ddpm_ops
