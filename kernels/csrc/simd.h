// Per-ISA vector helpers: the kernels are written once against this interface and compiled
// once per ISA variant (kernels/cpu_isa.py builds one library per tier with its own -m flags):
//
//   Avx2    8 float32 lanes (AVX2 + FMA + F16C), 16 registers; masks are all-ones lanes
//   Avx512 16 float32 lanes (AVX-512 F/BW/DQ/VL), 32 registers; masks are __mmask16
//
// ``Vec`` is the widest one this translation unit was compiled for, and PAGEDSERVE_SIMD is 1
// when there is one (0 in the generic build, which keeps only the portable loops). Every
// operation is the same float32 arithmetic in both (loads widen bfloat16 exactly, stores round
// to nearest even like convert.h's store()), so the variants differ only in summation order.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "convert.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VL__) && defined(__FMA__) && defined(__F16C__)
#define PAGEDSERVE_AVX512 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGEDSERVE_AVX2 1
#endif
#if defined(PAGEDSERVE_AVX512) || defined(PAGEDSERVE_AVX2)
#define PAGEDSERVE_SIMD 1
#include <immintrin.h>
#else
#define PAGEDSERVE_SIMD 0
#endif

namespace {

#if defined(PAGEDSERVE_AVX2)
struct Avx2 {
  static constexpr int W = 8, kRegs = 16;
  using F = __m256;
  using M = __m256;  // lanes all ones where true
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load(const uint16_t* p) {  // 8 bfloat16 -> float32
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static void store(F v, float* p) { _mm256_storeu_ps(p, v); }
  static void store(F v, uint16_t* p) {  // round to nearest even, NaN stays NaN
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
    const __m256i mag = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    const __m256i nan = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7f800000));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, quiet, nan);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F min(F a, F b) { return _mm256_min_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }  // a * b + c
  static float reduce_add(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static F round(F x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F scale2(F y, F n) {  // y * 2^n, n integral in [-126, 127]
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                         _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  }
  // Lanes where pos[i] >= t (int32 positions), and the masked operations on them.
  static M ge(const int32_t* pos, int64_t t) {
    const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pos));
    const __m256i before = _mm256_set1_epi32(static_cast<int32_t>(t - 1));
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(p, before));
  }
  static M lt(const int32_t* pos, int64_t t) {  // lanes where pos[i] < t
    const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pos));
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(t)), p));
  }
  static M both(M a, M b) { return _mm256_and_ps(a, b); }
  static M none() { return _mm256_setzero_ps(); }
  static F max_where(F a, M m, F b) { return _mm256_blendv_ps(a, _mm256_max_ps(a, b), m); }
  static F keep(M m, F a) { return _mm256_and_ps(m, a); }  // a where m, else 0
  // W weights from bytes: int8 as is; 4-bit (byte >> shift) & 15 of unsigned bytes.
  static F int8s(const uint8_t* p) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  }
  static F nibbles(const uint8_t* p, int shift) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(b, shift), _mm256_set1_epi32(15)));
  }
};
#endif

#if defined(PAGEDSERVE_AVX512)
struct Avx512 {
  static constexpr int W = 16, kRegs = 32;
  using F = __m512;
  using M = __mmask16;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load(const uint16_t* p) { return load16(p); }  // convert.h
  static void store(F v, float* p) { _mm512_storeu_ps(p, v); }
  static void store(F v, uint16_t* p) {  // round to nearest even, NaN stays NaN
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, quiet)));
  }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static float reduce_add(F v) { return _mm512_reduce_add_ps(v); }
  static F round(F x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static F scale2(F y, F n) { return _mm512_scalef_ps(y, n); }
  static M ge(const int32_t* pos, int64_t t) {
    const __m512i at = _mm512_set1_epi32(static_cast<int32_t>(t));
    return _mm512_cmp_epi32_mask(_mm512_loadu_si512(pos), at, _MM_CMPINT_NLT);
  }
  static M lt(const int32_t* pos, int64_t t) {
    const __m512i at = _mm512_set1_epi32(static_cast<int32_t>(t));
    return _mm512_cmp_epi32_mask(_mm512_loadu_si512(pos), at, _MM_CMPINT_LT);
  }
  static M both(M a, M b) { return a & b; }
  static M none() { return 0; }
  static F max_where(F a, M m, F b) { return _mm512_mask_max_ps(a, m, a, b); }
  static F keep(M m, F a) { return _mm512_maskz_mov_ps(m, a); }
  static F int8s(const uint8_t* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  }
  static F nibbles(const uint8_t* p, int shift) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(b, shift), _mm512_set1_epi32(15)));
  }
};
#endif

#if defined(PAGEDSERVE_AVX512)
using Vec = Avx512;
#elif defined(PAGEDSERVE_AVX2)
using Vec = Avx2;
#endif

#if PAGEDSERVE_SIMD
// e^x lane-wise, x clamped to [-87, 88] (so the result is a normal float): Cephes' expf
// polynomial on x - n ln 2, scaled by 2^n (about 1 ulp).
template <class V>
inline typename V::F vexp(typename V::F x) {
  x = V::min(V::max(x, V::set1(-87.f)), V::set1(88.f));
  const typename V::F n = V::round(V::mul(x, V::set1(1.44269504f)));
  typename V::F r = V::fmadd(n, V::set1(-0.693359375f), x);
  r = V::fmadd(n, V::set1(2.12194440e-4f), r);
  typename V::F p = V::set1(1.9875691500e-4f);
  p = V::fmadd(p, r, V::set1(1.3981999507e-3f));
  p = V::fmadd(p, r, V::set1(8.3334519073e-3f));
  p = V::fmadd(p, r, V::set1(4.1665795894e-2f));
  p = V::fmadd(p, r, V::set1(1.6666665459e-1f));
  p = V::fmadd(p, r, V::set1(5.0000001201e-1f));
  const typename V::F y = V::add(V::fmadd(p, V::mul(r, r), r), V::set1(1.f));
  return V::scale2(y, n);
}

// cap * tanh(x / cap) lane-wise (Gemma 2's attention-logit soft cap), as
// 1 - 2 / (e^(2y) + 1): vexp's clamp keeps it finite and saturating at +-1.
template <class V>
inline typename V::F vsoftcap(typename V::F x, float cap) {
  const typename V::F e = vexp<V>(V::mul(x, V::set1(2.f / cap)));
  const typename V::F t = V::sub(V::set1(1.f), V::div(V::set1(2.f), V::add(e, V::set1(1.f))));
  return V::mul(t, V::set1(cap));
}
#endif

// n values of src as float32 into dst (vectors, then a scalar tail).
template <typename T>
inline void widen(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
#if PAGEDSERVE_SIMD
  for (; i + Vec::W <= n; i += Vec::W) Vec::store(Vec::load(src + i), dst + i);
#endif
  for (; i < n; ++i) dst[i] = load(src[i]);
}

// An IEEE half (GGUF's block scales, little endian, possibly unaligned) as float32: F16C's
// one instruction where the tier has it (the bit arithmetic was a third of a block's time).
inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if PAGEDSERVE_SIMD
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    u = sign;
  } else {  // subnormal half: a normal float
    float f = std::ldexp(static_cast<float>(mant), -24);
    std::memcpy(&u, &f, 4);
    u |= sign;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

}  // namespace
