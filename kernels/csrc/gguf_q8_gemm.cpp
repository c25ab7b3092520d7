// The int8-activation mode of the GGUF products (``--cpu-linear-mode int8``): y[M, N] =
// x[M, K] @ W[N, K]^T with x quantized to 8 bits per block of 32 values and every block's
// product taken in integers, as llama.cpp does on the CPU (its Q8_0 / Q8_K activation blocks
// against every weight type); the exact mode is gguf_gemm.cpp.
//
// Per activation block (32 values x_t; against the K-quants 256, llama.cpp's Q8_K size, the
// scale of each 32 then the group's): amax = max |x_t|, d = amax * float32(1 / 127),
// q_t = round_half_even(x_t * (1 / d)) in [-127, 127] (all zero when d = 0). Per 32-weight
// sub-block of the weights (integer codes c_t, scale dw, minimum mw: gguf_blocks.h) it
// contributes
//     float(sum_t c_t q_t) * (dw * d)               (+ mw * (d * float(sum_t q_t)))
// with the integer sum exact, sub-blocks summed in order; kernels/q8_reference.py is the same
// arithmetic in torch (the variants differ from it in float rounding and order only: the
// K-quant tiles sum a 256-block's sub-blocks before multiplying by d). Q6_K's codes
// sc * (q - 32) are summed per 16-weight group and scaled by sc in integers. Each call
// quantizes x for its own weights' type, so the parts of a mixed-type layer each get theirs.
//
// Weights are repacked once at load (gguf_q8_repack) into panels of 16 rows (gguf_blocks.h):
// per block, the rows' code bytes interleaved 4 bytes at a time, then their high bits the same
// way, then the per-row scales, the file's bytes (Q4_K / Q5_K: 6-bit scales decoded to bytes,
// 2.8 % more). One int32 lane per output column then sums four byte products per instruction
// (vpdpbusd, or vpmaddubsw + vpmaddwd) against 4 activation codes broadcast to every lane, so a
// block's integer sum needs no horizontal reduction, and the per-block scaling is one convert
// and FMA per 8 or 16 columns. The layout is the idea of llama.cpp's repacked CPU weights
// (ggml-cpu/repack.cpp), written anew for these types and lane counts.
//
// A tile is MR rows of x against all 16 columns of a panel (tile_rows: 8 rows with AVX-512's
// 32 registers, 3-4 with AVX2's 16), so each decoded weight vector serves MR rows and each
// broadcast activation the panel's column vectors; the K-quants walk one sub-block at a time to
// keep a tile's sums in registers, and without VNNI the first tile over a panel leaves its
// decoded codes for the rest (kCodesWrite). x is quantized once per call, 8 lanes at a time
// (bit-equal to the scalar loop, which the generic variant runs).
//
// Built once per tier and, where the tier allows, twice: PAGEDSERVE_Q8_VNNI set (with
// -mavx512vnni in the avx512 tier, -mavxvnni in the avx2 one; kernels/cpu_build.py) names the
// entry points *_vnni and multiplies with vpdpbusd; without it the loops use vpmaddubsw +
// vpmaddwd (AVX2 / AVX512BW), and the generic build a portable loop. Python picks one from the
// CPU's flags (kernels/gguf_ops.py). No STL containers here: the VNNI and plain objects must
// not share COMDAT template code.
//
// vpdpbusd and vpmaddubsw multiply unsigned by signed bytes, so the weight side is unsigned:
// 4/5/6-bit codes are (Q4_0's -8, Q5_0's -16, Q6_K's -32 become -8 / -16 / -32 * sum(q) added
// to the integer sum; pair sums stay below maddubs' int16 limit, 63 * 127 * 2); Q8_0 codes
// get +128 with a -128 * sum(q) correction under VNNI, and the sign trick (|c|, q * sign(c))
// under maddubs, whose int16 pair sums would saturate at 255 * 127 * 2.

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "convert.h"
#include "gguf_blocks.h"
#include "simd.h"

#if defined(PAGEDSERVE_Q8_VNNI)
#define Q8_ENTRY(name) name##_vnni
#else
#define Q8_ENTRY(name) name
#endif

namespace {

constexpr float kInv127 = 1.0f / 127.0f;

void repack(const uint8_t* w, uint8_t* out, int64_t n, int64_t k, int64_t type) {
  const int64_t nb = k / block_weights(type), bb = block_bytes(type), pb = packed_bytes(type);
  const int64_t panels = (n + PR - 1) / PR, row_bytes = nb * bb;
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* dst = out + (p * nb + b) * PR * pb;
      std::memset(dst, 0, PR * pb);  // rows past n: zero codes, zero scales
      for (int64_t r = 0; r < PR && p * PR + r < n; ++r)
        repack_block(type, w + (p * PR + r) * row_bytes + b * bb, dst, r);
    }
}

// The quantized activations of one call, row r's block b at i = r * nb + b: codes
// q[i * 32 ..], scale d[i], d * sum(q) in s[i], -sum(q) in nsum[i] (the 32-weight types'
// offsets, as shifts of it), minus the sums of its two 16-value halves in nhalf[2 * i],
// nhalf[2 * i + 1] (Q6_K's scale groups), and as int16 (|sum(q)| <= 32 * 127 fits) sum(q) in
// sum_h[i]: side by side, one broadcast is the pair of blocks 2j and 2j + 1 that Q4_K / Q5_K's
// minimums take.
struct QuantX {
  int8_t* q;
  float* d;
  float* s;
  int32_t* nsum;
  int32_t* nhalf;
  int16_t* sum_h;
  int64_t nb;
};

// max |x_t| of one block of 32 values: 8 lanes at a time where the tier has them, with the
// same result as the scalar loop (a NaN value does not win the max in either).
template <typename T>
inline float block_amax(const T* src, bool generic) {
#if PAGEDSERVE_SIMD
  if (!generic) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j)  // a NaN lane keeps amax
      amax = _mm256_max_ps(_mm256_and_ps(Avx2::load(src + 8 * j), absmask), amax);
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
  }
#endif
  float amax = 0.f;
  for (int t = 0; t < QK; ++t) amax = std::fmax(amax, std::fabs(load(src[t])));
  return amax;
}

// One block of 32 values as block i of qx with the scale of ``amax`` (its own, or its 256-value
// group's): d = amax * (1 / 127), q_t = round_half_even(x_t * (1 / d)), the sums. The SIMD path
// is bit-equal to the scalar loop (the same scale, product and rounding per value).
template <typename T>
inline void quantize_block(const T* src, QuantX& qx, int64_t i, float amax, bool generic) {
  // Through a volatile: -ffast-math would otherwise fold 1 / (amax * (1 / 127)) into
  // 127 / amax, a different rounding than the reference's (once per block, no cost).
  volatile float dv = amax * kInv127;
  const float d = dv, id = d != 0.f ? 1.f / d : 0.f;
  int32_t half[2] = {0, 0};
#if PAGEDSERVE_SIMD
  if (!generic) {
    const __m256 vid = _mm256_set1_ps(id), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
    __m256i qi[4];
    for (int j = 0; j < 4; ++j) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(Avx2::load(src + 8 * j), vid),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      qi[j] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
    }
    // int32 -> int8 by two saturating packs (exact: |q| <= 127), which interleave 4-byte groups
    // across the 128-bit halves; one permute puts them back in order.
    const __m256i packed = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qx.q + i * QK), packed);
    auto hsum = [](__m256i a) {
      __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
      return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
    };
    half[0] = hsum(_mm256_add_epi32(qi[0], qi[1]));
    half[1] = hsum(_mm256_add_epi32(qi[2], qi[3]));
  } else
