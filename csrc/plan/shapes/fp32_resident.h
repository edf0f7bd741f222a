// The fp32_resident kernel's envelope, the register budget that decides
// which instantiations exist, and its shared memory.
#pragma once

#include "../../common/host_device.h"
#include "../../common/sizes.h"
#include "../../common/step_tables.h"

#include <cstdint>

namespace ddpm_ops {
namespace shapes {

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

// The shared memory of a CTA of fp32_resident_kernel<kOpw, kRows, L>; the
// bias networks' rows follow it (resident_bias_floats_at).
template <int kOpw, int kRows>
struct ResidentBuffers {
  float x[kRows][kResidentMaxDim];  // layer 0's input, zero past dim (the bias rows go with the bias)
  float x0_prev[kRows][kResidentMaxDim];  // the previous step's clipped x0 (the P table's term)
  float hidden[2][kRows][kResidentMaxHidden];  // exchanged hidden outputs, zero past H
  float last[kRows][8 * kOpw];      // this CTA's columns of the last hidden layer
  float partial[2][kResidentMaxCluster][kRows][kResidentMaxDim];  // eps partial sums, by sender
  float coef[2][kStepTablesWithPrevious][kRows];  // the step's coefficients per row, by step parity
  uint64_t bars[4];                 // hidden[0], hidden[1], partial[0], partial[1]
};

// Where the bias networks' rows start in a CTA's shared memory (floats):
// after ResidentBuffers (the kernel asserts that it fits), 16-byte aligned.
DDPM_HD constexpr int resident_bias_floats_at(int opw, int rows) {
  return round_up4(2 * rows * kResidentMaxDim + 2 * rows * kResidentMaxHidden + rows * 8 * opw +
                   2 * kResidentMaxCluster * rows * kResidentMaxDim + 2 * static_cast<int>(kStepTablesWithPrevious) * rows +
                   4 * 2);
}

}  // namespace shapes
}  // namespace ddpm_ops
