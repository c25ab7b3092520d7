// The int8-activation mode of the GGUF products (``--cpu-linear-mode int8``): y[M, N] =
// x[M, K] @ W[N, K]^T with x quantized to 8 bits per block of 32 values and every block's
// product taken in integers, as llama.cpp does on the CPU (its Q8_0 / Q8_1 activation blocks,
// ggml-cpu's vec_dot_q4_0_q8_0 and friends); the exact mode is gguf_gemm.cpp.
//
// Per activation block (32 values x_t): amax = max |x_t|, d = amax * (1 / 127) in float32,
// q_t = round_half_even(x_t * (1 / d)) in [-127, 127] (all zero when d = 0). Per weight block
// (scale dw, for Q4_1 the minimum mw, integer codes c_t: Q8_0 int8, Q4_0 nibble - 8, Q4_1
// nibble) the block contributes
//     (dw * d) * float(sum_t c_t q_t)              (+ mw * (d * float(sum_t q_t)) for Q4_1)
// with the integer sum exact; only the float sum over blocks differs in order between the
// variants. kernels/q8_reference.py computes the same arithmetic in torch.
//
// Built once per tier and, where the tier allows, twice: PAGEDSERVE_Q8_VNNI set (with
// -mavx512vnni in the avx512 tier, -mavxvnni in the avx2 one; kernels/cpu_build.py) names the
// entry points *_vnni and multiplies with vpdpbusd (four byte products summed into an int32 lane
// in one instruction); without it the SIMD loops use vpmaddubsw + vpmaddwd (AVX2 and AVX512BW),
// and the generic build the portable loop. Which one runs is chosen in Python from the CPU's
// flags (kernels/gguf_ops.py), so this object never runs on a CPU without its instructions.
// No STL containers here: the VNNI and plain objects must not share COMDAT template code.
//
// vpdpbusd and vpmaddubsw multiply unsigned by signed bytes, so the weight side is made
// unsigned: Q4 nibbles already are (Q4_0's -8 is folded into a per-lane correction of the
// activation block, -8 * the sum of its 4 codes in the lane); Q8_0 codes get +128 with a
// -128 correction under VNNI, and the sign trick (|c|, q * sign(c)) under maddubs, whose
// int16 pair sums would saturate at 255 * 127 * 2.

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

constexpr int64_t QK = 32;
enum : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };
constexpr int64_t block_bytes(int64_t t) { return t == Q4_0 ? 18 : t == Q4_1 ? 20 : 34; }
constexpr float kInv127 = 1.0f / 127.0f;

inline float half_to_float(const uint8_t* p) {  // IEEE half -> float (little endian)
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
  } else {
    float f = std::ldexp(static_cast<float>(mant), -24);
    std::memcpy(&u, &f, 4);
    u |= sign;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// The quantized activations of one call: row r's block b has codes q[(r * nb + b) * 32 ..],
// scale d[r * nb + b], d * sum(q) in s[..] (Q4_1's minimum term) and, where the weight side
// carries an offset, the per-lane correction -off * (q[4l] + .. + q[4l + 3]) in corr[(..) * 8 + l].
struct QuantX {
  int8_t* q;
  float* d;
  float* s;
  int32_t* corr;
  int64_t nb;
};

template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, int32_t off, QuantX& qx) {
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
    // 127 / amax, a different rounding than the reference's (one per block, no cost).
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
    qx.s[i] = d * static_cast<float>(sum);
    for (int l = 0; l < 8; ++l)
      qx.corr[i * 8 + l] = -off * (q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3]);
  }
}

// The portable loop: the reference arithmetic, blocks summed in order.
template <int64_t TYPE, typename T>
void q8_generic(const QuantX& qx, const uint8_t* w, T* out, int64_t m, int64_t n) {
  const int64_t nb = qx.nb, row_bytes = nb * block_bytes(TYPE);
#pragma omp parallel for schedule(static) if (n * nb >= (1 << 11))
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t i = 0; i < m; ++i) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + j * row_bytes + b * block_bytes(TYPE);
        const int8_t* q = qx.q + (i * nb + b) * QK;
        const float dw = half_to_float(blk);
        int32_t isum = 0;
        if constexpr (TYPE == Q8_0) {
          const int8_t* c = reinterpret_cast<const int8_t*>(blk + 2);
          for (int t = 0; t < QK; ++t) isum += c[t] * q[t];
        } else {
          const uint8_t* c = blk + (TYPE == Q4_1 ? 4 : 2);
          const int bias = TYPE == Q4_0 ? 8 : 0;
          for (int t = 0; t < 16; ++t)
            isum += ((c[t] & 15) - bias) * q[t] + ((c[t] >> 4) - bias) * q[t + 16];
        }
        acc += (dw * qx.d[i * nb + b]) * static_cast<float>(isum);
        if constexpr (TYPE == Q4_1) acc += half_to_float(blk + 2) * qx.s[i * nb + b];
      }
      store(acc, out + i * n + j);
    }
  }
}