#endif
  {
    int8_t* q = qx.q + i * QK;
    for (int t = 0; t < QK; ++t) {
      float r = std::nearbyint(load(src[t]) * id);  // ties to even, as torch.round
      r = r > 127.f ? 127.f : r < -127.f ? -127.f : r;
      q[t] = static_cast<int8_t>(r);
      half[t / 16] += q[t];
    }
  }
  const int32_t sum = half[0] + half[1];
  qx.d[i] = d;
  qx.nsum[i] = -sum;
  qx.nhalf[2 * i] = -half[0];
  qx.nhalf[2 * i + 1] = -half[1];
  qx.sum_h[i] = static_cast<int16_t>(sum);
  qx.s[i] = d * static_cast<float>(sum);
}

// x [m, k] into qx, one scale per ``group`` blocks of 32 (1: llama.cpp's Q8_0 activations; 8:
// its Q8_K's 256 values, which the K-quant tiles fold into one float step per 256 weights).
// A group's scale is stored with each of its blocks, so every loop reads qx the same way.
template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, QuantX& qx, int64_t group,
                   bool generic = false) {
  const int64_t groups = m * (k / QK) / group;
#pragma omp parallel for schedule(static) if (m * k >= (1 << 15))
  for (int64_t g = 0; g < groups; ++g) {
    const T* src = x + g * group * QK;  // rows are contiguous: group g of the whole matrix
    float amax = block_amax(src, generic);
    for (int64_t j = 1; j < group; ++j) amax = std::fmax(amax, block_amax(src + j * QK, generic));
    for (int64_t j = 0; j < group; ++j)
      quantize_block(src + j * QK, qx, g * group + j, amax, generic);
  }
}

// The portable loop over the repacked weights: the reference arithmetic, sub-blocks in order.
template <typename T>
void q8_generic(const QuantX& qx, const uint8_t* w, T* out, int64_t m, int64_t n,
                int64_t type) {
  const int64_t nb = qx.nb, per = block_weights(type) / QK, pb = packed_bytes(type);
#pragma omp parallel for schedule(static) if (n * nb >= (1 << 11))
  for (int64_t j = 0; j < n; ++j) {
    const int64_t p = j / PR, lane = j % PR;
    for (int64_t i = 0; i < m; ++i) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const PanelBlock blk{w + (p * (nb / per) + b / per) * PR * pb, type, lane};
        int32_t c[32];
        float dw, mw;
        decode_sub(blk, static_cast<int>(b % per), c, dw, mw);
        const int8_t* q = qx.q + (i * nb + b) * QK;
        int32_t isum = 0;
        for (int t = 0; t < QK; ++t) isum += c[t] * q[t];
        acc += static_cast<float>(isum) * (dw * qx.d[i * nb + b]);
        if (type == Q4_1 || type == Q5_1 || type == Q4_K || type == Q5_K)
          acc += mw * qx.s[i * nb + b];
      }
      store(acc, out + i * n + j);
    }
  }
}

#if PAGEDSERVE_SIMD
#if defined(PAGEDSERVE_Q8_VNNI)
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

// acc + p in int16 / int32 lanes, as asm statements so that GCC keeps a tile's sums as
// chains: it reassociates a chain of integer adds into a tree that keeps every product live at
// once, which spilled AVX2's 16 registers to the stack (the int16 pair sums: the AVX2 tier ran
// at ~60 % of DotSum's speed; the widened int32 sums: Zen 4, AVX2 Q6_K at 32 rows 78 -> 90
// GMAC/s with add32_chain).
template <class I>
inline I add16_chain(I acc, I p) {
  __asm__("vpaddw %1, %0, %0" : "+v"(acc) : "v"(p));
  return acc;
}

template <class I>
inline I add32_chain(I acc, I p) {
  __asm__("vpaddd %1, %0, %0" : "+v"(acc) : "v"(p));
  return acc;
}

