// The host-visible part of the fp32_resident kernel: its envelope and the
// register budget that decides which instantiations exist. Plain C++.
#pragma once

#include "../common/args.h"

namespace ddpm_ops {
namespace cuda_kernels {

constexpr int kResidentThreads = 256;
constexpr int kResidentWarps = kResidentThreads / 32;
constexpr int kResidentMaxDim = 64;      // layer 0: 2 columns of x per lane; last layer: 8 outputs per warp
constexpr int kResidentMaxHidden = 256;  // 2 float4 per lane
constexpr int kResidentMaxLayers = 4;    // the registers of 3 hidden layers' slices and the last layer's
constexpr int kResidentMaxCluster = 16;

// A lane's inner columns of a hidden layer: float4 q = lane + 32 i, i < 2 (so
// the reads of a row are conflict-free), element j of its 8 at column
// hidden_column(lane, j).
constexpr int kHiddenPerLane = 8;
// Layer 0's: x columns 2 lane and 2 lane + 1 (a float2).
constexpr int kInputPerLane = 2;

// Floats a thread of fp32_resident_kernel<opw, rows, layers> holds in
// registers through a hidden layer: its weights (layer 0's, the other hidden
// layers', the last layer's), and one layer's inputs and sums. The
// instantiations within kResidentMaxRegisterFloats compile without spills
// (ptxas -v: 254 registers at most); the host offers only those shapes.
DDPM_HD constexpr int resident_register_floats(int opw, int rows, int layers) {
  return kInputPerLane * opw + (layers - 2) * kHiddenPerLane * opw + 2 * opw + rows * kHiddenPerLane + rows * opw;
}
constexpr int kResidentMaxRegisterFloats = 224;
DDPM_HD constexpr bool resident_fits(int opw, int rows, int layers) {
  return rows * opw <= 32 && resident_register_floats(opw, rows, layers) <= kResidentMaxRegisterFloats;
}

}  // namespace cuda_kernels
}  // namespace ddpm_ops