#if PAGEDSERVE_SIMD
// Four byte products per int32 lane added to acc: u unsigned, s signed bytes.
inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
#if defined(PAGEDSERVE_Q8_VNNI) && defined(__AVX512VNNI__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(PAGEDSERVE_Q8_VNNI)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                 _mm256_set1_epi16(1)));
#endif
}

#if defined(PAGEDSERVE_Q8_VNNI)
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

// Whether the activation side carries a correction for this weight type (see the top).
constexpr bool has_corr(int64_t type) { return type == Q4_0 || (type == Q8_0 && kVnni); }
constexpr int32_t corr_offset(int64_t type) { return type == Q4_0 ? 8 : type == Q8_0 ? 128 : 0; }

// A weight block's 32 codes in the register form dot() takes (weight j in byte j).
template <int64_t TYPE>
inline __m256i weight_bytes(const uint8_t* blk) {
  if constexpr (TYPE == Q8_0) {
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    return kVnni ? _mm256_xor_si256(c, _mm256_set1_epi8(static_cast<char>(0x80))) : c;
  } else {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (TYPE == Q4_1 ? 4 : 2)));
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
    return _mm256_and_si256(both, _mm256_set1_epi8(15));
  }
}

// Integer block product as int32 lanes (lane sum = the exact block sum).
template <int64_t TYPE>
inline __m256i block_dot(__m256i wb, const int8_t* q, const int32_t* corr) {
  const __m256i s = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  const __m256i init = has_corr(TYPE)
      ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(corr)) : _mm256_setzero_si256();
  if constexpr (TYPE == Q8_0 && !kVnni)
    return dot4(init, _mm256_sign_epi8(wb, wb), _mm256_sign_epi8(s, wb));
  return dot4(init, wb, s);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Up to 4 rows of x against each weight row: the weight block is unpacked once for all rows;
// reading the weights is the cost here (one pass over them per call).
template <int64_t TYPE, int MR, typename T>
void q8_gemv(const QuantX& qx, const uint8_t* w, T* out, int64_t n) {
  const int64_t nb = qx.nb, row_bytes = nb * block_bytes(TYPE);
#pragma omp parallel for schedule(static) if (n * nb >= (1 << 11))
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* row = w + j * row_bytes;
    __m256 acc[MR];
    float macc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps(), macc[r] = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * block_bytes(TYPE);
      const __m256i wb = weight_bytes<TYPE>(blk);
      const float dw = half_to_float(blk);
      for (int r = 0; r < MR; ++r) {
        const int64_t i = r * nb + b;
        const __m256i v = block_dot<TYPE>(wb, qx.q + i * QK, qx.corr + i * 8);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(dw * qx.d[i]), acc[r]);
        if constexpr (TYPE == Q4_1) macc[r] += half_to_float(blk + 2) * qx.s[i];
      }
    }
    for (int r = 0; r < MR; ++r) store(hsum(acc[r]) + macc[r], out + r * n + j);
  }
}

// A panel of NR weight rows unpacked once (32 bytes and the scales per block) and reused over
// a chunk of x rows in MR x NR register tiles.
struct Panel {
  __m256i* wb;  // [NR][nb]
  float* dw;    // [NR][nb]
  float* mw;    // [NR][nb] (Q4_1)
};

template <int64_t TYPE, int MR, int NR, typename T>
inline void q8_tile(const QuantX& qx, int64_t r0, const Panel& p, T* out, int64_t ldo) {
  const int64_t nb = qx.nb;
  __m256 acc[MR][NR];
  float macc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = _mm256_setzero_ps(), macc[r][c] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    for (int r = 0; r < MR; ++r) {
      const int64_t i = (r0 + r) * nb + b;
      const __m256 dx = _mm256_set1_ps(qx.d[i]);
      for (int c = 0; c < NR; ++c) {
        const __m256i v = block_dot<TYPE>(p.wb[c * nb + b], qx.q + i * QK, qx.corr + i * 8);
        const __m256 sv = _mm256_mul_ps(_mm256_cvtepi32_ps(v), dx);
        acc[r][c] = _mm256_fmadd_ps(sv, _mm256_set1_ps(p.dw[c * nb + b]), acc[r][c]);
        if constexpr (TYPE == Q4_1) macc[r][c] += p.mw[c * nb + b] * qx.s[i];
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) store(hsum(acc[r][c]) + macc[r][c], out + r * ldo + c);
}

template <int64_t TYPE, int NR, typename T>
inline void q8_tile_rows(const QuantX& qx, int64_t r0, int64_t rows, const Panel& p, T* out,
                         int64_t ldo) {
  constexpr int TM = 2;  // 8 accumulators + 4 weight registers of AVX2's 16
  int64_t r = 0;
  for (; r + TM <= rows; r += TM) q8_tile<TYPE, TM, NR>(qx, r0 + r, p, out + r * ldo, ldo);
  if (r < rows) q8_tile<TYPE, 1, NR>(qx, r0 + r, p, out + r * ldo, ldo);
}

template <int64_t TYPE, typename T>
void q8_gemm(const QuantX& qx, const uint8_t* w, T* out, int64_t m, int64_t n) {
  constexpr int64_t NR = 4, MC = 64;
  const int64_t nb = qx.nb, row_bytes = nb * block_bytes(TYPE), n_tiles = (n + NR - 1) / NR;
#pragma omp parallel
  {
    Panel p;
    p.wb = static_cast<__m256i*>(std::aligned_alloc(32, NR * nb * sizeof(__m256i)));
    p.dw = static_cast<float*>(std::malloc(NR * nb * sizeof(float)));
    p.mw = static_cast<float*>(std::malloc(NR * nb * sizeof(float)));
    // Weight tiles outside, x chunks inside: each panel is unpacked once per call; the whole
    // of the quantized x (a quarter of its float32 bytes) is reread from L2 per panel.
#pragma omp for schedule(static)
    for (int64_t tj = 0; tj < n_tiles; ++tj) {
      const int64_t j0 = tj * NR, cols = n - j0 < NR ? n - j0 : NR;
      for (int64_t c = 0; c < cols; ++c)
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* blk = w + (j0 + c) * row_bytes + b * block_bytes(TYPE);
          p.wb[c * nb + b] = weight_bytes<TYPE>(blk);
          p.dw[c * nb + b] = half_to_float(blk);
          p.mw[c * nb + b] = TYPE == Q4_1 ? half_to_float(blk + 2) : 0.f;
        }
      for (int64_t m0 = 0; m0 < m; m0 += MC) {
        const int64_t rows = m - m0 < MC ? m - m0 : MC;
        T* o = out + m0 * n + j0;
        switch (cols) {
          case 4: q8_tile_rows<TYPE, 4>(qx, m0, rows, p, o, n); break;
          case 3: q8_tile_rows<TYPE, 3>(qx, m0, rows, p, o, n); break;
          case 2: q8_tile_rows<TYPE, 2>(qx, m0, rows, p, o, n); break;
          default: q8_tile_rows<TYPE, 1>(qx, m0, rows, p, o, n); break;
        }
      }
    }
    std::free(p.wb);
    std::free(p.dw);
    std::free(p.mw);
  }
}