// 8 int32 lanes (AVX2; vpdpbusd from AVX-VNNI or, in the avx512 tier, AVX512-VNNI's VL form).
struct I8 {
  static constexpr int L = 8;
  using I = __m256i;
  using F = __m256;
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const I*>(p)); }
  static void store(uint8_t* p, I v) { _mm256_storeu_si256(reinterpret_cast<I*>(p), v); }
  static I bcast(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
  static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  static I zero() { return _mm256_setzero_si256(); }
  static I low4(I v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
  static I high4(I v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
  static I flip(I v) { return _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80))); }
  static I abs8(I v) { return _mm256_sign_epi8(v, v); }
  static I sign8(I s, I w) { return _mm256_sign_epi8(s, w); }
  static I dot(I acc, I u, I s) {  // acc + four u8 x s8 products per lane
#if defined(PAGEDSERVE_Q8_VNNI) && defined(__AVX512VNNI__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(PAGEDSERVE_Q8_VNNI)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                   _mm256_set1_epi16(1)));
#endif
  }
  static I pairs(I u, I s) { return _mm256_maddubs_epi16(u, s); }  // int16 pair sums
  static I add16(I a, I b) { return _mm256_add_epi16(a, b); }
  static I widen(I acc, I s16, I by) {  // acc + the int16 pair sums times by, in int32 lanes
    return add32_chain(acc, _mm256_madd_epi16(s16, by));
  }
  static I corr(const int32_t* p, int shift) {  // *p * 2^shift in every lane
    return _mm256_slli_epi32(_mm256_set1_epi32(*p), shift);
  }
  static I slli32(I v, int shift) { return _mm256_slli_epi32(v, shift); }
  static I madd16(I a, I b) { return _mm256_madd_epi16(a, b); }
  // Lane j: int16 pair (a[j], b[j]) of L int8 at a and at b.
  static I s8pairs(const uint8_t* a, const uint8_t* b) {
    const __m128i va = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(a));
    const __m128i vb = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b));
    return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(va, vb));
  }
  static I u8pairs(const uint8_t* a, const uint8_t* b) {  // as s8pairs, of uint8
    const __m128i va = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(a));
    const __m128i vb = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b));
    return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(va, vb));
  }
  static I dot16(I acc, I a, I b) {  // acc + the int16 pair products of a and b, per lane
#if defined(PAGEDSERVE_Q8_VNNI) && defined(__AVX512VNNI__)
    return _mm256_dpwssd_epi32(acc, a, b);
#elif defined(PAGEDSERVE_Q8_VNNI)
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
  }
  static I bcast2(const int16_t* p) {  // the int16 pair (p[0], p[1]) in every lane
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
  // (int16(p[0]), int16(p[1])) in every lane, packed in scalar registers: where a tile's sums
  // fill the 16 registers, this measured faster than bcast2's load (Q6_K without VNNI: 30 %).
  static I bcast16pair(const int32_t* p) {
    return _mm256_set1_epi32(static_cast<int32_t>((static_cast<uint32_t>(p[1]) << 16) |
                                                  (static_cast<uint32_t>(p[0]) & 0xffffu)));
  }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I mullo(I a, I b) { return _mm256_mullo_epi32(a, b); }
  // Per byte: bit ``bit`` moved to bit 4 (and bit + 1 to 5 ...), masked by ``mask``.
  static I bits_to4(I v, int bit, int mask) {
    const I m = _mm256_set1_epi8(static_cast<char>(mask));
    return bit <= 4 ? _mm256_and_si256(_mm256_slli_epi16(v, 4 - bit), m)
                    : _mm256_and_si256(_mm256_srli_epi16(v, bit - 4), m);
  }
  // Per lane: 0x10 in byte t where bit ``shift + t`` of the lane's int32 is set (Q5_0 / Q5_1).
  static I spread4(I v, int shift) {
    const I x = _mm256_shuffle_epi8(_mm256_srli_epi32(v, shift),
                                    _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12,
                                                     12, 12, 12, 0, 0, 0, 0, 4, 4, 4, 4, 8, 8,
                                                     8, 8, 12, 12, 12, 12));
    const I bits = _mm256_set1_epi32(0x08040201);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(x, bits), bits),
                            _mm256_set1_epi8(0x10));
  }
  static I s8i(const uint8_t* p) {  // L int8 -> int32
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static F fzero() { return _mm256_setzero_ps(); }
  static F fset1(float v) { return _mm256_set1_ps(v); }
  static F halves(const uint8_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static F u8f(const uint8_t* p) {  // L uint8 -> float32
    return _mm256_cvtepi32_ps(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a * b
  static void storef(F v, float* p) { _mm256_storeu_ps(p, v); }
};

#if defined(PAGEDSERVE_AVX512)
// 16 int32 lanes (AVX512BW; vpdpbusd from AVX512-VNNI).
struct I16 {
  static constexpr int L = 16;
  using I = __m512i;
  using F = __m512;
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static void store(uint8_t* p, I v) { _mm512_storeu_si512(p, v); }
  static I bcast(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  static I zero() { return _mm512_setzero_si512(); }
  static I low4(I v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
  static I high4(I v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
  static I flip(I v) { return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80))); }
  static I abs8(I v) { return _mm512_abs_epi8(v); }
  static I sign8(I s, I w) {  // s where w > 0, -s where w < 0, 0 where w == 0
    const __mmask64 neg = _mm512_movepi8_mask(w), nz = _mm512_test_epi8_mask(w, w);
    return _mm512_maskz_mov_epi8(nz, _mm512_mask_sub_epi8(s, neg, _mm512_setzero_si512(), s));
  }
  static I dot(I acc, I u, I s) {
#if defined(PAGEDSERVE_Q8_VNNI)
    return _mm512_dpbusd_epi32(acc, u, s);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s),
                                                   _mm512_set1_epi16(1)));
#endif
  }
  static I pairs(I u, I s) { return _mm512_maddubs_epi16(u, s); }
  static I add16(I a, I b) { return _mm512_add_epi16(a, b); }
  static I widen(I acc, I s16, I by) {
    return add32_chain(acc, _mm512_madd_epi16(s16, by));
  }
  static I corr(const int32_t* p, int shift) {
    return _mm512_slli_epi32(_mm512_set1_epi32(*p), shift);
  }
  static I slli32(I v, int shift) { return _mm512_slli_epi32(v, shift); }
  static I madd16(I a, I b) { return _mm512_madd_epi16(a, b); }
  static I s8pairs(const uint8_t* a, const uint8_t* b) {
    const __m128i va = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
    const __m128i vb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
    return _mm512_cvtepi8_epi16(
        _mm256_set_m128i(_mm_unpackhi_epi8(va, vb), _mm_unpacklo_epi8(va, vb)));
  }
  static I u8pairs(const uint8_t* a, const uint8_t* b) {
    const __m128i va = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
    const __m128i vb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
    return _mm512_cvtepu8_epi16(
        _mm256_set_m128i(_mm_unpackhi_epi8(va, vb), _mm_unpacklo_epi8(va, vb)));
  }
  static I dot16(I acc, I a, I b) {
#if defined(PAGEDSERVE_Q8_VNNI)
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
  }
  static I bcast2(const int16_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  static I bcast16pair(const int32_t* p) {
    return _mm512_set1_epi32(static_cast<int32_t>((static_cast<uint32_t>(p[1]) << 16) |
                                                  (static_cast<uint32_t>(p[0]) & 0xffffu)));
  }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I bits_to4(I v, int bit, int mask) {
    const I m = _mm512_set1_epi8(static_cast<char>(mask));
    return bit <= 4 ? _mm512_and_si512(_mm512_slli_epi16(v, 4 - bit), m)
                    : _mm512_and_si512(_mm512_srli_epi16(v, bit - 4), m);
  }
  static I spread4(I v, int shift) {
    const I x = _mm512_shuffle_epi8(
        _mm512_srli_epi32(v, shift),
        _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12)));
    const __mmask64 set = _mm512_test_epi8_mask(x, _mm512_set1_epi32(0x08040201));
    return _mm512_maskz_mov_epi8(set, _mm512_set1_epi8(0x10));
  }
  static I s8i(const uint8_t* p) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static F fzero() { return _mm512_setzero_ps(); }
  static F fset1(float v) { return _mm512_set1_ps(v); }
  static F halves(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static F u8f(const uint8_t* p) {
    return _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static void storef(F v, float* p) { _mm512_storeu_ps(p, v); }
};
using IV = I16;
#else
using IV = I8;
#endif

// Per lane, a sum of 4-byte u8 x s8 products. VNNI: one vpdpbusd each. Otherwise vpmaddubsw's
// int16 pair sums are added up to kPer products in int16 and then widened by one vpmaddwd
// (against ones, or against per-lane int16 scales: Q6_K's, which the widening multiplies in
// for free): llama.cpp's trick, two instructions a product instead of three. kPer keeps the
// int16 sums exact: codes below 16 (Q4): 8 (8 * 2 * 15 * 127 < 32768); below 32 (Q5): 4;
// below 64: 2. kChains > 1 (VNNI, tiles of few rows): products alternate between independent
// accumulators, so one row's chain of dependent vpdpbusd does not bound a decode step.
// The int16 adds are add16_chain's asm statement (see add32_chain).

template <class V, int kPer, int kChains = 1>
struct DotSum {
  typename V::I acc, acc2, s16;
  int n;
  explicit DotSum(typename V::I init) : acc(init), acc2(V::zero()), s16(V::zero()), n(0) {}
  DotSum() : DotSum(V::zero()) {}
  void add(typename V::I u, typename V::I x, typename V::I widen_by) {
    if constexpr (kVnni) {
      if (kChains > 1 && (n++ & 1)) acc2 = V::dot(acc2, u, x);
      else acc = V::dot(acc, u, x);
    } else {
      s16 = n ? add16_chain(s16, V::pairs(u, x)) : V::pairs(u, x);
      if (++n == kPer) acc = V::widen(acc, s16, widen_by), n = 0;
    }
  }
  void add(typename V::I u, typename V::I x) { add(u, x, V::set1(0x00010001)); }
  typename V::I sum(typename V::I widen_by) const {
    if constexpr (kVnni) return kChains > 1 ? V::add(acc, acc2) : acc;
    return n ? V::widen(acc, s16, widen_by) : acc;
  }
  typename V::I sum() const { return sum(V::set1(0x00010001)); }
};

// Ask for ``bytes`` of weights from ``p`` (one line per 64 bytes; past the end is harmless, a
// prefetch never faults): a decode streams the weights from memory once, and the hardware
// prefetcher alone left it well below the machine's read bandwidth. The first tile of a panel asks
// a slice at a time (a block's worth per legacy block, an eighth of a 256-block per sub-block):
// one burst of a whole block ahead queued more misses than the core holds and the loads of the
// block being computed waited behind them (Q6_K at 1 row ran at a third of the bandwidth).
inline void prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p + off), _MM_HINT_T0);
}

