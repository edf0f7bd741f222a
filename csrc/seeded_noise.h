// The noise that fused_sample.rule draws itself from `noise_seed`, defined
// once for every kernel (the CPU kernel's vector form, the ATen loop's tensor
// form) and for ddpm_ops.reference.seeded_noise, the float64 reference.
//
// z[k, r, j], the noise of step k, row r, column j of the flattened x:
//   key  = mix64((k * batch + r) ^ mix64(seed))      one 64-bit key per noise row
//   bits = mix32(mix32(j ^ lo32(key)) + hi32(key))   mod 2^32
//   u    = ((bits >> 8) + 0.5) / 2^24                in (0, 1)
//   z    = sqrt(2) * erfinv(2u - 1)                  a standard normal
// Counter-based: every element is a function of (seed, k, r, j) alone, so the
// result does not depend on how the batch is cut into tiles or threads, and
// a seed held in a tensor keeps a CUDA graph's replays drawing fresh noise.
// mix64 is a bijection (SplitMix64's finaliser), so distinct rows never share
// a key; mix32 is a low-bias 32-bit integer hash, also a bijection. 24 bits of
// the uniform cap |z| at about 5.3.
#pragma once

#include <cstdint>

namespace ddpm_ops {
namespace seeded_noise {

constexpr uint64_t kMix64Mul1 = 0xbf58476d1ce4e5b9ULL;
constexpr uint64_t kMix64Mul2 = 0x94d049bb133111ebULL;
constexpr int kMix64Shift1 = 30, kMix64Shift2 = 27, kMix64Shift3 = 31;
constexpr uint32_t kMix32Mul1 = 0x7feb352dU;
constexpr uint32_t kMix32Mul2 = 0x846ca68bU;
constexpr int kMix32Shift1 = 16, kMix32Shift2 = 15, kMix32Shift3 = 16;
constexpr int kUniformBits = 24;

inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> kMix64Shift1)) * kMix64Mul1;
  z = (z ^ (z >> kMix64Shift2)) * kMix64Mul2;
  return z ^ (z >> kMix64Shift3);
}

inline uint32_t mix32(uint32_t x) {
  x = (x ^ (x >> kMix32Shift1)) * kMix32Mul1;
  x = (x ^ (x >> kMix32Shift2)) * kMix32Mul2;
  return x ^ (x >> kMix32Shift3);
}

// The key of noise row q = k * batch + r.
inline uint64_t row_key(uint64_t seed, uint64_t q) { return mix64(q ^ mix64(seed)); }

}  // namespace seeded_noise
}  // namespace ddpm_ops
