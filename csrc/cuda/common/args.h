// What every kernel of ddpm::fused_sample takes (the net, the tables and the
// batch as raw pointers) and the helpers that host and device share. Plain
// C++: the launch plan (csrc/plan), built without CUDA too, includes it.
#pragma once

#include <cstdint>

#include "../../host_device.h"

namespace ddpm_ops {
namespace cuda_kernels {

// The schema allows any depth; kernel arguments carry a fixed-size table.
constexpr int kMaxLayers = 32;

struct LayerArgs {
  const float* weight;  // (out, in), row-major, global memory
  const float* bias;    // (out,)
  int in;
  int out;
};

struct SampleArgs {
  LayerArgs layers[kMaxLayers];
  int num_layers;
  const float* x;          // (batch, dim) contiguous
  const void* t_start;     // (batch,) int32 or int64
  bool t_is_int64;
  const float* sqrt_recip_alphas;
  const float* coef_eps;
  int table_length;
  float* out;              // (batch, dim) contiguous
  int batch;
  int dim;
  int num_steps;
  float total_timesteps;
};

DDPM_HD inline int round_up4(int v) { return (v + 3) & ~3; }

}  // namespace cuda_kernels
}  // namespace ddpm_ops