// A tile: MR rows of x from r0 against all PR = NC * V::L columns of one panel, the float
// accumulators of row r, column vector c in acc[r][c]. Every weight vector decoded serves MR
// rows and every broadcast activation NC column vectors.
template <class V>
constexpr int kNC = static_cast<int>(PR / V::L);

// The tile's float accumulators into out (row-major, ldo), the first ``cols`` columns.
template <class V, int MR, typename T>
inline void store_tile(const typename V::F (*acc)[kNC<V>], T* out, int64_t r0, int64_t ldo,
                       int64_t cols) {
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < kNC<V>; ++c) {
      T* o = out + (r0 + r) * ldo + c * V::L;
      const int64_t left = cols - c * V::L;
      if (left <= 0) break;
      if constexpr (sizeof(T) == 4) {
        if (left >= V::L) {
          V::storef(acc[r][c], reinterpret_cast<float*>(o));
          continue;
        }
      }
      float tmp[V::L];
      V::storef(acc[r][c], tmp);
      for (int64_t j = 0; j < left && j < V::L; ++j) store(tmp[j], o + j);
    }
}

// 32-weight blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): per block, the codes of all lanes against 4
// broadcast activation codes at a time, then one scaling.
template <class V, int64_t TYPE, int MR, typename T>
inline void panel_tile(const QuantX& qx, int64_t r0, const uint8_t* panel, T* out, int64_t ldo,
                       int64_t cols, bool pf) {
  constexpr int NC = kNC<V>;
  constexpr int64_t pb = packed_bytes(TYPE), tail = tail_off(TYPE);
  constexpr bool has_min = TYPE == Q4_1 || TYPE == Q5_1;
  // Q4_0's -8, Q5_0's -16 and (VNNI) Q8_0's +128 offsets as -2^shift * sum(q).
  constexpr int shift = TYPE == Q4_0 ? 3 : TYPE == Q5_0 ? 4 : TYPE == Q8_0 && kVnni ? 7 : 0;
  const int64_t nb = qx.nb;
  typename V::F acc[MR][NC];
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
    #pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) acc[r][c] = V::fzero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = panel + b * PR * pb;
    if (pf) prefetch(blk + 8 * PR * pb, PR * pb);
    const int8_t* q[MR];
    typename V::I ai[MR][NC];
    #pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const int64_t i = (r0 + r) * nb + b;
      q[r] = qx.q + i * QK;
      const typename V::I init = shift ? V::corr(qx.nsum + i, shift) : V::zero();
      #pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) ai[r][c] = init;
    }
    if constexpr (TYPE == Q8_0) {
      for (int g = 0; g < 8; ++g) {
        typename V::I w[NC], u[NC];
        #pragma GCC unroll 16
        for (int c = 0; c < NC; ++c) {
          w[c] = V::load(blk + g * 64 + c * V::L * 4);
          u[c] = kVnni ? V::flip(w[c]) : V::abs8(w[c]);
        }
        #pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) {
          const typename V::I xs = V::bcast(q[r] + 4 * g);
          #pragma GCC unroll 16
          for (int c = 0; c < NC; ++c)
            ai[r][c] = V::dot(ai[r][c], u[c], kVnni ? xs : V::sign8(xs, w[c]));
        }
      }
    } else {
      constexpr bool q5 = TYPE == Q5_0 || TYPE == Q5_1;
      using Dots = DotSum<V, q5 ? 4 : 8, MR * NC <= 2 ? 2 : 1>;
      Dots dots[MR][NC];
      #pragma GCC unroll 16
      for (int r = 0; r < MR; ++r)
        #pragma GCC unroll 16
        for (int c = 0; c < NC; ++c) dots[r][c] = Dots(ai[r][c]);
      typename V::I qh[NC];
      if constexpr (q5)
        #pragma GCC unroll 16
        for (int c = 0; c < NC; ++c) qh[c] = V::load(blk + high_off(TYPE) + c * V::L * 4);
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        typename V::I lo[NC], hi[NC];
        #pragma GCC unroll 16
        for (int c = 0; c < NC; ++c) {
          const typename V::I raw = V::load(blk + g * 64 + c * V::L * 4);
          lo[c] = V::low4(raw), hi[c] = V::high4(raw);
          if constexpr (q5) {
            lo[c] = V::or_(lo[c], V::spread4(qh[c], 4 * g));
            hi[c] = V::or_(hi[c], V::spread4(qh[c], 16 + 4 * g));
          }
        }
        #pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) {
          const typename V::I xl = V::bcast(q[r] + 4 * g), xh = V::bcast(q[r] + 16 + 4 * g);
          #pragma GCC unroll 16
          for (int c = 0; c < NC; ++c) {
            dots[r][c].add(lo[c], xl);
            dots[r][c].add(hi[c], xh);
          }
        }
      }
      #pragma GCC unroll 16
      for (int r = 0; r < MR; ++r)
        #pragma GCC unroll 16
        for (int c = 0; c < NC; ++c) ai[r][c] = dots[r][c].sum();
    }
    typename V::F dw[NC];
    #pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) dw[c] = V::halves(blk + tail + c * V::L * 2);
    #pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const int64_t i = (r0 + r) * nb + b;
      const typename V::F dx = V::fset1(qx.d[i]);
      #pragma GCC unroll 16
      for (int c = 0; c < NC; ++c)
        acc[r][c] = V::fmadd(V::cvt(ai[r][c]), V::mul(dw[c], dx), acc[r][c]);
      if constexpr (has_min) {
        const typename V::F s = V::fset1(qx.s[i]);
        #pragma GCC unroll 16
        for (int c = 0; c < NC; ++c)
          acc[r][c] = V::fmadd(V::halves(blk + tail + PR * 2 + c * V::L * 2), s, acc[r][c]);
      }
    }
  }
  store_tile<V, MR>(acc, out, r0, ldo, cols);
}

