// Interface between the CPU op (fused_sample_cpu.cpp, built for the baseline
// ISA) and the per-ISA vectorised kernels (mlp_kernels_impl.h, compiled once per
// instruction set by mlp_kernels_{default,avx2,avx512}.cpp). Plain C++ only:
// no ATen types cross this boundary, so nothing compiled for AVX2/AVX-512 can
// leak into code that runs on a CPU without it.
#pragma once

#include <cstdint>

namespace ddpm_ops {
namespace cpu {

// Column padding of packed weights and activation buffers: a multiple of every
// vector width used (8 floats for AVX2 / generic, 16 for AVX-512).
constexpr int64_t kPad = 16;

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Everything the step loop reads, prepared once per call before it.
struct MlpPlan {
  int64_t dim = 0;         // features of x; layer 0 reads dim + 1 (the time column)
  int64_t num_layers = 0;  // L >= 1, SiLU between layers
  int64_t num_steps = 0;   // K
  int64_t act_ld = 0;      // row stride of the activation buffers (multiple of kPad)
  const int64_t* in_f = nullptr;   // [L] input features of layer l
  const int64_t* out_f = nullptr;  // [L] output features of layer l
  // nn.Linear weights (out_f, in_f) and biases, contiguous.
  const float* const* weight = nullptr;
  const float* const* bias = nullptr;
  // Vectorised path: weights packed transposed, (in_f[l], round_up(out_f[l], kPad))
  // row-major with zero columns past out_f[l]; biases zero-padded the same way.
  const float* const* packed_w = nullptr;
  const float* const* packed_b = nullptr;
  // When packed_w is nullptr, vec_tile runs the dot-product kernel on `weight`
  // row by row instead (no packing: the fastest for a single row).
  const int64_t* t_start = nullptr;  // [batch] int64
  const float* c1 = nullptr;         // sqrt_recip_alphas table
  const float* c2 = nullptr;         // coef_eps table
  float total_timesteps = 1.f;
};

// One instruction set's kernels.
struct Kernels {
  const char* name;
  // All K steps for rows [row0, row0 + rows) of x (row-major, stride dim, updated
  // in place). scratch holds 2 * rows * plan.act_ld floats.
  void (*vec_tile)(const MlpPlan& plan, float* x, int64_t row0, int64_t rows, float* scratch);
  // a[r, j] = act(a[r, j] + bias[j]) for r < rows, j < cols; act = SiLU or identity.
  void (*bias_act)(float* a, int64_t ld, int64_t rows, int64_t cols, const float* bias, bool silu);
  // x[r, :] = c1[t] * (x[r, :] - c2[t] * (eps[r, :] + bias)), t = t_start[row0 + r] - k.
  void (*ddpm_update)(const MlpPlan& plan, float* x, int64_t row0, int64_t rows,
                      const float* eps, int64_t ld, const float* bias, int64_t k);
  // in[r, :dim] = x[r, :], in[r, dim] = (t_start[row0 + r] - k) / T.
  void (*fill_input)(const MlpPlan& plan, const float* x, int64_t row0, int64_t rows,
                     float* in, int64_t ld, int64_t k);
  // Packs one nn.Linear layer for vec_tile: panel = w^T as (in_f, round_up(out_f,
  // kPad)) row-major, zero columns past out_f; packed_bias likewise padded.
  void (*pack_layer)(const float* w, const float* bias, int64_t out_f, int64_t in_f,
                     float* panel, float* packed_bias);
};

namespace DEFAULT { const Kernels* kernels(); }
namespace AVX2 { const Kernels* kernels(); }    // nullptr where not compiled
namespace AVX512 { const Kernels* kernels(); }  // nullptr where not compiled

}  // namespace cpu
}  // namespace ddpm_ops
