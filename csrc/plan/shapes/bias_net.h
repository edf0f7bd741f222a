// The shared memory the engine's kernels give the bias networks (the
// prologue's, csrc/cuda/common/prologue.cuh), which the plan counts into each
// engine kernel's block.
#pragma once

#include "../../common/host_device.h"

namespace ddpm_ops {
namespace shapes {

// The shared memory (floats) of the bias networks' rows in a block of `rows`
// rows whose layer 0 columns are `cols` wide: the condition rows, `window`
// steps of time rows, and the networks' hidden layers (two buffers).
DDPM_HD inline int bias_net_floats(int rows, int cols, int window, bool time_net, bool cond_net, int widest_hidden) {
  if (!time_net && !cond_net) return 0;
  const int evaluated = rows * (time_net ? window : 1);
  return (cond_net ? rows * cols : 0) + (time_net ? rows * window * cols : 0) + 2 * evaluated * widest_hidden;
}

}  // namespace shapes
}  // namespace ddpm_ops