// The K-quant tiles' source of codes: CODES 0 decodes them from the panel; where several
// tiles of rows pass over one panel without VNNI, the first (kCodesWrite) also stores them,
// one byte per weight in the panel's order, (block * 8 + sub-block) * 8 + group 64-byte lines,
// and the others (kCodesRead) load them back: the maddubs tiles spend their vector ports on
// every instruction, and the nibble masks, shifts and high-bit merges were one in 6-8 of them
// (Zen 4, 1 thread, 32 rows of 2048x2048, AVX2: Q4_K 120 -> 132 GMAC/s, Q6_K 73 -> 78; with
// add32_chain too, Q5_K 83 -> 117, and on AVX-512 Q5_K 105 -> 121, Q6_K 85 -> 105). Not taken
// where it measured no faster: under VNNI, and for Q4_K's one-mask decoding in AVX-512's 8-row
// tiles (139 -> 129).
constexpr int kCodesWrite = 1, kCodesRead = 2;

// Q4_K / Q5_K's 256-weight blocks against Q8_K-style activations (one scale dx per 256):
//     dx * (d * sum_s sc_s * isum_s - dmin * sum_s m_s * sum(q_s))
// Sub-blocks 2j and 2j + 1 share code bytes (low and high nibbles); one sub-block at a time (the
// code bytes are read twice, from L1), so a tile holds MR x NC integer sums, not twice that.
// VNNI: each sub-block's int32 sum times d * sc_s into a float sum of the block. Otherwise the
// int16 pair sums are widened by vpmaddwd against sc_s (which multiplies the scale in), so the
// block's sum stays in int32. The minimums' term is integer too: (m_2j, m_2j+1) as int16 pairs
// against the activations' pairs of 32-value sums, 4 vpdpwssd (or vpmaddwd) per row and block.
template <class V, int64_t TYPE, int MR, int CODES, typename T>
inline void panel_tile_k(const QuantX& qx, int64_t r0, const uint8_t* panel, T* out,
                         int64_t ldo, int64_t cols, bool pf, uint8_t* codes) {
  constexpr int NC = kNC<V>;
  constexpr int64_t pb = packed_bytes(TYPE), tail = tail_off(TYPE);
  const int64_t nb = qx.nb;
  typename V::F acc[MR][NC];
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
    #pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) acc[r][c] = V::fzero();
  for (int64_t b = 0; b < nb / 8; ++b) {
    const uint8_t* blk = panel + b * PR * pb;
    typename V::F d[NC];
    #pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) d[c] = V::halves(blk + tail + 256 + c * V::L * 2);
    // VNNI: float sums of d * sc_s * isum_s; otherwise int32 sums of sc_s * isum_s.
    typename V::F fsb[MR][NC];
    typename V::I isb[MR][NC];
    #pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
      #pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) {
        if constexpr (kVnni) fsb[r][c] = V::fzero();
        else isb[r][c] = V::zero();
      }
#pragma GCC unroll 1
    for (int j = 0; j < 4; ++j)
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      const int s = 2 * j + half;
      if (pf) prefetch(blk + 2 * PR * pb + s * (PR * pb / 8), PR * pb / 8 + 64);
      using Dots = DotSum<V, TYPE == Q4_K ? 8 : 4, MR * NC <= 2 ? 2 : 1>;
      Dots dots[MR][NC];
      if constexpr (!kVnni)
        #pragma GCC unroll 16
        for (int r = 0; r < MR; ++r)
          #pragma GCC unroll 16
          for (int c = 0; c < NC; ++c) dots[r][c] = Dots(isb[r][c]);
      typename V::I scp[NC];  // non-VNNI: sc_s as int16 pairs, the widening's multiplier
      if constexpr (!kVnni)
        #pragma GCC unroll 16
        for (int c = 0; c < NC; ++c) {
          const uint8_t* p = blk + tail + s * 16 + c * V::L;
          scp[c] = V::u8pairs(p, p);
        }
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        typename V::I u[NC];
        #pragma GCC unroll 16
        for (int c = 0; c < NC; ++c) {
          const int64_t co = ((b * 8 + s) * 8 + g) * 64 + c * V::L * 4;
          if constexpr (CODES == kCodesRead) {
            u[c] = V::load(codes + co);
          } else {
            const typename V::I raw = V::load(blk + (8 * j + g) * 64 + c * V::L * 4);
            u[c] = half ? V::high4(raw) : V::low4(raw);
            if constexpr (TYPE == Q5_K) {
              const typename V::I h = V::load(blk + high_off(TYPE) + g * 64 + c * V::L * 4);
              u[c] = V::or_(u[c], V::bits_to4(h, s, 0x10));
            }
            if constexpr (CODES == kCodesWrite) V::store(codes + co, u[c]);
          }
        }
        #pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) {
          const typename V::I xs = V::bcast(qx.q + ((r0 + r) * nb + b * 8 + s) * QK + 4 * g);
          #pragma GCC unroll 16
          for (int c = 0; c < NC; ++c) {
            if constexpr (kVnni) dots[r][c].add(u[c], xs);
            else dots[r][c].add(u[c], xs, scp[c]);
          }
        }
      }
      if constexpr (kVnni) {
        typename V::F dw[NC];
        #pragma GCC unroll 16
        for (int c = 0; c < NC; ++c) dw[c] = V::mul(d[c], V::u8f(blk + tail + s * 16 + c * V::L));
        #pragma GCC unroll 16
        for (int r = 0; r < MR; ++r)
          #pragma GCC unroll 16
          for (int c = 0; c < NC; ++c)
            fsb[r][c] = V::fmadd(V::cvt(dots[r][c].sum()), dw[c], fsb[r][c]);
      } else {
        #pragma GCC unroll 16
        for (int r = 0; r < MR; ++r)
          #pragma GCC unroll 16
          for (int c = 0; c < NC; ++c) isb[r][c] = dots[r][c].sum(scp[c]);
      }
    }
    typename V::I mins[MR][NC];
    #pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
      #pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) mins[r][c] = V::zero();
    #pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      typename V::I mp[NC];
      #pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) {
        const uint8_t* p = blk + tail + 128 + 2 * j * 16 + c * V::L;
        mp[c] = V::u8pairs(p, p + 16);
      }
      #pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        const typename V::I sp = V::bcast2(qx.sum_h + (r0 + r) * nb + b * 8 + 2 * j);
        #pragma GCC unroll 16
        for (int c = 0; c < NC; ++c) mins[r][c] = V::dot16(mins[r][c], mp[c], sp);
      }
    }
    typename V::F dmin[NC];
    #pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) dmin[c] = V::halves(blk + tail + 288 + c * V::L * 2);
    #pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const typename V::F dx = V::fset1(qx.d[(r0 + r) * nb + b * 8]);
      #pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) {
        const typename V::F main = kVnni ? fsb[r][c] : V::mul(d[c], V::cvt(isb[r][c]));
        acc[r][c] = V::fmadd(V::fnmadd(dmin[c], V::cvt(mins[r][c]), main), dx, acc[r][c]);
      }
    }
  }
  store_tile<V, MR>(acc, out, r0, ldo, cols);
}

