// The int8-activation mode of the GGUF products (``--cpu-linear-mode int8``): y[M, N] =
// x[M, K] @ W[N, K]^T with x quantized to 8 bits per block of 32 values and every block's
// product taken in integers, as llama.cpp does on the CPU (its Q8_0 activation blocks against
// Q4_0 / Q4_1 / Q8_0 weights); the exact mode is gguf_gemm.cpp.
//
// Per activation block (32 values x_t): amax = max |x_t|, d = amax * float32(1 / 127),
// q_t = round_half_even(x_t * (1 / d)) in [-127, 127] (all zero when d = 0). Per weight block
// (scale dw, for Q4_1 the minimum mw, integer codes c_t: Q8_0 int8, Q4_0 nibble - 8, Q4_1
// nibble) the block contributes
//     float(sum_t c_t q_t) * (dw * d)              (+ mw * (d * float(sum_t q_t)) for Q4_1)
// with the integer sum exact, blocks summed in order; kernels/q8_reference.py is the same
// arithmetic in torch (the variants differ from it in float rounding only: an FMA here).
//
// Weights are repacked once at load (gguf_q8_repack) into panels of 16 rows: per block, the
// rows' codes interleaved 4 bytes at a time (Q4: byte j of a block holds weights j and j + 16,
// so a 64-byte group holds 4 codes of each of 16 rows for two groups of 4 weights), then their
// 16 fp16 scales (and minimums): the same bytes as the file's. One int32 lane per output
// column then sums four byte products per instruction (vpdpbusd, or vpmaddubsw + vpmaddwd)
// against 4 activation codes broadcast to every lane, so a block's integer sum needs no
// horizontal reduction, and the per-block scaling is one convert and FMA per 8 or 16 columns.
// The layout is the idea of llama.cpp's repacked CPU weights (ggml-cpu/repack.cpp), written
// anew for these types and lane counts.
//
// Built once per tier and, where the tier allows, twice: PAGEDSERVE_Q8_VNNI set (with
// -mavx512vnni in the avx512 tier, -mavxvnni in the avx2 one; kernels/cpu_build.py) names the
// entry points *_vnni and multiplies with vpdpbusd; without it the loops use vpmaddubsw +
// vpmaddwd (AVX2 / AVX512BW), and the generic build a portable loop. Python picks one from the
// CPU's flags (kernels/gguf_ops.py). No STL containers here: the VNNI and plain objects must
// not share COMDAT template code.
//
// vpdpbusd and vpmaddubsw multiply unsigned by signed bytes, so the weight side is unsigned:
// Q4 nibbles are (Q4_0's -8 becomes -8 * sum(q) added to the block's integer sum); Q8_0 codes
// get +128 with a -128 * sum(q) correction under VNNI, and the sign trick (|c|, q * sign(c))
// under maddubs, whose int16 pair sums would saturate at 255 * 127 * 2.

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "convert.h"
#include "simd.h"

#if defined(PAGEDSERVE_Q8_VNNI)
#define Q8_ENTRY(name) name##_vnni
#else
#define Q8_ENTRY(name) name
#endif

namespace {

constexpr int64_t QK = 32, PR = 16;  // weights per block; rows per repacked panel
enum : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };
constexpr int64_t block_bytes(int64_t t) { return t == Q4_0 ? 18 : t == Q4_1 ? 20 : 34; }
constexpr int64_t code_bytes(int64_t t) { return t == Q8_0 ? 32 : 16; }
constexpr float kInv127 = 1.0f / 127.0f;

