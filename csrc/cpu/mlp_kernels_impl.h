// The vectorised kernels of the CPU op, written once against at::vec and
// compiled once per instruction set. The including file defines CPU_CAPABILITY
// (DEFAULT, AVX2 or AVX512) and the matching CPU_CAPABILITY_<ISA> macro the way
// ATen's own kernels are built, so at::vec::Vectorized<float> is the real SIMD
// type, and everything here lands in namespace ddpm_ops::cpu::CPU_CAPABILITY.
//
// Register-blocked layer kernel: a block of MR rows x NB vectors of output
// neurons lives in registers; for every input feature i it loads NB vectors of
// the packed (transposed) weight row i once and reuses them for all MR rows
// (one broadcast each). Nothing is allocated; every loop bound that shapes
// registers is a template constant.
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../common/seeded_noise.h"
#include "mlp_kernels.h"

namespace ddpm_ops {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int kV = Vec::size();
static_assert(kPad % kV == 0, "kPad must be a multiple of the vector width");

#if defined(CPU_CAPABILITY_AVX512)
constexpr int kRegs = 32;
#else
constexpr int kRegs = 16;
#endif
constexpr int kMaxRows = 6;  // MR: rows per register block

// Output vectors per register block for MR rows: MR * NB accumulators + NB
// weight vectors + one broadcast fit in the register file.
constexpr int max_nb(int mr) {
  int nb = (kRegs - 1) / (mr + 1);
  return nb > 8 ? 8 : (nb < 1 ? 1 : nb);
}

// The activations' exp is ATen's exp_u20 (within 20 ulp; Sleef's exp, within
// 1 ulp, cost SiLU and Mish about a quarter of a call at batch 4096): the
// error it adds stays far below the op's 1e-5 against float64.
inline Vec silu(Vec v) {
  // v / (1 + exp(-v)): exp_u20 saturates near FLT_MAX for v << 0, giving ~-0 (the limit).
  return v / (Vec(1.f) + (Vec(0.f) - v).exp_u20());
}

inline Vec mish(Vec v) {
  // v * tanh(log1p(exp(v))) with one exp: tanh(log(1 + n)) = n (n + 2) / (n (n + 2) + 2).
  // From v = 20 on the factor is 1 in float32, so the exp's argument stops there
  // (n (n + 2) would overflow past about 44).
  const Vec n = at::vec::clamp_max(v, Vec(20.f)).exp_u20();  // NaN stays NaN
  const Vec p = n * (n + Vec(2.f));
  return v * p / (p + Vec(2.f));
}

// One overload per activation (visit_activation picks it).
inline Vec activate(Vec v, ActivationTag<Activation::kSilu>) { return silu(v); }
inline Vec activate(Vec v, ActivationTag<Activation::kMish>) { return mish(v); }
inline Vec activate(Vec v, ActivationTag<Activation::kRelu>) { return at::vec::clamp_min(v, Vec(0.f)); }
inline Vec activate(Vec v, ActivationTag<Activation::kGelu>) {
  return Vec(0.5f) * v * (Vec(1.f) + (v * Vec(static_cast<float>(M_SQRT1_2))).erf());
}
inline Vec activate(Vec v, ActivationTag<Activation::kGeluTanh>) {
  const Vec inner = Vec(0.7978845608028654f) * (v + Vec(0.044715f) * v * v * v);
  return Vec(0.5f) * v * (Vec(1.f) + inner.tanh());
}
inline Vec activate(Vec v, ActivationTag<Activation::kTanh>) { return v.tanh(); }
inline Vec activate(Vec v, ActivationTag<Activation::kIdentity>) { return v; }

// The activation over `vectors` stored vectors, in place. Kept out of line:
// inlined into a register-blocked kernel, its constants are hoisted above
// the product loop and push the accumulators out of registers (Mish was 34%
// slower than SiLU per call at batch 4096 that way, 12% out of line; seed
// net, one AVX-512 thread).
template <Activation ACT>
__attribute__((noinline)) void activate_span(float* p, int64_t vectors) {
  for (int64_t n = 0; n < vectors; ++n) {
    activate(Vec::loadu(p + n * kV), ActivationTag<ACT>{}).store(p + n * kV);
  }
}

// bias_ld: the row stride of the bias rows; 0 shares one bias row.
template <int MR, int NB, Activation ACT>
inline void block(const float* in, int64_t ld_in, int64_t in_f, const float* w, int64_t ld_w,
                  const float* bias, int64_t bias_ld, float* out, int64_t ld_out) {
  Vec acc[MR][NB];
  for (int r = 0; r < MR; ++r) {
    for (int n = 0; n < NB; ++n) acc[r][n] = Vec::loadu(bias + r * bias_ld + n * kV);
  }
  for (int64_t i = 0; i < in_f; ++i) {
    const float* w_row = w + i * ld_w;
    Vec wv[NB];
    for (int n = 0; n < NB; ++n) wv[n] = Vec::loadu(w_row + n * kV);
    for (int r = 0; r < MR; ++r) {
      const Vec a(in[r * ld_in + i]);
      for (int n = 0; n < NB; ++n) acc[r][n] = at::vec::fmadd(a, wv[n], acc[r][n]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int n = 0; n < NB; ++n) acc[r][n].store(out + r * ld_out + n * kV);
  }
  if constexpr (ACT != Activation::kIdentity) {
    for (int r = 0; r < MR; ++r) activate_span<ACT>(out + r * ld_out, NB);
  }
}

// All output vectors [0, nvec) of MR rows, NB at a time, remainder below.
template <int MR, Activation ACT, int NB = max_nb(MR)>
inline void row_block(const float* in, int64_t ld_in, int64_t in_f, const float* w,
                      int64_t ld_w, const float* bias, int64_t bias_ld, float* out,
                      int64_t ld_out, int64_t nvec) {
  int64_t v0 = 0;
  for (; v0 + NB <= nvec; v0 += NB) {
    block<MR, NB, ACT>(in, ld_in, in_f, w + v0 * kV, ld_w, bias + v0 * kV, bias_ld,
                       out + v0 * kV, ld_out);
  }
  if constexpr (NB > 1) {
    if (v0 < nvec) {
      row_block<MR, ACT, NB - 1>(in, ld_in, in_f, w + v0 * kV, ld_w, bias + v0 * kV, bias_ld,
                                 out + v0 * kV, ld_out, nvec - v0);
    }
  }
}

template <Activation ACT, int MR = kMaxRows>
inline void rows_dispatch(int64_t rows, const float* in, int64_t ld_in, int64_t in_f,
                          const float* w, int64_t ld_w, const float* bias, int64_t bias_ld,
                          float* out, int64_t ld_out, int64_t nvec) {
  if constexpr (MR >= 1) {
    if (rows == MR) {
      row_block<MR, ACT>(in, ld_in, in_f, w, ld_w, bias, bias_ld, out, ld_out, nvec);
    } else {
      rows_dispatch<ACT, MR - 1>(rows, in, ld_in, in_f, w, ld_w, bias, bias_ld, out, ld_out, nvec);
    }
  }
}

// One layer for `rows` rows: out = act(in @ W^T + bias rows) over padded columns.
// Column panels outside, row blocks inside: a panel of the weights (in_f x
// kPanelVectors vectors, 16 KB at width 256 with AVX2) stays in L1 while every
// row block of the tile reads it, instead of coming from L2 once per block.
void layer(const float* in, int64_t ld_in, int64_t rows, int64_t in_f, const float* w,
           int64_t out_pad, const float* bias, int64_t bias_ld, float* out, int64_t ld_out,
           Activation act) {
  constexpr int64_t kPanelVectors = max_nb(kMaxRows);
  const int64_t nvec = out_pad / kV;
  visit_activation(act, [&](auto a) {
    for (int64_t v0 = 0; v0 < nvec; v0 += kPanelVectors) {
      const int64_t panel = std::min(kPanelVectors, nvec - v0);
      for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
        const int64_t mr = std::min<int64_t>(kMaxRows, rows - r0);
        rows_dispatch<decltype(a)::value>(mr, in + r0 * ld_in, ld_in, in_f, w + v0 * kV, out_pad,
                                          bias + r0 * bias_ld + v0 * kV, bias_ld,
                                          out + r0 * ld_out + v0 * kV, ld_out, panel);
      }
    }
  });
}

// ---- Dot-product path for single rows (batch 1): reads the nn.Linear weights
// (out, in) in place, so a call needs no packing. kV outputs at a time, one
// accumulator per output, input chunks shared by all of them; the kV
// accumulators are then reduced together into one vector of kV sums.

// Lane j of the result = sum of the lanes of acc[j], j < kV.
inline Vec reduce_lanes(const Vec* acc) {
#if defined(CPU_CAPABILITY_AVX512)
  auto hadd = [](__m512 a, __m512 b) {  // per 128-bit lane: [a0+a1, a2+a3, b0+b1, b2+b3]
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
  };
  __m512 c[8];
  for (int k = 0; k < 8; ++k) {  // 256-bit halves: partial sums of acc[k] | acc[k + 8]
    const __m512 a = acc[k], b = acc[k + 8];
    c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  const __m512 u0 = hadd(hadd(c[0], c[1]), hadd(c[2], c[3]));
  const __m512 u1 = hadd(hadd(c[4], c[5]), hadd(c[6], c[7]));
  // 128-bit lanes of u0: acc[0..3] (two halves), acc[8..11] (two halves); u1: +4.
  const __m512 r = _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88),
                                 _mm512_shuffle_f32x4(u0, u1, 0xDD));
  return _mm512_shuffle_f32x4(r, r, 0xD8);  // lanes [0..3, 8..11, 4..7, 12..15] -> in order
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 t0 = _mm256_hadd_ps(acc[0], acc[1]), t1 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 t2 = _mm256_hadd_ps(acc[4], acc[5]), t3 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
#else
  float sums[kV];
  for (int j = 0; j < kV; ++j) {
    float lanes[kV];
    acc[j].store(lanes);
    float s = 0.f;
    for (int l = 0; l < kV; ++l) s += lanes[l];
    sums[j] = s;
  }
  return Vec::loadu(sums);
#endif
}

