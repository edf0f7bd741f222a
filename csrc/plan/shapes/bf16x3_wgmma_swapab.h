// The bf16x3_wgmma_swapab kernel's block and its shared-memory layout.
#pragma once

#include "bf16x3.h"

namespace ddpm_ops {
namespace shapes {

constexpr int kSwapabThreads = 128;  // one warpgroup
static_assert(kSwapabThreads == kBf16x3Threads, "the bf16x3_wgmma_m64 kernel's staging (stage_bf16x3_net) serves both");

// Where everything sits in the shared memory of a CTA (1024-byte aligned:
// every tile starts a swizzle period). The weights, biases and time column
// are the bf16x3_wgmma_m64 kernel's (Bf16x3Layout without exchange buffers); then the B
// tiles, each [plane][64-column block][kN rows][128 bytes].
struct SwapabLayout {
  int own;
  int cs;
  int num_layers;
  int rows;  // kN
  DDPM_HD constexpr Bf16x3Layout weights() const { return {own, cs, num_layers, 0}; }
  DDPM_HD constexpr int hidden() const { return own * cs; }
  // Tiles of hidden layers' outputs exchanged in the cluster, used in turn.
  // Exchange n writes tile n % act_buffers() of each partner. Before it, the
  // CTA has received the partners' exchange n - 1 (or, where that was the
  // step before, their partial eps after it), which they sent after their
  // layer that read exchange n - 2 had finished: so with two tiles no
  // exchange overwrites data still being read, and with one wherever a
  // partial eps separates consecutive exchanges (3 layers: one exchange a
  // step). The same order keeps a CTA's own block from being rewritten
  // while the bulk copies of exchange n - act_buffers() still read it.
  DDPM_HD constexpr int act_buffers() const { return num_layers >= 4 ? 2 : (num_layers == 3 ? 1 : 0); }
  // Partial-eps slots: one suffices where a hidden exchange separates a
  // step's partial from the next (a partner's next partial needs this CTA's
  // exchange, which it sends after reading its slots); 2 layers alternate two.
  DDPM_HD constexpr int eps_buffers() const { return cs == 1 ? 0 : (num_layers == 2 ? 2 : 1); }
  DDPM_HD constexpr int block_bytes() const { return 4 * own * rows; }  // one CTA's columns, both planes
  DDPM_HD constexpr int act_offset() const { return (weights().bytes() + 1023) / 1024 * 1024; }
  DDPM_HD constexpr int act_bytes() const { return cs * block_bytes(); }
  // The last hidden layer's own block, the output layer's input.
  DDPM_HD constexpr int last_in_offset() const { return act_offset() + act_buffers() * act_bytes(); }
  DDPM_HD constexpr int x_offset() const { return last_in_offset() + block_bytes(); }
  // The partners' partial eps: slot p - 1 of a buffer from CTA r ^ p, kN / 8
  // uint4 per thread, thread-minor.
  DDPM_HD constexpr int eps_offset() const { return x_offset() + 4 * kWgmmaDimPad * rows; }
  DDPM_HD constexpr int eps_slot_bytes() const { return 2 * rows * kSwapabThreads; }
  DDPM_HD constexpr int barrier_offset() const {
    return eps_offset() + eps_buffers() * (cs - 1) * eps_slot_bytes();
  }
  // mbarriers: the exchanged tiles', then the eps buffers'.
  DDPM_HD constexpr int bytes() const { return barrier_offset() + 8 * (act_buffers() + eps_buffers()); }
};

}  // namespace shapes
}  // namespace ddpm_ops
