// Sizes that the launch plan and the CUDA kernels count alike.
#pragma once

#include "host_device.h"

namespace ddpm_ops {

// The schema allows any depth; kernel arguments carry a fixed-size table
// (fused_sample_cuda.cu runs a deeper rule call as the ATen loop and refuses
// a deeper time-column call).
constexpr int kMaxLayers = 32;

// Shared-memory rows are laid out in whole float4s, so that they are read as
// float4 and every row starts on a 16-byte boundary.
DDPM_HD constexpr int round_up4(int v) { return (v + 3) & ~3; }

}  // namespace ddpm_ops