// out[j] = act(bias[j] + sum_i x[i] * w[j, i]) for j < out_f, one row; w's
// rows have stride ld_w.
template <Activation ACT>
void dot_layer_row(const float* x, int64_t in_f, const float* w, int64_t ld_w, const float* bias,
                   int64_t out_f, float* out) {
  const int64_t in_full = in_f - in_f % kV;
  const int64_t tail = in_f - in_full;
  const int64_t j_full = out_f - out_f % kV;
  Vec acc[kV];
  for (int64_t j0 = 0; j0 < out_f; j0 += kV) {
    const int64_t nj = std::min<int64_t>(kV, out_f - j0);
    const float* wj = w + j0 * ld_w;
    if (j0 < j_full) {
      for (int j = 0; j < kV; ++j) acc[j] = Vec(0.f);
      for (int64_t i = 0; i < in_full; i += kV) {
        const Vec xv = Vec::loadu(x + i);
        for (int j = 0; j < kV; ++j) acc[j] = at::vec::fmadd(Vec::loadu(wj + j * ld_w + i), xv, acc[j]);
      }
      if (tail > 0) {
        const Vec xv = Vec::loadu(x + in_full, tail);  // masked: never reads past the row
        for (int j = 0; j < kV; ++j) {
          acc[j] = at::vec::fmadd(Vec::loadu(wj + j * ld_w + in_full, tail), xv, acc[j]);
        }
      }
    } else {  // the last, partial block of outputs
      for (int j = 0; j < kV; ++j) acc[j] = Vec(0.f);
      for (int64_t j = 0; j < nj; ++j) {
        Vec a(0.f);
        for (int64_t i = 0; i < in_full; i += kV) {
          a = at::vec::fmadd(Vec::loadu(wj + j * ld_w + i), Vec::loadu(x + i), a);
        }
        if (tail > 0) {
          a = at::vec::fmadd(Vec::loadu(wj + j * ld_w + in_full, tail), Vec::loadu(x + in_full, tail), a);
        }
        acc[j] = a;
      }
    }
    activate(reduce_lanes(acc) + Vec::loadu(bias + j0, nj), ActivationTag<ACT>{}).store(out + j0, nj);
  }
}

