// bfloat16 <-> float32 for the CPU kernels, as torch converts: a bfloat16 is the high half of a
// float32; rounding is to nearest, ties to even. Included by paged_decode.cpp and exact_ops.cpp
// (workers/cpu/native_build.py hashes this header into both builds' names).
#pragma once

#include <cstdint>
#include <cstring>

namespace raysample {

inline float bf16_to_float(uint16_t bits) {
  uint32_t word = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &word, sizeof(out));
  return out;
}

// The nearest bfloat16's bits. No test for NaN: callers whose NaNs may carry a payload in the low
// half (which the rounding bias could carry into the exponent) test for it first, as torch does.
inline uint16_t bf16_bits(float value) {
  uint32_t word;
  std::memcpy(&word, &value, sizeof(word));
  return static_cast<uint16_t>((word + 0x7fffu + ((word >> 16) & 1u)) >> 16);
}

}  // namespace raysample
