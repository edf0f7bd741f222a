// The seeded noise of the CPU kernels (common/seeded_noise.h), kV columns at
// a time: a part of mlp_kernels_impl.h, included there inside its namespace
// (it uses that file's Vec and kV), so it is compiled once per instruction
// set with it. Not a header to include anywhere else.

using IVec = at::vec::Vectorized<int32_t>;
static_assert(IVec::size() == kV, "int32 and float vectors must have the same lanes");

// x >> s on uint32 lanes: the arithmetic shift of int32 lanes, its sign bits masked.
inline IVec shift_right(IVec x, int s) {
  return (x >> IVec(s)) & IVec(static_cast<int32_t>((1u << (32 - s)) - 1u));
}

inline IVec mix32(IVec x) {
  namespace sn = seeded_noise;
  x = (x ^ shift_right(x, sn::kMix32Shift1)) * IVec(static_cast<int32_t>(sn::kMix32Mul1));
  x = (x ^ shift_right(x, sn::kMix32Shift2)) * IVec(static_cast<int32_t>(sn::kMix32Mul2));
  return x ^ shift_right(x, sn::kMix32Shift3);
}

// log of positive normal floats, within 2 ulp: Cephes' logf polynomial, inline
// (Sleef's log is an out-of-line call whose latency dominated the noise).
inline Vec log_positive(Vec x) {
  const IVec bits = at::vec::cast<int32_t>(x);
  const IVec exponent = shift_right(bits, 23) - IVec(126);  // x = m 2^e, m in [0.5, 1)
  Vec m = at::vec::cast<float>((bits & IVec(0x007fffff)) | IVec(0x3f000000));
  const Vec below = m < Vec(0.70710678f);  // then m 2^e = (2m) 2^(e - 1)
  const Vec e = at::vec::convert_to_fp_of_same_size<float>(exponent) - (below & Vec(1.f));
  m = m + (below & m) - Vec(1.f);
  const Vec z = m * m;
  Vec p(7.0376836292e-2f);
  for (const float c : {-1.1514610310e-1f, 1.1676998740e-1f, -1.2420140846e-1f, 1.4249322787e-1f,
                        -1.6668057665e-1f, 2.0000714765e-1f, -2.4999993993e-1f, 3.3333331174e-1f}) {
    p = at::vec::fmadd(p, m, Vec(c));
  }
  Vec y = p * m * z;
  y = at::vec::fmadd(e, Vec(-2.12194440e-4f), y);
  y = at::vec::fmadd(z, Vec(-0.5f), y);
  return at::vec::fmadd(e, Vec(0.693359375f), m + y);
}

// Noise vectors drawn at once: their dependency chains (a log, then a
// polynomial of 9 dependent FMAs) interleave instead of running one by one.
constexpr int kNoiseVectors = 4;

// z for columns [j0, j0 + kNoiseVectors * kV) of the noise row whose key is
// `key`, stored at z, by erfinv on (-1, 1) with relative error below 3e-7: M. Giles,
// "Approximating the erfinv function" (GPU Computing Gems, 2011), single
// precision. Its tail branch (|x| > 0.9966, one lane in 300) is evaluated
// only when a lane needs it.
inline void seeded_normals(uint64_t key, int64_t j0, float* z) {
  constexpr int kDrop = 32 - seeded_noise::kUniformBits;
  constexpr float kUlp = 1.f / (1 << seeded_noise::kUniformBits);
  const IVec low(static_cast<int32_t>(key)), high(static_cast<int32_t>(key >> 32));
  Vec x[kNoiseVectors], w[kNoiseVectors], p[kNoiseVectors];
  for (int i = 0; i < kNoiseVectors; ++i) {
    const IVec j = IVec::arange(static_cast<int32_t>(j0 + i * kV), 1);
    const IVec bits = mix32(mix32(j ^ low) + high);
    const Vec top = at::vec::convert_to_fp_of_same_size<float>(shift_right(bits, kDrop));
    // 2u - 1 = (2 top + 1 - 2^24) / 2^24, exact in float32.
    x[i] = at::vec::fmadd(top, Vec(2.f * kUlp), Vec(kUlp - 1.f));
  }
  for (int i = 0; i < kNoiseVectors; ++i) {
    w[i] = Vec(0.f) - log_positive((Vec(1.f) - x[i]) * (Vec(1.f) + x[i]));
  }
  for (int i = 0; i < kNoiseVectors; ++i) p[i] = Vec(2.81022636e-08f);
  for (const float c : {3.43273939e-07f, -3.5233877e-06f, -4.39150654e-06f, 0.00021858087f,
                        -0.00125372503f, -0.00417768164f, 0.246640727f, 1.50140941f}) {
    for (int i = 0; i < kNoiseVectors; ++i) p[i] = at::vec::fmadd(p[i], w[i] - Vec(2.5f), Vec(c));
  }
  for (int i = 0; i < kNoiseVectors; ++i) {
    const Vec tail = w[i] >= Vec(5.f);
    if (tail.zero_mask() != (1 << kV) - 1) {
      const Vec wt = w[i].sqrt() - Vec(3.f);
      Vec pt(-0.000200214257f);
      for (const float c : {0.000100950558f, 0.00134934322f, -0.00367342844f, 0.00573950773f,
                            -0.0076224613f, 0.00943887047f, 1.00167406f, 2.83297682f}) {
        pt = at::vec::fmadd(pt, wt, Vec(c));
      }
      p[i] = Vec::blendv(p[i], pt, tail);
    }
    (Vec(static_cast<float>(M_SQRT2)) * p[i] * x[i]).store(z + i * kV);
  }
}
