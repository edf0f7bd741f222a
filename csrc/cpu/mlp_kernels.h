// Interface between the CPU op (fused_sample_cpu.cpp, built for the baseline
// ISA) and the per-ISA vectorised kernels (mlp_kernels_impl.h, compiled once per
// instruction set by mlp_kernels_{default,avx2,avx512}.cpp). Plain C++ only:
// no ATen types cross this boundary, so nothing compiled for AVX2/AVX-512 can
// leak into code that runs on a CPU without it.
#pragma once

#include <cstdint>
#include <limits>

#include "../common/activation.h"

namespace ddpm_ops {
namespace cpu {

// Column padding of packed weights and activation buffers: a multiple of every
// vector width used (8 floats for AVX2 / generic, 16 for AVX-512).
constexpr int64_t kPad = 16;

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Everything the step loop reads, prepared once per call before it. One step
// of row r at step index s = t_start[r] - k:
//   h  = W0 x + b0 + time_bias[s] + (s / T) * time_weight + cond_bias[r]
//   e  = the rest of the MLP (act[l] after every layer l but the last)
//   x0 = A[s] x - B[s] e, clamped to [clip_lo, clip_hi] (per column) when given
//   x  = C[s] x0 + D[s] x + E[s] e + S[s] z[k, r] + P[s] x0_prev, then clamped to
//        [post_lo, post_hi] when given; with the tables Q and R, the E term reads
//        Q[s] x - R[s] x0 (the eps read back from the clamped x0), clamped to
//        [eps_lo, eps_hi], instead of e
//        (z: `noise`, or drawn from `noise_seed`; x0_prev: the previous step's
//        clamped x0, none at k = 0)
// A null table stands for its identity (A: 1; D, E, S, P: 0), so a rule that
// lacks a term costs nothing for it. The network computes in float32; the
// step (x0 and x) in the sample's scalar type T: float, or double for a
// float64 sample, whose network reads x rounded to float32 and whose e is
// widened to double, as an eager loop that casts around its network does.
template <typename T>
struct StepTables {
  const T *A = nullptr, *B = nullptr, *C = nullptr, *D = nullptr, *E = nullptr, *S = nullptr,
          *P = nullptr, *Q = nullptr, *R = nullptr;
  // The clamps' bounds, dim values each (a pair of floats repeated, or the
  // per-column bounds); null: no clamp.
  const T *clip_lo = nullptr, *clip_hi = nullptr, *post_lo = nullptr, *post_hi = nullptr;
  const T* noise = nullptr;  // (K, batch, dim); null: no noise term
  T* chain = nullptr;        // (K + 1, batch, dim): x after step k goes to chain[k + 1]
  // z clamped to [-noise_clip, noise_clip] before it is scaled; 0: no clamp.
  T noise_clip = 0;
  // The read-back eps's clamp (with Q and R; infinite: no clamp).
  T eps_lo = -std::numeric_limits<T>::infinity(), eps_hi = std::numeric_limits<T>::infinity();
};

// One instruction of a network program as the kernels run it: buffers by
// number (kProgramX: x's rows; kProgramInput: the concatenated input; 0, 1,
// ...: activation buffers of the tile's scratch), assigned once per call by
// the CPU op so that a saved h is never overwritten before its "add".
constexpr int32_t kProgramX = -1;
constexpr int32_t kProgramInput = -2;

struct ProgramOp {
  enum Kind : int32_t { kLinear, kActivation, kLayerNorm, kAdd };
  Kind kind;
  Activation act = Activation::kIdentity;  // kLinear: applied after it (fused); kActivation
  int32_t layer = -1;                      // kLinear: the layer (weights, packed panels)
  int32_t src = kProgramX, dst = 0;        // dst may be src (in place)
  int32_t other = 0;                       // kAdd: dst = src + other
  int64_t width = 0;                       // kActivation, kLayerNorm, kAdd: h's columns
  float eps = 0.f;                         // kLayerNorm
  const float* gamma = nullptr;            // kLayerNorm's affine part, or null
  const float* beta = nullptr;
};

struct MlpPlan {
  int64_t batch = 0;
  int64_t dim = 0;         // features of x, the input of layer 0
  int64_t num_layers = 0;  // L >= 1
  int64_t num_steps = 0;   // K
  int64_t act_ld = 0;      // row stride of the activation buffers (multiple of kPad)
  const int64_t* in_f = nullptr;   // [L] input features of layer l
  const int64_t* out_f = nullptr;  // [L] output features of layer l
  const Activation* act = nullptr; // [L - 1] activation after layer l
  // nn.Linear weights (out_f, in_f) with row stride weight_ld[l], and biases.
  const float* const* weight = nullptr;
  const int64_t* weight_ld = nullptr;
  const float* const* bias = nullptr;
  // Vectorised path: weights packed transposed, (in_f[l], round_up(out_f[l], kPad))
  // row-major with zero columns past out_f[l]; biases zero-padded the same way.
  const float* const* packed_w = nullptr;
  const float* const* packed_b = nullptr;
  // When packed_w is nullptr, vec_tile runs the dot-product kernel on `weight`
  // row by row instead (no packing: the fastest for a single row).
  const int64_t* t_start = nullptr;  // [batch] int64