// ---- Dot-product path for a few rows (network programs' small tiles): the
// nn.Linear weights as they are, like dot_layer_row, but kOuts outputs x kDotRows
// rows at a time, so that each weight vector loaded serves kDotRows rows, and
// every block of kOuts weight rows (16 KB at in_f 1024) stays in L1 while all
// the tile's rows pass: the weights stream from memory once a step whatever
// the rows, and no call packs them (packing IDQL's 6 MB of weights cost a
// small batch's call more than its steps). The accumulators are reduced kV at
// a time (reduce_lanes). With AVX2's 16 registers, 3 outputs x 4 rows keep 12
// sums in flight: 4 x 2's 8 sums barely cover two FMA ports' 4-cycle latency
// (IDQL's and DPPO's programs at batch 8 took 15% longer with them, one
// AVX2 thread).
#if defined(CPU_CAPABILITY_AVX2)
constexpr int kOuts = 3;
constexpr int kDotRows = 4;
#else
constexpr int kOuts = 4;
constexpr int kDotRows = kV / kOuts;
#endif
constexpr int kDotSums = kOuts * kDotRows;
constexpr int kDotGroups = (kDotSums + kV - 1) / kV;

// out[r, j] = bias[r * bias_ld + j] + sum_i in[r, i] w[j, i], j < out_f, r < rows
// (no activation: the caller applies it).
void dot_layer_rows(const float* in, int64_t ld_in, int64_t rows, int64_t in_f, const float* w,
                    int64_t ld_w, const float* bias, int64_t bias_ld, int64_t out_f, float* out,
                    int64_t ld_out) {
  const int64_t in_full = in_f - in_f % kV;
  const int64_t tail = in_f - in_full;
  for (int64_t j0 = 0; j0 < out_f; j0 += kOuts) {
    const int64_t nj = std::min<int64_t>(kOuts, out_f - j0);
    const float* wr[kOuts];
    for (int o = 0; o < kOuts; ++o) wr[o] = w + (j0 + (o < nj ? o : 0)) * ld_w;  // past out_f: row j0, discarded
    for (int64_t r0 = 0; r0 < rows; r0 += kDotRows) {
      const int64_t nr = std::min<int64_t>(kDotRows, rows - r0);
      const float* xr[kDotRows];
      for (int r = 0; r < kDotRows; ++r) xr[r] = in + (r0 + (r < nr ? r : 0)) * ld_in;
      Vec acc[kDotGroups * kV];
      for (int a = 0; a < kDotGroups * kV; ++a) acc[a] = Vec(0.f);
      for (int64_t i = 0; i < in_full; i += kV) {
        Vec wv[kOuts];
        for (int o = 0; o < kOuts; ++o) wv[o] = Vec::loadu(wr[o] + i);
        for (int r = 0; r < kDotRows; ++r) {
          const Vec xv = Vec::loadu(xr[r] + i);
          for (int o = 0; o < kOuts; ++o) acc[r * kOuts + o] = at::vec::fmadd(wv[o], xv, acc[r * kOuts + o]);
        }
      }
      if (tail > 0) {
        Vec wv[kOuts];
        for (int o = 0; o < kOuts; ++o) wv[o] = Vec::loadu(wr[o] + in_full, tail);
        for (int r = 0; r < kDotRows; ++r) {
          const Vec xv = Vec::loadu(xr[r] + in_full, tail);
          for (int o = 0; o < kOuts; ++o) acc[r * kOuts + o] = at::vec::fmadd(wv[o], xv, acc[r * kOuts + o]);
        }
      }
      float sums[kDotGroups * kV];
      for (int g = 0; g < kDotGroups; ++g) reduce_lanes(acc + g * kV).store(sums + g * kV);
      for (int64_t r = 0; r < nr; ++r) {
        for (int64_t o = 0; o < nj; ++o) {
          out[(r0 + r) * ld_out + j0 + o] = sums[r * kOuts + o] + bias[(r0 + r) * bias_ld + j0 + o];
        }
      }
    }
  }
}