// The end of a Q6_K block in either tile: its int32 sums times d * dx into the accumulators.
template <class V, int MR>
inline void q6k_block_end(typename V::F (*acc)[kNC<V>], const typename V::I (*tot)[kNC<V>],
                          const uint8_t* blk, const QuantX& qx, int64_t r0, int64_t b) {
  constexpr int NC = kNC<V>;
  typename V::F d[NC];
  #pragma GCC unroll 16
  for (int c = 0; c < NC; ++c) d[c] = V::halves(blk + tail_off(Q6_K) + 256 + c * V::L * 2);
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    const typename V::F dx = V::fset1(qx.d[(r0 + r) * qx.nb + b * 8]);
    #pragma GCC unroll 16
    for (int c = 0; c < NC; ++c)
      acc[r][c] = V::fmadd(V::cvt(tot[r][c]), V::mul(d[c], dx), acc[r][c]);
  }
}

// Q6_K against Q8_K-style activations (one scale dx per 256): per 16-weight group, the integer
// sum (codes q6 - 32, the -32 as -32 * the group's activation sum) times its int8 scale, summed
// in integers over the whole block, then one float step d * dx.
template <class V, int MR, typename T>
inline void panel_tile_q6k(const QuantX& qx, int64_t r0, const uint8_t* panel, T* out,
                           int64_t ldo, int64_t cols, bool pf) {
  constexpr int NC = kNC<V>;
  constexpr int64_t pb = packed_bytes(Q6_K), tail = tail_off(Q6_K), hoff = high_off(Q6_K);
  const int64_t nb = qx.nb;
  typename V::F acc[MR][NC];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) acc[r][c] = V::fzero();
  for (int64_t b = 0; b < nb / 8; ++b) {
    const uint8_t* blk = panel + b * PR * pb;
    typename V::I tot[MR][NC];
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) tot[r][c] = V::zero();
#pragma GCC unroll 8
    for (int s = 0; s < 8; ++s) {
      const int h = s / 4, s4 = s % 4;
      if (pf) prefetch(blk + 2 * PR * pb + s * (PR * pb / 8), PR * pb / 8 + 64);
#pragma GCC unroll 2
      for (int part = 0; part < 2; ++part) {  // the two 16-weight groups, one at a time
        using Dots = DotSum<V, 2, MR * NC <= 2 ? 2 : 1>;
        Dots ia[MR][NC];
        // The -32 offset as the sum's start: a broadcast and a shift, off the multiply ports
        // (one vpdpwssd per sub-block for both groups measured 6 % slower on Zen 4).
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) {
          const int64_t i = (r0 + r) * nb + b * 8 + s;
          const typename V::I ca = V::corr(qx.nhalf + 2 * i + part, 5);
#pragma GCC unroll 16
          for (int c = 0; c < NC; ++c) ia[r][c] = Dots(ca);
        }
#pragma GCC unroll 4
        for (int g = 4 * part; g < 4 * part + 4; ++g) {
          typename V::I u[NC];
#pragma GCC unroll 16
          for (int c = 0; c < NC; ++c) {
            const int64_t o = c * V::L * 4;
            const typename V::I raw = V::load(blk + (16 * h + 8 * (s4 & 1) + g) * 64 + o);
            const typename V::I hv = V::load(blk + hoff + (8 * h + g) * 64 + o);
            u[c] = V::or_(s4 >> 1 ? V::high4(raw) : V::low4(raw), V::bits_to4(hv, 2 * s4, 0x30));
          }
#pragma GCC unroll 16
          for (int r = 0; r < MR; ++r) {
            const typename V::I xs = V::bcast(qx.q + ((r0 + r) * nb + b * 8 + s) * QK + 4 * g);
#pragma GCC unroll 16
            for (int c = 0; c < NC; ++c) ia[r][c].add(u[c], xs);
          }
        }
        typename V::I sc[NC];
#pragma GCC unroll 16
        for (int c = 0; c < NC; ++c) sc[c] = V::s8i(blk + tail + (2 * s + part) * 16 + c * V::L);
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
          for (int c = 0; c < NC; ++c)
            tot[r][c] = V::add(tot[r][c], V::mullo(ia[r][c].sum(), sc[c]));
      }
    }
    q6k_block_end<V, MR>(acc, tot, blk, qx, r0, b);
  }
  store_tile<V, MR>(acc, out, r0, ldo, cols);
}