// A repacked panel's block: PR * code_bytes codes in 4-byte groups (group g: row r's code
// bytes 4g..4g+3 at g * 64 + r * 4), then PR fp16 scales, then (Q4_1) PR fp16 minimums.
void repack(const uint8_t* w, uint8_t* out, int64_t n, int64_t k, int64_t type) {
  const int64_t nb = k / QK, bb = block_bytes(type), cb = code_bytes(type);
  const int64_t panels = (n + PR - 1) / PR, row_bytes = nb * bb;
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* dst = out + (p * nb + b) * PR * bb;
      std::memset(dst, 0, PR * bb);  // rows past n: zero codes, zero scales
      for (int64_t r = 0; r < PR && p * PR + r < n; ++r) {
        const uint8_t* blk = w + (p * PR + r) * row_bytes + b * bb;
        const uint8_t* codes = blk + (type == Q4_1 ? 4 : 2);
        for (int64_t g = 0; g < cb / 4; ++g) std::memcpy(dst + g * 64 + r * 4, codes + g * 4, 4);
        std::memcpy(dst + PR * cb + r * 2, blk, 2);
        if (type == Q4_1) std::memcpy(dst + PR * cb + PR * 2 + r * 2, blk + 2, 2);
      }
    }
}

// The quantized activations of one call, row r's block b at i = r * nb + b: codes
// q[i * 32 ..], scale d[i], integer sum(q) in sum[i], d * sum(q) in s[i].
struct QuantX {
  int8_t* q;
  float* d;
  float* s;
  int32_t* sum;
  int64_t nb;
};

template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, QuantX& qx) {
  const int64_t nb = k / QK;
#pragma omp parallel for schedule(static) if (m * k >= (1 << 15))
  for (int64_t i = 0; i < m * nb; ++i) {
    const T* src = x + i * QK;  // rows are contiguous: block i of the whole matrix
    float v[QK], amax = 0.f;
    for (int t = 0; t < QK; ++t) {
      v[t] = load(src[t]);
      amax = std::fmax(amax, std::fabs(v[t]));
    }
    // Through a volatile: -ffast-math would otherwise fold 1 / (amax * (1 / 127)) into
    // 127 / amax, a different rounding than the reference's (once per block, no cost).
    volatile float dv = amax * kInv127;
    const float d = dv, id = d != 0.f ? 1.f / d : 0.f;
    int8_t* q = qx.q + i * QK;
    int32_t sum = 0;
    for (int t = 0; t < QK; ++t) {
      float r = std::nearbyint(v[t] * id);  // ties to even, as torch.round
      r = r > 127.f ? 127.f : r < -127.f ? -127.f : r;
      q[t] = static_cast<int8_t>(r);
      sum += q[t];
    }
    qx.d[i] = d;
    qx.sum[i] = sum;
    qx.s[i] = d * static_cast<float>(sum);
  }
}