// Calls fn(offset, n) over [0, cols) in vectors of N lanes and one masked remainder.
template <int64_t N = kV, typename Fn>
inline void for_vectors(int64_t cols, Fn&& fn) {
  int64_t j = 0;
  for (; j + N <= cols; j += N) fn(j, N);
  if (j < cols) fn(j, cols - j);
}

// Vectors of T: float32, and float64 for a float64 sample's step (half as many lanes).
template <typename T>
using Lanes = at::vec::Vectorized<T>;

// n <= Lanes<T>::size() values at p (masked loads and stores touch nothing past them).
template <typename T>
inline Lanes<T> load(const T* p, int64_t n) {
  return n == Lanes<T>::size() ? Lanes<T>::loadu(p) : Lanes<T>::loadu(p, n);
}
template <typename T>
inline void store(Lanes<T> v, T* p, int64_t n) {
  n == Lanes<T>::size() ? v.store(p) : v.store(p, n);
}

void first_bias(const MlpPlan& p, int64_t row0, int64_t rows, float* out, int64_t ld, int64_t k) {
  const int64_t h = p.out_f[0];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t s = p.t_start[row0 + r] - k;
    const float* cond = p.cond_bias != nullptr ? p.cond_bias + (row0 + r) * h : nullptr;
    const float* time = p.time_bias != nullptr ? p.time_bias + s * h : nullptr;
    const Vec t_norm(static_cast<float>(s) / p.total_timesteps);
    float* o = out + r * ld;
    for_vectors(h, [&](int64_t j, int64_t n) {
      Vec v = load(p.bias[0] + j, n);
      if (cond != nullptr) v = v + load(cond + j, n);
      if (time != nullptr) v = v + load(time + j, n);
      if (p.time_weight != nullptr) v = at::vec::fmadd(t_norm, load(p.time_weight + j, n), v);
      store(v, o + j, n);
    });
  }
}

