// Float helpers written so that GCC and Clang vectorise the loops they sit in
// without -ffast-math: exp by range reduction and a polynomial, bfloat16 by
// bit shifts. Reductions use explicit lanes (kLanes independent accumulators),
// which vectorise without reassociating a single sum.
#pragma once

#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace hybridflow {
namespace cpu {

constexpr int kLanes = 16;

// Shifted logits are floored here before exp: exp gives exactly 0 below -87, and
// the floor keeps 0 * (shifted) finite for -inf (masked) logits.
constexpr float kShiftFloor = -100.0f;

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

// exp(x) for the softmax: exactly 0 below -87 (where exp leaves float's
// normal range, and for -inf), saturating above 88.
// x = k ln2 + r, |r| <= ln2 / 2; exp(r) by a degree-6 minimax polynomial
// (relative error ~2 ulp); 2^k assembled in the exponent bits.
inline float exp_approx(float x_in) {
  float x = x_in < -87.0f ? -87.0f : x_in;
  x = x > 88.0f ? 88.0f : x;
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float k = (x * kLog2e + kRoundMagic) - kRoundMagic;
  // ln2 split in two so that k * kLn2Hi is exact.
  constexpr float kLn2Hi = 0.693359375f;
  constexpr float kLn2Lo = -2.12194440e-4f;
  const float r = (x - k * kLn2Hi) - k * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t exponent = static_cast<int32_t>(k) + 127;
  const float result = p * bits_to_float(static_cast<uint32_t>(exponent) << 23);
  return x_in < -87.0f ? 0.0f : result;
}

// Element loads and stores with the arithmetic in fp32.
inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const c10::BFloat16* p, int64_t i) {
  return bits_to_float(static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16);
}
inline float load(const c10::Half* p, int64_t i) { return static_cast<float>(p[i]); }

inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(c10::BFloat16* p, int64_t i, float v) {
  // Round to nearest even; NaN stays a (quiet) NaN.
  const uint32_t bits = float_to_bits(v);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  reinterpret_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(v != v ? 0x7FC0u : rounded);
}
inline void store(c10::Half* p, int64_t i, float v) { p[i] = c10::Half(v); }

}  // namespace cpu
}  // namespace hybridflow