template <int64_t TYPE, typename T>
void q8_simd(const QuantX& qx, const uint8_t* w, T* out, int64_t m, int64_t n) {
  switch (m) {
    case 1: q8_gemv<TYPE, 1>(qx, w, out, n); return;
    case 2: q8_gemv<TYPE, 2>(qx, w, out, n); return;
    case 3: q8_gemv<TYPE, 3>(qx, w, out, n); return;
    case 4: q8_gemv<TYPE, 4>(qx, w, out, n); return;
    default: q8_gemm<TYPE>(qx, w, out, m, n);
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
  qx.q = static_cast<int8_t*>(std::malloc(blocks * QK + 32));
  qx.d = static_cast<float*>(std::malloc(blocks * sizeof(float) + 4));
  qx.s = static_cast<float*>(std::malloc(blocks * sizeof(float) + 4));
  qx.corr = static_cast<int32_t*>(std::malloc(blocks * 8 * sizeof(int32_t) + 32));
  if (!qx.q || !qx.d || !qx.s || !qx.corr) {
    std::free(qx.q), std::free(qx.d), std::free(qx.s), std::free(qx.corr);
    return -2;
  }
#if PAGEDSERVE_SIMD
  const int32_t off = generic ? 0 : has_corr(type) ? corr_offset(type) : 0;
#else
  const int32_t off = 0;
#endif
  quantize_rows(x, m, k, off, qx);
#if PAGEDSERVE_SIMD
  if (!generic) {
    switch (type) {
      case Q4_0: q8_simd<Q4_0>(qx, w, out, m, n); break;
      case Q4_1: q8_simd<Q4_1>(qx, w, out, m, n); break;
      default: q8_simd<Q8_0>(qx, w, out, m, n); break;
    }
  }
#endif
  if (generic || !PAGEDSERVE_SIMD) {
    switch (type) {
      case Q4_0: q8_generic<Q4_0>(qx, w, out, m, n); break;
      case Q4_1: q8_generic<Q4_1>(qx, w, out, m, n); break;
      default: q8_generic<Q8_0>(qx, w, out, m, n); break;
    }
  }
  std::free(qx.q), std::free(qx.d), std::free(qx.s), std::free(qx.corr);
  return 0;
}

}  // namespace

extern "C" {

// x [m, k] contiguous (float32 or bfloat16), w [n, k / 32 blocks] of GGML type ``type``,
// out [m, n] in x's dtype, k a multiple of 32. ``generic``: the portable loop (tests). Returns
// 0, -1 for an unknown type, -2 when the activation buffers cannot be allocated.
int Q8_ENTRY(gguf_q8_linear_f32)(const float* x, const uint8_t* w, float* out, int64_t m,
                                 int64_t n, int64_t k, int64_t type, int64_t generic) {
  return q8_linear(x, w, out, m, n, k, type, generic);
}

int Q8_ENTRY(gguf_q8_linear_bf16)(const uint16_t* x, const uint8_t* w, uint16_t* out,
                                  int64_t m, int64_t n, int64_t k, int64_t type,
                                  int64_t generic) {
  return q8_linear(x, w, out, m, n, k, type, generic);
}

}  // extern "C"