// ---- The seeded noise, kV columns at a time.
#include "mlp_kernels_noise.h"

// ---- The step, in the sample's scalar type T: float32 vectors, or float64
// vectors of half as many columns for a float64 sample (the network's e
// widened to double, the new x also rounded to float32 for the next step's
// network).

// n floats at p (plus the n at `add` where given, summed in float32) in T's lanes.
template <typename T>
inline Lanes<T> load_widened(const float* p, const float* add, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return add != nullptr ? load(p, n) + load(add, n) : load(p, n);
  } else {
    T wide[Lanes<T>::size()];
    for (int64_t i = 0; i < n; ++i) wide[i] = add != nullptr ? p[i] + add[i] : p[i];
    return Lanes<T>::loadu(wide, n);
  }
}

// v's n lanes rounded to float32, at p.
inline void store_narrowed(Lanes<double> v, float* p, int64_t n) {
  double wide[Lanes<double>::size()];
  v.store(wide, n);
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(wide[i]);
}

// The columns of seeded normals drawn at once (seeded_normals).
constexpr int64_t kNoiseColumns = kNoiseVectors * kV;

// The step of rows [row0, row0 + rows) with st, x their rows in T and, for a
// float64 sample, x32 the same rows in float32 (the network's input).
template <typename T>
void step_rows(const MlpPlan& p, const StepTables<T>& st, T* x, float* x32, int64_t row0, int64_t rows,
               const float* eps, int64_t ld, const float* bias, int64_t k, T* x0_prev) {
  using V = Lanes<T>;
  const int64_t dim = p.dim;
  const bool clip_noise = st.noise_clip > 0;
  const V noise_lo(-st.noise_clip), noise_hi(st.noise_clip);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t s = p.t_start[row0 + r] - k;
    const V a(st.A != nullptr ? st.A[s] : T(1)), b(st.B[s]), c(st.C[s]);
    const V d(st.D != nullptr ? st.D[s] : T(0)), e_coef(st.E != nullptr ? st.E[s] : T(0));
    // The previous x0's term: none at a call's first step.
    const V prev_coef(st.P != nullptr ? st.P[s] : T(0));
    const bool read_back = st.Q != nullptr;
    const V q(read_back ? st.Q[s] : T(0)), rcoef(read_back ? st.R[s] : T(0));
    const V eps_lo(st.eps_lo), eps_hi(st.eps_hi);
    const bool use_prev = st.P != nullptr && k > 0;
    T* prev = st.P != nullptr ? x0_prev + r * dim : nullptr;
    const int64_t noise_row = k * p.batch + row0 + r;
    const T* z = st.S != nullptr && st.noise != nullptr ? st.noise + noise_row * dim : nullptr;
    const bool seeded = st.S != nullptr && p.noise_seeds != nullptr;
    const uint64_t key = seeded ? seeded_noise::noise_key(p.noise_seeds, p.seed_per_row, k, p.batch, row0 + r) : 0;
    const V sigma(z != nullptr || seeded ? st.S[s] : T(0));
    T* xr = x + r * dim;
    const float* er = eps + r * ld;
    float drawn[kNoiseColumns];  // columns [j - j % kNoiseColumns, + kNoiseColumns)
    for_vectors<V::size()>(dim, [&](int64_t j, int64_t n) {
      const int64_t slot = j % kNoiseColumns;
      if (seeded && slot == 0) seeded_normals(key, j, drawn);
      const V xv = load(xr + j, n);
      const V e = load_widened<T>(er + j, bias != nullptr ? bias + j : nullptr, n);
      V x0 = st.A != nullptr ? a * xv - b * e : xv - b * e;
      if (st.clip_lo != nullptr) x0 = at::vec::clamp(x0, load(st.clip_lo + j, n), load(st.clip_hi + j, n));
      V next = c * x0;
      if (st.D != nullptr) next = next + d * xv;
      if (read_back) {
        next = next + e_coef * at::vec::clamp(q * xv - rcoef * x0, eps_lo, eps_hi);
      } else if (st.E != nullptr) {
        next = next + e_coef * e;
      }
      if (use_prev) next = next + prev_coef * load(prev + j, n);
      if (prev != nullptr) store(x0, prev + j, n);
      if (z != nullptr) {
        const V zv = load(z + j, n);
        next = next + sigma * (clip_noise ? at::vec::clamp(zv, noise_lo, noise_hi) : zv);
      }
      if (seeded) {
        const V zv = load_widened<T>(drawn + slot, nullptr, n);
        next = at::vec::fmadd(sigma, clip_noise ? at::vec::clamp(zv, noise_lo, noise_hi) : zv, next);
      }
      if (st.post_lo != nullptr) next = at::vec::clamp(next, load(st.post_lo + j, n), load(st.post_hi + j, n));
      store(next, xr + j, n);
      if constexpr (!std::is_same_v<T, float>) store_narrowed(next, x32 + r * dim + j, n);
    });
    if (st.chain != nullptr) {
      std::memcpy(st.chain + ((k + 1) * p.batch + row0 + r) * dim, xr, dim * sizeof(T));
    }
  }
}