  // Layer 0's extra bias rows; any may be null.
  const float* time_bias = nullptr;    // (steps table, out_f[0]), row stride out_f[0]
  const float* time_weight = nullptr;  // (out_f[0]): the t / T input column's weights
  float total_timesteps = 1.f;
  const float* cond_bias = nullptr;    // (batch, out_f[0]), row stride out_f[0]

  // The step of a float32 sample, whose rows are the kernels' x.
  StepTables<float> step;
  // A float64 sample: its rows (batch, dim), updated in place by the step in
  // float64 (step64), while the kernels' x holds them rounded to float32 for
  // the network; null for a float32 sample.
  double* x64 = nullptr;
  StepTables<double> step64;
  // Instead of `noise`: z drawn from these seeds (seeded_noise.h), one for
  // the batch or, with seed_per_row, [batch] (noise_key).
  const int64_t* noise_seeds = nullptr;
  bool seed_per_row = false;

  // A network program instead of the chain of layers with act[] (null: the chain).
  const ProgramOp* program = nullptr;
  int64_t program_ops = 0;
  int64_t program_buffers = 0;  // activation buffers it uses
  // The concatenated input of a program that has one: the columns of x, then
  // of the parts in input_parts order (0: x, 1: cond rows, 2: time rows by step index).
  int32_t input_parts[3] = {0, 0, 0};
  int32_t num_input_parts = 0;  // 0: the program reads x itself
  int64_t input_ld = 0;         // row stride of the input buffer
  const float* cond_input = nullptr;  // (batch, cond_cols)
  int64_t cond_cols = 0;
  const float* time_input = nullptr;  // (steps table, time_cols)
  int64_t time_cols = 0;

  // Set where one tile runs on the calling thread with threads to spare and the
  // weights are read unpacked: a layer of at least split_weights weights runs
  // its output columns split between the threads, in pieces of at least half
  // that (a parallel region's cost grows with its threads; two or three cores
  // stream a layer about as fast as more). parallel_columns(n, grain, fn, ctx)
  // calls fn(ctx, begin, end) over [0, n) on the threads, at least grain at a
  // time (at::parallel_for, compiled for the baseline ISA, so that no ATen
  // inline code is built for a wider one).
  void (*parallel_columns)(int64_t n, int64_t grain, void (*fn)(void* ctx, int64_t begin, int64_t end),
                           void* ctx) = nullptr;
  int64_t split_weights = 0;

