// The noise that fused_sample.rule draws itself from `noise_seed`, defined
// once for every kernel (the CPU kernel's vector form, the ATen loop's tensor
// form, the CUDA kernels) and for ddpm_ops.reference.seeded_noise, the float64
// reference.
//
// z[k, r, j], the noise of step k, row r, column j of the flattened x:
//   key  = mix64(q ^ mix64(seed))                    one 64-bit key per noise row
//          q = k * batch + r with one seed for the batch,
//          q = k with row r's own seed (noise_seed of shape (batch,))
//   bits = mix32(mix32(j ^ lo32(key)) + hi32(key))   mod 2^32
//   u    = ((bits >> 8) + 0.5) / 2^24                in (0, 1)
//   z    = sqrt(2) * erfinv(2u - 1)                  a standard normal
// Counter-based: every element is a function of (seed, k, r, j) alone, so the
// result does not depend on how the batch is cut into tiles or threads, and
// a seed held in a tensor keeps a CUDA graph's replays drawing fresh noise.
// A row with a seed of its own draws what a batch of one draws from that seed,
// whatever its position and the batch size: a batch sharded over processes
// (each drawing its rows' seeds' numbers) gives the numbers of the whole.
// mix64 is a bijection (SplitMix64's finaliser), so distinct rows of one seed
// never share a key; mix32 is a low-bias 32-bit integer hash, also a
// bijection. 24 bits of the uniform cap |z| at about 5.3.
#pragma once

#include <cstdint>

#include "host_device.h"

namespace ddpm_ops {
namespace seeded_noise {

constexpr uint64_t kMix64Mul1 = 0xbf58476d1ce4e5b9ULL;
constexpr uint64_t kMix64Mul2 = 0x94d049bb133111ebULL;
constexpr int kMix64Shift1 = 30, kMix64Shift2 = 27, kMix64Shift3 = 31;
constexpr uint32_t kMix32Mul1 = 0x7feb352dU;
constexpr uint32_t kMix32Mul2 = 0x846ca68bU;
constexpr int kMix32Shift1 = 16, kMix32Shift2 = 15, kMix32Shift3 = 16;
constexpr int kUniformBits = 24;

DDPM_HD inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> kMix64Shift1)) * kMix64Mul1;
  z = (z ^ (z >> kMix64Shift2)) * kMix64Mul2;
  return z ^ (z >> kMix64Shift3);
}

DDPM_HD inline uint32_t mix32(uint32_t x) {
  x = (x ^ (x >> kMix32Shift1)) * kMix32Mul1;
  x = (x ^ (x >> kMix32Shift2)) * kMix32Mul2;
  return x ^ (x >> kMix32Shift3);
}

// The key of noise row q = k * batch + r.
DDPM_HD inline uint64_t row_key(uint64_t seed, uint64_t q) { return mix64(q ^ mix64(seed)); }

// The key of step k's noise for row r of `batch` rows. `seeds` holds one seed
// for the batch, or with `per_row` one seed per row.
DDPM_HD inline uint64_t noise_key(const int64_t* seeds, bool per_row, uint64_t k, uint64_t batch,
                                  uint64_t r) {
  return per_row ? row_key(static_cast<uint64_t>(seeds[r]), k)
                 : row_key(static_cast<uint64_t>(seeds[0]), k * batch + r);
}

// Column j's 32 bits in the noise row of `key`.
DDPM_HD inline uint32_t column_bits(uint64_t key, uint32_t j) {
  return mix32(mix32(j ^ static_cast<uint32_t>(key)) + static_cast<uint32_t>(key >> 32));
}

// 2u - 1 of those bits, exactly: (2 * top + 1 - 2^24) / 2^24 is an odd
// integer over 2^24, below 2^24 in magnitude, so float32 holds it.
DDPM_HD inline float centered_uniform(uint32_t bits) {
  const int32_t top = static_cast<int32_t>(bits >> (32 - kUniformBits));
  return static_cast<float>(2 * top + 1 - (int32_t{1} << kUniformBits)) * (1.f / (1 << kUniformBits));
}

}  // namespace seeded_noise
}  // namespace ddpm_ops