void step_update(const MlpPlan& p, float* x, int64_t row0, int64_t rows, const float* eps,
                 int64_t ld, const float* bias, int64_t k, float* x0_prev) {
  if (p.x64 != nullptr) {
    // x0_prev's scratch holds doubles for a float64 sample (scratch_floats), aligned.
    step_rows<double>(p, p.step64, p.x64 + row0 * p.dim, x, row0, rows, eps, ld, bias, k,
                      reinterpret_cast<double*>(x0_prev));
  } else {
    step_rows<float>(p, p.step, x, nullptr, row0, rows, eps, ld, bias, k, x0_prev);
  }
}

void bias_act(float* a, int64_t ld, int64_t rows, int64_t cols, const float* bias,
              int64_t bias_ld, Activation act) {
  visit_activation(act, [&](auto tag) {
    for (int64_t r = 0; r < rows; ++r) {
      float* ar = a + r * ld;
      const float* br = bias + r * bias_ld;
      for_vectors(cols, [&](int64_t j, int64_t n) {
        store(activate(load(ar + j, n) + load(br + j, n), tag), ar + j, n);
      });
    }
  });
}

void pack_layer(const float* w, int64_t ld_w, const float* bias, int64_t out_f, int64_t in_f,
                float* panel, float* packed_bias) {
  const int64_t op = round_up(out_f, kPad);
  constexpr int64_t B = 16;
  const int64_t j_full = out_f - out_f % B, i_full = in_f - in_f % B;
  for (int64_t j0 = 0; j0 < j_full; j0 += B) {
    for (int64_t i0 = 0; i0 < i_full; i0 += B) {
      at::vec::transpose_mxn<float, B, B>(w + j0 * ld_w + i0, ld_w, panel + i0 * op + j0, op);
    }
    for (int64_t i = i_full; i < in_f; ++i) {
      for (int64_t j = j0; j < j0 + B; ++j) panel[i * op + j] = w[j * ld_w + i];
    }
  }
  for (int64_t i = 0; i < in_f; ++i) {
    float* dst = panel + i * op;
    for (int64_t j = j_full; j < out_f; ++j) dst[j] = w[j * ld_w + i];
    for (int64_t j = out_f; j < op; ++j) dst[j] = 0.f;
  }
  for (int64_t j = 0; j < out_f; ++j) packed_bias[j] = bias[j];
  for (int64_t j = out_f; j < op; ++j) packed_bias[j] = 0.f;
}

// ---- Network programs: the instructions that are not Linear layers, row by row.

// The sum of a vector's lanes.
inline float lanes_sum(Vec v) {
  float lanes[kV];
  v.store(lanes);
  float sum = 0.f;
  for (int i = 0; i < kV; ++i) sum += lanes[i];
  return sum;
}

// Sum of the first n floats at p (masked loads read nothing past them).
inline float row_sum(const float* p, int64_t n) {
  Vec acc(0.f);
  for_vectors(n, [&](int64_t j, int64_t m) { acc = acc + load(p + j, m); });
  return lanes_sum(acc);
}

