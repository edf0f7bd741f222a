// The transposing shuffle reduction of the kernels on CUDA cores
// (fp32_smem, fp32_resident).
#pragma once

namespace ddpm_ops {
namespace cuda_kernels {

// The transposing levels of smem_layer's reduction, while a lane holds N
// of the tile's V sums: at offset o = 16 N / V the lanes with bit o set keep
// the upper half of their values and take their partner's share of it.
// Recursive on N so that every index is a constant (the array stays in
// registers).
template <int V, int N>
__device__ __forceinline__ void reduce_transposing(float (&v)[V], int lane) {
  if constexpr (N > 1) {
    constexpr int half = N / 2;
    constexpr int o = 16 * N / V;
    const bool upper = (lane & o) != 0;
#pragma unroll
    for (int q = 0; q < half; ++q) {
      // By value: a conditional of two array elements would select their
      // addresses and put the array in local memory.
      const float lo = v[q], hi = v[q + half];
      const float send = upper ? lo : hi;
      const float keep = upper ? hi : lo;
      v[q] = keep + __shfl_xor_sync(0xffffffffu, send, o);
    }
    reduce_transposing<V, half>(v, lane);
  }
}

}  // namespace cuda_kernels
}  // namespace ddpm_ops
