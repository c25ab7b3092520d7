// 8-bit KV cache rows (--kv-cache-dtype; the layout and its torch reference are in
// kernels/kv_quant.py): each (token, kv head) row is head_size codes, then the row's float32
// scale; value = code * scale, scale = absmax(row) / qmax. The write (quantize_row) is scalar:
// a step writes few rows. The reads (dequant_row) are the hot path: int8 widens with one
// sign extension and convert; fp8 goes through F16C, since an E5M2 code is the high byte of an
// IEEE half and an E4M3 code, shifted, is a half 2^8 too small (folded into the scale), so
// both are exact, subnormals included, in hardware.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "convert.h"
#include "simd.h"

namespace {

// The kernels' kv_kind argument (kv_quant.KIND): 0 = the cache is in the query's dtype.
enum KvKind : int64_t { kKvNative = 0, kKvInt8 = 1, kKvE4m3 = 2, kKvE5m2 = 3 };
constexpr int64_t kScaleBytes = 4;

inline float kv_qmax(int64_t kind) {
  return kind == kKvInt8 ? 127.f : kind == kKvE4m3 ? 448.f : 57344.f;
}

// |a| <= the format's largest value, as an FP8 code with mant_bits mantissa bits and exponent
// bias ``bias``, rounded to nearest even (as torch's casts).
inline uint8_t fp8_code(float a, int mant_bits, int bias) {
  const uint32_t sign = std::signbit(a) ? 0x80u : 0u;
  a = std::fabs(a);
  if (a < std::ldexp(1.f, 1 - bias)) {  // subnormal: multiples of 2^(1 - bias - mant_bits)
    return static_cast<uint8_t>(sign | static_cast<uint32_t>(
        std::nearbyint(a * std::ldexp(1.f, bias - 1 + mant_bits))));
  }
  uint32_t u;
  std::memcpy(&u, &a, 4);
  const int drop = 23 - mant_bits;
  u += ((1u << (drop - 1)) - 1) + ((u >> drop) & 1u);  // a carry moves into the exponent
  const uint32_t e = (u >> 23) - 127 + bias;
  return static_cast<uint8_t>(sign | (e << mant_bits) | ((u >> drop) & ((1u << mant_bits) - 1)));
}

// One row of head_size values into its codes and scale at dst (head_size + 4 bytes).
template <typename T>
inline void quantize_row(const T* src, uint8_t* dst, int64_t head_size, int64_t kind) {
  const float qmax = kv_qmax(kind);
  float amax = 0.f;
  for (int64_t d = 0; d < head_size; ++d) amax = std::max(amax, std::fabs(load(src[d])));
  const float scale = amax * (1.f / qmax);  // the reference's arithmetic, to the bit
  const float inv = scale > 0.f ? 1.f / scale : 0.f;
  for (int64_t d = 0; d < head_size; ++d) {
    const float y = std::clamp(load(src[d]) * inv, -qmax, qmax);
    dst[d] = kind == kKvInt8 ? static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(y)))
             : kind == kKvE4m3 ? fp8_code(y, 3, 7)
                               : fp8_code(y, 2, 15);
  }
  std::memcpy(dst + head_size, &scale, kScaleBytes);
}

// The half-precision bits of an FP8 code: E5M2 exactly; E4M3 2^-8 times its value.
inline uint16_t fp8_half_bits(uint8_t c, bool e4m3) {
  return e4m3 ? static_cast<uint16_t>(((c & 0x80u) << 8) | ((c & 0x7fu) << 7))
              : static_cast<uint16_t>(c << 8);
}

#if PAGEDSERVE_SIMD
// Vec::W FP8 codes as float32 lanes (E4M3: 2^-8 times their value, see fp8_half_bits).
inline Vec::F fp8_lanes(const uint8_t* p, bool e4m3) {
#if defined(PAGEDSERVE_AVX512)
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = e4m3 ? _mm256_or_si256(
                               _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                               _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)), 7))
                         : _mm256_slli_epi16(w, 8);
  return _mm512_cvtph_ps(h);
#else
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = e4m3 ? _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                                        _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f)), 7))
                         : _mm_slli_epi16(w, 8);
  return _mm256_cvtph_ps(h);
#endif
}
#endif

// The head_size values of one quantized row as float32 into dst.
inline void dequant_row(const uint8_t* row, float* dst, int64_t head_size, int64_t kind) {
  float scale;
  std::memcpy(&scale, row + head_size, kScaleBytes);
  const bool e4m3 = kind == kKvE4m3;
  const float fp8_scale = e4m3 ? scale * 256.f : scale;
  int64_t d = 0;
#if PAGEDSERVE_SIMD
  if (kind == kKvInt8) {
    for (; d + Vec::W <= head_size; d += Vec::W)
      Vec::store(Vec::mul(Vec::int8s(row + d), Vec::set1(scale)), dst + d);
  } else {
    for (; d + Vec::W <= head_size; d += Vec::W)
      Vec::store(Vec::mul(fp8_lanes(row + d, e4m3), Vec::set1(fp8_scale)), dst + d);
  }
#endif
  for (; d < head_size; ++d) {
    if (kind == kKvInt8) {
      dst[d] = static_cast<float>(static_cast<int8_t>(row[d])) * scale;
    } else {
      const uint16_t h = fp8_half_bits(row[d], e4m3);
      dst[d] = fp16(reinterpret_cast<const uint8_t*>(&h)) * fp8_scale;
    }
  }
}

// A cache's rows as the attention kernels read them: KvCache<T> is a cache in the query's
// dtype T, read in place; KvCache<uint8_t> an 8-bit one, dequantized into a float32 buffer.
// row(base, kvh, buf): kv head kvh of the token whose row starts at element ``base``.
template <typename C>
struct KvCache {
  const C* data;
  int64_t head_size;
  int64_t head_stride() const { return head_size; }
  const C* row(int64_t base, int64_t kvh, float*) const {
    return data + base + kvh * head_size;
  }
  // All num_kv_heads heads of a token, as float32 in buf.
  const float* widened(int64_t base, int64_t num_kv_heads, float* buf) const {
    widen(data + base, buf, num_kv_heads * head_size);
    return buf;
  }
};

template <>
struct KvCache<uint8_t> {
  const uint8_t* data;
  int64_t head_size, kind;
  int64_t head_stride() const { return head_size + kScaleBytes; }
  const float* row(int64_t base, int64_t kvh, float* buf) const {
    dequant_row(data + base + kvh * head_stride(), buf, head_size, kind);
    return buf;
  }
  const float* widened(int64_t base, int64_t num_kv_heads, float* buf) const {
    for (int64_t h = 0; h < num_kv_heads; ++h)
      dequant_row(data + base + h * head_stride(), buf + h * head_size, head_size, kind);
    return buf;
  }
};

}  // namespace