// Q6_K without VNNI: the int16 pair sums of two groups of 4 codes are widened by one vpmaddwd
// against the 16-weight group's int8 scale as int16 pairs (the widening multiplies the scale
// in), so each (row, column vector) holds one int32 sum per sub-block. The -32 offsets of both
// groups are one vpmaddwd too: (-sum16a, -sum16b) against (sca, scb), times 32.
template <class V, int MR, int CODES, typename T>
inline void panel_tile_q6k_pairs(const QuantX& qx, int64_t r0, const uint8_t* panel, T* out,
                                 int64_t ldo, int64_t cols, bool pf, uint8_t* codes) {
  constexpr int NC = kNC<V>;
  constexpr int64_t pb = packed_bytes(Q6_K), tail = tail_off(Q6_K), hoff = high_off(Q6_K);
  const int64_t nb = qx.nb;
  typename V::F acc[MR][NC];
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
    #pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) acc[r][c] = V::fzero();
  for (int64_t b = 0; b < nb / 8; ++b) {
    const uint8_t* blk = panel + b * PR * pb;
    if (MR > 2 && pf) prefetch(blk + 2 * PR * pb, PR * pb);
    typename V::I tot[MR][NC];  // the block's int32 sums, all 8 sub-blocks
    #pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
      #pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) tot[r][c] = V::zero();
#pragma GCC unroll 8
    for (int s = 0; s < 8; ++s) {
      const int h = s / 4, s4 = s % 4;
      // Spread over the sub-blocks where few rows leave the loads waiting on memory; at 3+
      // rows the 16 AVX2 registers are full and the extra loop costs more than it hides.
      if (MR <= 2 && pf) prefetch(blk + 2 * PR * pb + s * (PR * pb / 8), PR * pb / 8 + 64);
      typename V::I sab[NC];
      #pragma GCC unroll 16
      for (int c = 0; c < NC; ++c)
        sab[c] = V::s8pairs(blk + tail + 2 * s * 16 + c * V::L,
                            blk + tail + (2 * s + 1) * 16 + c * V::L);
      #pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        const int64_t i = (r0 + r) * nb + b * 8 + s;
        const typename V::I negs = V::bcast16pair(qx.nhalf + 2 * i);
        #pragma GCC unroll 16
        for (int c = 0; c < NC; ++c)
          tot[r][c] = V::add(tot[r][c], V::slli32(V::madd16(negs, sab[c]), 5));
      }
#pragma GCC unroll 2
      for (int part = 0; part < 2; ++part) {
        typename V::I sc[NC];
        #pragma GCC unroll 16
        for (int c = 0; c < NC; ++c) {
          const uint8_t* p = blk + tail + (2 * s + part) * 16 + c * V::L;
          sc[c] = V::s8pairs(p, p);
        }
#pragma GCC unroll 2
        for (int g = 4 * part; g < 4 * part + 4; g += 2) {
          typename V::I u0[NC], u1[NC];
          #pragma GCC unroll 16
          for (int c = 0; c < NC; ++c) {
            const int64_t o = c * V::L * 4;
            const int64_t co = ((b * 8 + s) * 8 + g) * 64 + o;
            if constexpr (CODES == kCodesRead) {
              u0[c] = V::load(codes + co), u1[c] = V::load(codes + co + 64);
            } else {
              const typename V::I raw0 = V::load(blk + (16 * h + 8 * (s4 & 1) + g) * 64 + o);
              const typename V::I raw1 = V::load(blk + (16 * h + 8 * (s4 & 1) + g + 1) * 64 + o);
              const typename V::I h0 = V::load(blk + hoff + (8 * h + g) * 64 + o);
              const typename V::I h1 = V::load(blk + hoff + (8 * h + g + 1) * 64 + o);
              u0[c] = V::or_(s4 >> 1 ? V::high4(raw0) : V::low4(raw0),
                             V::bits_to4(h0, 2 * s4, 0x30));
              u1[c] = V::or_(s4 >> 1 ? V::high4(raw1) : V::low4(raw1),
                             V::bits_to4(h1, 2 * s4, 0x30));
              if constexpr (CODES == kCodesWrite)
                V::store(codes + co, u0[c]), V::store(codes + co + 64, u1[c]);
            }
          }
          #pragma GCC unroll 16
          for (int r = 0; r < MR; ++r) {
            const int8_t* q = qx.q + ((r0 + r) * nb + b * 8 + s) * QK;
            const typename V::I x0 = V::bcast(q + 4 * g), x1 = V::bcast(q + 4 * g + 4);
            #pragma GCC unroll 16
            for (int c = 0; c < NC; ++c)
              tot[r][c] = V::widen(
                  tot[r][c], add16_chain(V::pairs(u0[c], x0), V::pairs(u1[c], x1)), sc[c]);
          }
        }
      }
    }
    q6k_block_end<V, MR>(acc, tot, blk, qx, r0, b);
  }
  store_tile<V, MR>(acc, out, r0, ldo, cols);
}

template <class V, int64_t TYPE, int MR, int CODES, typename T>
inline void tile(const QuantX& qx, int64_t r0, const uint8_t* panel, T* out, int64_t ldo,
                 int64_t cols, bool pf, uint8_t* codes) {
  if constexpr (TYPE == Q6_K && !kVnni)
    panel_tile_q6k_pairs<V, MR, CODES>(qx, r0, panel, out, ldo, cols, pf, codes);
  else if constexpr (TYPE == Q6_K) panel_tile_q6k<V, MR>(qx, r0, panel, out, ldo, cols, pf);
  else if constexpr (TYPE == Q4_K || TYPE == Q5_K)
    panel_tile_k<V, TYPE, MR, CODES>(qx, r0, panel, out, ldo, cols, pf, codes);
  else panel_tile<V, TYPE, MR>(qx, r0, panel, out, ldo, cols, pf);
}

// Rows of x per tile: as many as the registers hold beside the tile's sums. 32 registers
// (AVX-512): 8. AVX2's 16: 4 for the 32-weight types (8 sums of two column vectors) and for the
// K-quants without VNNI (measured best from 2 to 6 rows on Zen 4, some sums spilled: the
// decoded weights serve more rows), 3 for the K-quants with VNNI, whose block sums are float.
template <class V, int64_t TYPE>
constexpr int tile_rows() {
  return V::L == 16 ? 8 : k_quant(TYPE) && kVnni ? 3 : 4;
}

// Rows of x per pass over the weights: a block of rows whose codes fill about 256 KB, so they
// stay in L2 (512 KB on Zen 3, 1-2 MB on Zen 4 and Sapphire Rapids) while every panel of the
// thread's share multiplies them; each pass reads the weights again, from L3 or memory, but a
// pass holds 256 KB x 16 products per weight byte. Without it a 2048-row prefill chunk re-read
// all of x per 16-column panel: on Zen 4 (1 thread, VNNI) Q4_K 2048x2048 ran 145 -> 156 GMAC/s
// with it, a K = 8192 down projection Q4_K 132 -> 169 and Q6_K 86 -> 123.
constexpr int64_t kRowBlockBytes = 1 << 18;

// Rows r0 .. r1 of x against one panel, in tiles of MR rows then 4, 2, 1: the first tile
// (a full one, with codes FIRST) prefetches the panel's weights, the others take codes REST.
template <class V, int64_t TYPE, int FIRST, int REST, typename T>
inline void row_tiles(const QuantX& qx, int64_t r0, int64_t r1, const uint8_t* panel, T* out,
                      int64_t ldo, int64_t cols, uint8_t* codes) {
  constexpr int MR = tile_rows<V, TYPE>();
  int64_t r = r0;
  if (r + MR <= r1) tile<V, TYPE, MR, FIRST>(qx, r, panel, out, ldo, cols, true, codes), r += MR;
  for (; r + MR <= r1; r += MR)
    tile<V, TYPE, MR, REST>(qx, r, panel, out, ldo, cols, false, codes);
  if constexpr (MR > 4)
    for (; r + 4 <= r1; r += 4)
      tile<V, TYPE, 4, REST>(qx, r, panel, out, ldo, cols, r == r0, codes);
  for (; r + 2 <= r1; r += 2) tile<V, TYPE, 2, REST>(qx, r, panel, out, ldo, cols, r == r0, codes);
  if (r < r1) tile<V, TYPE, 1, REST>(qx, r, panel, out, ldo, cols, r == r0, codes);
}