// The portable loop over the repacked weights: the reference arithmetic, blocks in order.
template <int64_t TYPE, typename T>
void q8_generic(const QuantX& qx, const uint8_t* w, T* out, int64_t m, int64_t n) {
  const int64_t nb = qx.nb, bb = block_bytes(TYPE), cb = code_bytes(TYPE);
#pragma omp parallel for schedule(static) if (n * nb >= (1 << 11))
  for (int64_t j = 0; j < n; ++j) {
    const int64_t p = j / PR, lane = j % PR;
    for (int64_t i = 0; i < m; ++i) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + (p * nb + b) * PR * bb;
        const int8_t* q = qx.q + (i * nb + b) * QK;
        int32_t isum = 0;
        for (int64_t g = 0; g < cb / 4; ++g)
          for (int t = 0; t < 4; ++t) {
            const uint8_t c = blk[g * 64 + lane * 4 + t];
            if constexpr (TYPE == Q8_0) {
              isum += static_cast<int8_t>(c) * q[4 * g + t];
            } else {
              const int bias = TYPE == Q4_0 ? 8 : 0;
              isum += ((c & 15) - bias) * q[4 * g + t] + ((c >> 4) - bias) * q[16 + 4 * g + t];
            }
          }
        const float dw = fp16(blk + PR * cb + lane * 2);
        acc += static_cast<float>(isum) * (dw * qx.d[i * nb + b]);
        if constexpr (TYPE == Q4_1)
          acc += fp16(blk + PR * cb + PR * 2 + lane * 2) * qx.s[i * nb + b];
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

// 8 int32 lanes (AVX2; vpdpbusd from AVX-VNNI or, in the avx512 tier, AVX512-VNNI's VL form).
struct I8 {
  static constexpr int L = 8;
  using I = __m256i;
  using F = __m256;
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const I*>(p)); }
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
  static F fzero() { return _mm256_setzero_ps(); }
  static F fset1(float v) { return _mm256_set1_ps(v); }
  static F halves(const uint8_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static void storef(F v, float* p) { _mm256_storeu_ps(p, v); }
};

#if defined(PAGEDSERVE_AVX512)
// 16 int32 lanes (AVX512BW; vpdpbusd from AVX512-VNNI).
struct I16 {
  static constexpr int L = 16;
  using I = __m512i;
  using F = __m512;
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
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
  static F fzero() { return _mm512_setzero_ps(); }
  static F fset1(float v) { return _mm512_set1_ps(v); }
  static F halves(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static void storef(F v, float* p) { _mm512_storeu_ps(p, v); }
};
using IV = I16;
#else
using IV = I8;
#endif

// Output columns [lane0, lane0 + V::L) of one panel for MR rows of x from r0: per block, the
// codes of all lanes against 4 broadcast activation codes at a time, then one scaling.
template <class V, int64_t TYPE, int MR, typename T>
inline void panel_tile(const QuantX& qx, int64_t r0, const uint8_t* panel, int64_t lane0,
                       T* out, int64_t ldo, int64_t cols) {
  constexpr int64_t bb = block_bytes(TYPE), cb = code_bytes(TYPE);
  const int64_t nb = qx.nb;
  typename V::F acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = V::fzero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = panel + b * PR * bb;
    typename V::I ai[MR];
    for (int r = 0; r < MR; ++r) {
      const int32_t s = qx.sum[(r0 + r) * nb + b];
      ai[r] = TYPE == Q4_0 ? V::set1(-8 * s)
              : TYPE == Q8_0 && kVnni ? V::set1(-128 * s) : V::zero();
    }
    if constexpr (TYPE == Q8_0) {
      for (int g = 0; g < 8; ++g) {
        const typename V::I w = V::load(blk + g * 64 + lane0 * 4);
        const typename V::I u = kVnni ? V::flip(w) : V::abs8(w);
        for (int r = 0; r < MR; ++r) {
          const typename V::I xs = V::bcast(qx.q + ((r0 + r) * nb + b) * QK + 4 * g);
          ai[r] = V::dot(ai[r], u, kVnni ? xs : V::sign8(xs, w));
        }
      }
    } else {
      for (int g = 0; g < 4; ++g) {
        const typename V::I raw = V::load(blk + g * 64 + lane0 * 4);
        const typename V::I lo = V::low4(raw), hi = V::high4(raw);
        for (int r = 0; r < MR; ++r) {
          const int8_t* q = qx.q + ((r0 + r) * nb + b) * QK;
          ai[r] = V::dot(ai[r], lo, V::bcast(q + 4 * g));
          ai[r] = V::dot(ai[r], hi, V::bcast(q + 16 + 4 * g));
        }
      }
    }
    const typename V::F dw = V::halves(blk + PR * cb + lane0 * 2);
    for (int r = 0; r < MR; ++r)
      acc[r] = V::fmadd(V::cvt(ai[r]), V::mul(dw, V::fset1(qx.d[(r0 + r) * nb + b])), acc[r]);
    if constexpr (TYPE == Q4_1) {
      const typename V::F mw = V::halves(blk + PR * cb + PR * 2 + lane0 * 2);
      for (int r = 0; r < MR; ++r)
        acc[r] = V::fmadd(mw, V::fset1(qx.s[(r0 + r) * nb + b]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    T* o = out + (r0 + r) * ldo + lane0;
    if constexpr (sizeof(T) == 4) {
      if (cols >= V::L) {
        V::storef(acc[r], reinterpret_cast<float*>(o));
        continue;
      }
    }
    float tmp[V::L];
    V::storef(acc[r], tmp);
    for (int64_t c = 0; c < cols && c < V::L; ++c) store(tmp[c], o + c);
  }
}

template <class V, int64_t TYPE, typename T>
void q8_simd(const QuantX& qx, const uint8_t* w, T* out, int64_t m, int64_t n) {
  constexpr int MR = 4;
  const int64_t nb = qx.nb, panels = (n + PR - 1) / PR, panel_bytes = nb * PR * block_bytes(TYPE);
  // Panels outside (each panel's weights, 9-27 KB for SmolLM2, stay in L1/L2 over all rows of
  // x), rows of x inside in tiles of 4; the quantized x is a quarter of its float32 bytes.
#pragma omp parallel for schedule(static) if (n * nb * (m < 4 ? m : 4) >= (1 << 11))
  for (int64_t p = 0; p < panels; ++p) {
    const uint8_t* panel = w + p * panel_bytes;
    for (int64_t lane0 = 0; lane0 < PR; lane0 += V::L) {
      const int64_t j0 = p * PR + lane0, cols = n - j0;
      if (cols <= 0) break;
      T* o = out + p * PR;
      int64_t r = 0;
      for (; r + MR <= m; r += MR) panel_tile<V, TYPE, MR>(qx, r, panel, lane0, o, n, cols);
      switch (m - r) {
        case 3: panel_tile<V, TYPE, 3>(qx, r, panel, lane0, o, n, cols); break;
        case 2: panel_tile<V, TYPE, 2>(qx, r, panel, lane0, o, n, cols); break;
        case 1: panel_tile<V, TYPE, 1>(qx, r, panel, lane0, o, n, cols); break;
        default: break;
      }
    }
  }
}
#endif

template <typename T>
int q8_linear(const T* x, const uint8_t* w, T* out, int64_t m, int64_t n, int64_t k,
              int64_t type, int64_t generic) {
  if (type != Q4_0 && type != Q4_1 && type != Q8_0) return -1;
  QuantX qx;
  qx.nb = k / QK;
  const int64_t blocks = m * qx.nb;
  qx.q = static_cast<int8_t*>(std::malloc(blocks * QK + 64));
  qx.d = static_cast<float*>(std::malloc(blocks * sizeof(float) + 4));
  qx.s = static_cast<float*>(std::malloc(blocks * sizeof(float) + 4));
  qx.sum = static_cast<int32_t*>(std::malloc(blocks * sizeof(int32_t) + 4));
  int rc = 0;
  if (!qx.q || !qx.d || !qx.s || !qx.sum) {
    rc = -2;
  } else {
    quantize_rows(x, m, k, qx);
#if PAGEDSERVE_SIMD
    if (!generic) {
      switch (type) {
        case Q4_0: q8_simd<IV, Q4_0>(qx, w, out, m, n); break;
        case Q4_1: q8_simd<IV, Q4_1>(qx, w, out, m, n); break;
        default: q8_simd<IV, Q8_0>(qx, w, out, m, n); break;
      }
    }
#else
    generic = 1;
#endif
    if (generic) {
      switch (type) {
        case Q4_0: q8_generic<Q4_0>(qx, w, out, m, n); break;
        case Q4_1: q8_generic<Q4_1>(qx, w, out, m, n); break;
        default: q8_generic<Q8_0>(qx, w, out, m, n); break;
      }
    }
  }
  std::free(qx.q), std::free(qx.d), std::free(qx.s), std::free(qx.sum);
  return rc;
}

}  // namespace

extern "C" {

// x [m, k] contiguous (float32 or bfloat16), w the repacked weights of ``gguf_q8_repack``
// ([ceil(n / 16) * 16, k / 32 blocks] bytes of GGML type ``type``), out [m, n] in x's dtype,
// k a multiple of 32. ``generic``: the portable loop (tests). Returns 0, -1 for an unknown
// type, -2 when the activation buffers cannot be allocated.
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
// GGUF rows w [n, k / 32 blocks] of ``type`` into the panels the int8 kernel reads, out
// [ceil(n / 16) * 16 * k / 32 * block_bytes] bytes (the same layout for every variant).
void gguf_q8_repack(const uint8_t* w, uint8_t* out, int64_t n, int64_t k, int64_t type) {
  repack(w, out, n, k, type);
}
#endif

}  // extern "C"
