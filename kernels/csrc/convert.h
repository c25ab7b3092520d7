// float32 <-> bfloat16 conversions shared by our CPU kernels (every file in this folder):
// load() widens one value, store() rounds one to nearest even (NaN stays NaN), load16() widens
// 16 lanes. Everything else computes in float32. In an unnamed namespace: each kernel file
// gets its own inline copy, nothing is exported from the library.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

namespace {

inline float load(float x) { return x; }
inline float load(uint16_t h) {  // bfloat16 -> float32: the high half of the bits
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline void store(float x, float* dst) { *dst = x; }
inline void store(float x, uint16_t* dst) {  // float32 -> bfloat16, round to nearest even
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays NaN
    *dst = static_cast<uint16_t>((u >> 16) | 0x40u);
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  *dst = static_cast<uint16_t>(u >> 16);
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // 16 bfloat16 -> float32
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512i wide = _mm512_cvtepu16_epi32(half);
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#endif

}  // namespace