// dst = LayerNorm(src) over `width` columns: two passes (the mean, then the
// centred squares), biased variance, then the affine part when given.
void layer_norm_rows(const float* src, int64_t src_ld, float* dst, int64_t dst_ld, int64_t rows,
                     int64_t width, float eps, const float* gamma, const float* beta) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = src + r * src_ld;
    float* out = dst + r * dst_ld;
    const float mean = row_sum(in, width) / static_cast<float>(width);
    const Vec mv(mean);
    Vec acc(0.f);
    for_vectors(width, [&](int64_t j, int64_t m) {
      const Vec d = load(in + j, m) - mv;
      acc = m == kV ? at::vec::fmadd(d, d, acc) : at::vec::fmadd(d, Vec::set(Vec(0.f), d, m), acc);
    });
    const float var = lanes_sum(acc) / static_cast<float>(width);
    const Vec rstd(1.f / std::sqrt(var + eps));
    for_vectors(width, [&](int64_t j, int64_t m) {
      Vec y = (load(in + j, m) - mv) * rstd;
      if (gamma != nullptr) y = at::vec::fmadd(y, load(gamma + j, m), load(beta + j, m));
      store(y, out + j, m);
    });
  }
}

void activation_rows(const float* src, int64_t src_ld, float* dst, int64_t dst_ld, int64_t rows,
                     int64_t width, Activation act) {
  visit_activation(act, [&](auto tag) {
    for (int64_t r = 0; r < rows; ++r) {
      const float* in = src + r * src_ld;
      float* out = dst + r * dst_ld;
      for_vectors(width, [&](int64_t j, int64_t m) {
        store(activate(load(in + j, m), tag), out + j, m);
      });
    }
  });
}

void add_rows(const float* a, int64_t a_ld, const float* b, int64_t b_ld, float* dst, int64_t dst_ld,
              int64_t rows, int64_t width) {
  for (int64_t r = 0; r < rows; ++r) {
    for_vectors(width, [&](int64_t j, int64_t m) {
      store(load(a + r * a_ld + j, m) + load(b + r * b_ld + j, m), dst + r * dst_ld + j, m);
    });
  }
}

// The concatenated input of step k's rows: x, then the parts in order.
void gather_input(const MlpPlan& p, const float* x, int64_t row0, int64_t rows, float* out, int64_t k) {
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + r * p.input_ld;
    for (int32_t i = 0; i < p.num_input_parts; ++i) {
      const int32_t part = p.input_parts[i];
      const float* from = part == 0 ? x + r * p.dim
                        : part == 1 ? p.cond_input + (row0 + r) * p.cond_cols
                                    : p.time_input + (p.t_start[row0 + r] - k) * p.time_cols;
      const int64_t n = part == 0 ? p.dim : part == 1 ? p.cond_cols : p.time_cols;
      std::memcpy(o, from, n * sizeof(float));
      o += n;
    }
  }
}

// fn(begin, end) over the output columns [0, out_f) in blocks of `block`: split
// between the threads where the plan says so (MlpPlan::parallel_columns).
template <typename Fn>
void over_columns(const MlpPlan& p, int64_t l, int64_t block, Fn&& fn) {
  const int64_t out_f = p.out_f[l];
  const int64_t blocks = (out_f + block - 1) / block;
  if (p.parallel_columns == nullptr || blocks < 2 || p.in_f[l] * out_f < p.split_weights) {
    fn(int64_t{0}, out_f);
    return;
  }
  auto columns = [&](int64_t b0, int64_t b1) { fn(b0 * block, std::min(b1 * block, out_f)); };
  const int64_t piece = p.split_weights / 2;          // weights
  const int64_t block_weights = std::max<int64_t>(1, block * p.in_f[l]);
  const int64_t grain = std::max<int64_t>(1, (piece + block_weights - 1) / block_weights);
  p.parallel_columns(blocks, grain,
                     [](void* ctx, int64_t b0, int64_t b1) { (*static_cast<decltype(columns)*>(ctx))(b0, b1); },
                     &columns);
}

// One Linear layer of `rows` rows: out = act(in @ W^T + bias or bias rows).
void linear_rows(const MlpPlan& p, int64_t l, const float* in, int64_t in_ld, int64_t rows, float* out,
                 int64_t ld, const float* row_bias, Activation act) {
  const bool own_rows = l == 0 && p.row_bias();
  const int64_t bias_ld = own_rows ? ld : 0;
  const float* w = p.weight[l];
  const int64_t ld_w = p.weight_ld[l];
  if (p.packed_w == nullptr && rows > 1) {
    const float* bias = own_rows ? row_bias : p.bias[l];
    over_columns(p, l, kOuts * kV, [&](int64_t j0, int64_t j1) {
      dot_layer_rows(in, in_ld, rows, p.in_f[l], w + j0 * ld_w, ld_w, bias + j0, bias_ld, j1 - j0, out + j0, ld);
      if (act != Activation::kIdentity) activation_rows(out + j0, ld, out + j0, ld, rows, j1 - j0, act);
    });
  } else if (p.packed_w == nullptr) {
    const float* bias = own_rows ? row_bias : p.bias[l];
    visit_activation(act, [&](auto a) {
      over_columns(p, l, kV, [&](int64_t j0, int64_t j1) {
        for (int64_t r = 0; r < rows; ++r) {
          dot_layer_row<decltype(a)::value>(in + r * in_ld, p.in_f[l], w + j0 * ld_w, ld_w,
                                            bias + r * bias_ld + j0, j1 - j0, out + r * ld + j0);
        }
      });
    });
  } else {
    layer(in, in_ld, rows, p.in_f[l], p.packed_w[l], round_up(p.out_f[l], kPad),
          own_rows ? row_bias : p.packed_b[l], bias_ld, out, ld, act);
  }
}