template <class V, int64_t TYPE, typename T>
void q8_simd(const QuantX& qx, const uint8_t* w, T* out, int64_t m, int64_t n) {
  constexpr int MR = tile_rows<V, TYPE>();
  const int64_t nb = qx.nb, panels = (n + PR - 1) / PR;
  const int64_t panel_bytes = nb * QK / block_weights(TYPE) * PR * packed_bytes(TYPE);
  int64_t rb = kRowBlockBytes / (nb * QK);
  rb = rb < MR ? MR : rb / MR * MR;
  // Panels outside (each panel's weights, 9-27 KB for SmolLM2, stay in L1/L2 over a block's
  // rows), rows inside in tiles of MR; the first tile of a panel in a block prefetches its
  // weights. The quantized x is a quarter of its float32 bytes.
  // Decoded codes (kCodesWrite) where a row block holds 2 tiles or more: a buffer per thread
  // of one panel's codes, 16 x K bytes.
  constexpr bool kDecodeOnce = k_quant(TYPE) && !kVnni && (V::L == 8 || TYPE != Q4_K);
  const bool decode_once = kDecodeOnce && (m < rb ? m : rb) >= 2 * MR;
#pragma omp parallel if (n * nb * (m < 4 ? m : 4) >= (1 << 11))
  {
    uint8_t* codes = decode_once ? static_cast<uint8_t*>(std::malloc(nb * QK * PR)) : nullptr;
    for (int64_t r0 = 0; r0 < m; r0 += rb) {
      const int64_t r1 = r0 + rb < m ? r0 + rb : m;
      const bool once = codes && r1 - r0 >= 2 * MR;
#pragma omp for schedule(static) nowait
      for (int64_t p = 0; p < panels; ++p) {
        const uint8_t* panel = w + p * panel_bytes;
        T* o = out + p * PR;
        if constexpr (kDecodeOnce)
          if (once) {
            row_tiles<V, TYPE, kCodesWrite, kCodesRead>(qx, r0, r1, panel, o, n, n - p * PR,
                                                        codes);
            continue;
          }
        row_tiles<V, TYPE, 0, 0>(qx, r0, r1, panel, o, n, n - p * PR, nullptr);
      }
    }
    std::free(codes);
  }
}
#endif

template <typename T>
int q8_linear(const T* x, const uint8_t* w, T* out, int64_t m, int64_t n, int64_t k,
              int64_t type, int64_t generic) {
  if (!known_type(type) || k % block_weights(type)) return -1;
  QuantX qx;
  qx.nb = k / QK;
  const int64_t blocks = m * qx.nb;
  qx.q = static_cast<int8_t*>(std::malloc(blocks * QK + 64));
  qx.d = static_cast<float*>(std::malloc(blocks * sizeof(float) + 4));
  qx.s = static_cast<float*>(std::malloc(blocks * sizeof(float) + 4));
  qx.nsum = static_cast<int32_t*>(std::malloc(blocks * sizeof(int32_t) + 4));
  qx.nhalf = static_cast<int32_t*>(std::malloc(2 * blocks * sizeof(int32_t) + 4));
  qx.sum_h = static_cast<int16_t*>(std::malloc(blocks * sizeof(int16_t) + 4));
  int rc = 0;
  if (!qx.q || !qx.d || !qx.s || !qx.nsum || !qx.nhalf || !qx.sum_h) {
    rc = -2;
  } else {
    quantize_rows(x, m, k, qx, k_quant(type) ? 8 : 1, generic != 0);
#if PAGEDSERVE_SIMD
    if (!generic) {
      switch (type) {
        case Q4_0: q8_simd<IV, Q4_0>(qx, w, out, m, n); break;
        case Q4_1: q8_simd<IV, Q4_1>(qx, w, out, m, n); break;
        case Q5_0: q8_simd<IV, Q5_0>(qx, w, out, m, n); break;
        case Q5_1: q8_simd<IV, Q5_1>(qx, w, out, m, n); break;
        case Q4_K: q8_simd<IV, Q4_K>(qx, w, out, m, n); break;
        case Q5_K: q8_simd<IV, Q5_K>(qx, w, out, m, n); break;
        case Q6_K: q8_simd<IV, Q6_K>(qx, w, out, m, n); break;
        default: q8_simd<IV, Q8_0>(qx, w, out, m, n); break;
      }
    }
#else
    generic = 1;
#endif
    if (generic) q8_generic(qx, w, out, m, n, type);
  }
  std::free(qx.q), std::free(qx.d), std::free(qx.s), std::free(qx.nsum), std::free(qx.nhalf);
  std::free(qx.sum_h);
  return rc;
}

}  // namespace

extern "C" {

// x [m, k] contiguous (float32 or bfloat16), w the repacked weights of ``gguf_q8_repack``
// ([ceil(n / 16) * 16, k / block_weights * packed_bytes] bytes of GGML type ``type``), out
// [m, n] in x's dtype, k a multiple of the type's block. ``generic``: the portable loop
// (tests). Returns 0, -1 for an unknown type or a k that is not, -2 when the activation
// buffers cannot be allocated.
int Q8_ENTRY(gguf_q8_linear_f32)(const float* x, const uint8_t* w, float* out, int64_t m,
                                 int64_t n, int64_t k, int64_t type, int64_t generic) {
  return q8_linear(x, w, out, m, n, k, type, generic);
}

int Q8_ENTRY(gguf_q8_linear_bf16)(const uint16_t* x, const uint8_t* w, uint16_t* out,
                                  int64_t m, int64_t n, int64_t k, int64_t type,
                                  int64_t generic) {
  return q8_linear(x, w, out, m, n, k, type, generic);
}

#if !defined(PAGEDSERVE_Q8_VNNI)
// GGUF rows w [n, k / block_weights * block_bytes] of ``type`` into the panels the int8 kernel
// reads, out [ceil(n / 16) * 16, k / block_weights * packed_bytes] bytes (gguf_blocks.h; the
// same layout for every variant).
void gguf_q8_repack(const uint8_t* w, uint8_t* out, int64_t n, int64_t k, int64_t type) {
  repack(w, out, n, k, type);
}

// Rows index[0 .. count) of the weights in panels w (as gguf_q8_repack wrote them), de-quantized
// into out [count, k] float32, bit-equal to de-quantizing the file's rows (an embedding lookup
// whose table is shared with a tied lm_head's panels). The caller checks the indices.
void gguf_q8_dequantize_rows(const uint8_t* w, const int64_t* index, int64_t count, float* out,
                             int64_t k, int64_t type) {
  const int64_t nb = k / block_weights(type), per = block_weights(type) / QK;
  const int64_t pb = packed_bytes(type);
#pragma omp parallel for schedule(static) if (count * k >= (1 << 16))
  for (int64_t t = 0; t < count; ++t) {
    const int64_t p = index[t] / PR, lane = index[t] % PR;
    for (int64_t b = 0; b < nb; ++b) {
      const PanelBlock blk{w + (p * nb + b) * PR * pb, type, lane};
      for (int64_t s = 0; s < per; ++s)
        dequant_sub(blk, static_cast<int>(s), out + t * k + (b * per + s) * QK);
    }
  }
}
#endif

}  // extern "C"