  // Whether layer 0 needs bias rows of its own (else it uses bias[0] for every row).
  bool row_bias() const { return time_bias != nullptr || time_weight != nullptr || cond_bias != nullptr; }
  // Whether the rule has a P table: the previous x0 is kept per row.
  bool previous() const { return x64 != nullptr ? step64.P != nullptr : step.P != nullptr; }
};

// The activation buffers of a tile: two for the chain, the program's own count.
inline int64_t activation_buffers(const MlpPlan& plan) {
  return plan.program != nullptr ? plan.program_buffers : 2;
}

// The scratch floats a tile of `rows` rows needs: the activation buffers and
// layer 0's bias rows (act_ld columns each), a program's concatenated input
// (input_ld columns), then the previous x0 when the rule has a P table (dim
// columns of the sample's scalar type: two floats a column for a float64
// sample; the offset is a multiple of kPad floats, so its doubles are aligned).
inline int64_t scratch_floats(const MlpPlan& plan, int64_t rows) {
  const int64_t per_column = plan.x64 != nullptr ? 2 : 1;
  return (activation_buffers(plan) + 1) * rows * plan.act_ld + rows * plan.input_ld +
         (plan.previous() ? per_column * rows * plan.dim : 0);
}

// Layer 0's bias rows in a tile's scratch (see scratch_floats).
inline float* row_bias_rows(const MlpPlan& plan, float* scratch, int64_t rows) {
  return scratch + activation_buffers(plan) * rows * plan.act_ld;
}

// A program's concatenated input rows in a tile's scratch.
inline float* input_rows(const MlpPlan& plan, float* scratch, int64_t rows) {
  return scratch + (activation_buffers(plan) + 1) * rows * plan.act_ld;
}

// The previous x0's rows in a tile's scratch (see scratch_floats), or null;
// doubles for a float64 sample.
inline float* previous_x0(const MlpPlan& plan, float* scratch, int64_t rows) {
  return plan.previous()
             ? scratch + (activation_buffers(plan) + 1) * rows * plan.act_ld + rows * plan.input_ld
             : nullptr;
}

// One instruction set's kernels.
struct Kernels {
  const char* name;
  // All K steps for rows [row0, row0 + rows) of x (row-major, stride dim, updated
  // in place). scratch holds scratch_floats(plan, rows) floats, zero-filled.
  void (*vec_tile)(const MlpPlan& plan, float* x, int64_t row0, int64_t rows, float* scratch);
  // a[r, j] = act(a[r, j] + bias[r * bias_ld + j]) for r < rows, j < cols.
  void (*bias_act)(float* a, int64_t ld, int64_t rows, int64_t cols, const float* bias,
                   int64_t bias_ld, Activation act);
  // Layer 0's bias rows for step k: out[r, :out_f[0]] (row stride ld).
  void (*first_bias)(const MlpPlan& plan, int64_t row0, int64_t rows, float* out, int64_t ld,
                     int64_t k);
  // The step update of rows [row0, row0 + rows) from e = eps + bias (bias may be
  // null), then the chain record of step k. x0_prev: (rows, dim) row-major,
  // the rows' previous clamped x0 (doubles for a float64 sample), replaced by
  // this step's (only when plan.previous()). For a float64 sample, x's rows
  // are those of plan.x64 rounded to float32, rewritten after the update.
  void (*step_update)(const MlpPlan& plan, float* x, int64_t row0, int64_t rows,
                      const float* eps, int64_t ld, const float* bias, int64_t k, float* x0_prev);
  // Packs one nn.Linear layer for vec_tile: panel = w^T as (in_f, round_up(out_f,
  // kPad)) row-major, zero columns past out_f; packed_bias likewise padded.
  void (*pack_layer)(const float* w, int64_t ld_w, const float* bias, int64_t out_f, int64_t in_f,
                     float* panel, float* packed_bias);
};

namespace DEFAULT { const Kernels* kernels(); }
// Linked in on x86-64 only (setup.py defines DDPM_OPS_X86_ISA_KERNELS); nullptr
// where the compiler cannot target the ISA (mlp_kernels_isa_build.h).
namespace AVX2 { const Kernels* kernels(); }
namespace AVX512 { const Kernels* kernels(); }

}  // namespace cpu
}  // namespace ddpm_ops