// The network program on one tile for step k; returns the buffer holding e (row stride act_ld).
const float* run_program(const MlpPlan& p, const float* x, int64_t row0, int64_t rows, float* scratch,
                         const float* row_bias, int64_t k) {
  const int64_t ld = p.act_ld;
  float* input = input_rows(p, scratch, rows);
  if (p.num_input_parts > 0) gather_input(p, x, row0, rows, input, k);
  auto buffer = [&](int32_t id) -> float* {
    return id == kProgramX ? const_cast<float*>(x) : id == kProgramInput ? input : scratch + id * rows * ld;
  };
  auto stride = [&](int32_t id) -> int64_t {
    return id == kProgramX ? p.dim : id == kProgramInput ? p.input_ld : ld;
  };
  const float* out = nullptr;
  for (int64_t i = 0; i < p.program_ops; ++i) {
    const ProgramOp& op = p.program[i];
    float* dst = buffer(op.dst);
    switch (op.kind) {
      case ProgramOp::kLinear:
        linear_rows(p, op.layer, buffer(op.src), stride(op.src), rows, dst, ld, row_bias, op.act);
        break;
      case ProgramOp::kActivation:
        activation_rows(buffer(op.src), stride(op.src), dst, ld, rows, op.width, op.act);
        break;
      case ProgramOp::kLayerNorm:
        layer_norm_rows(buffer(op.src), stride(op.src), dst, ld, rows, op.width, op.eps, op.gamma, op.beta);
        break;
      case ProgramOp::kAdd:
        add_rows(buffer(op.src), stride(op.src), buffer(op.other), stride(op.other), dst, ld, rows, op.width);
        break;
    }
    out = dst;
  }
  return out;
}

void vec_tile(const MlpPlan& p, float* x_all, int64_t row0, int64_t rows, float* scratch) {
  const int64_t ld = p.act_ld;
  float* bufs[2] = {scratch, scratch + rows * ld};
  float* row_bias = row_bias_rows(p, scratch, rows);  // zero past out_f[0]: padded outputs stay 0
  float* x0_prev = previous_x0(p, scratch, rows);
  float* x = x_all + row0 * p.dim;
  if (p.program != nullptr) {
    for (int64_t k = 0; k < p.num_steps; ++k) {
      if (p.row_bias()) first_bias(p, row0, rows, row_bias, ld, k);
      const float* e = run_program(p, x, row0, rows, scratch, row_bias, k);
      step_update(p, x, row0, rows, e, ld, nullptr, k, x0_prev);
    }
    return;
  }
  for (int64_t k = 0; k < p.num_steps; ++k) {
    if (p.row_bias()) first_bias(p, row0, rows, row_bias, ld, k);
    const float* in = x;  // layer 0 reads x itself
    int64_t in_ld = p.dim;
    for (int64_t l = 0; l < p.num_layers; ++l) {
      float* out = bufs[l % 2];
      linear_rows(p, l, in, in_ld, rows, out, ld, row_bias,
                  l + 1 < p.num_layers ? p.act[l] : Activation::kIdentity);
      in = out;
      in_ld = ld;
    }
    step_update(p, x, row0, rows, in, ld, nullptr, k, x0_prev);
  }
}

const Kernels kKernels = {
#define DDPM_STR2(s) #s
#define DDPM_STR(s) DDPM_STR2(s)
    DDPM_STR(CPU_CAPABILITY),
#undef DDPM_STR
#undef DDPM_STR2
    &vec_tile, &bias_act, &first_bias, &step_update, &pack_layer};

}  // namespace

const Kernels* kernels() { return &kKernels; }

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace ddpm_ops
