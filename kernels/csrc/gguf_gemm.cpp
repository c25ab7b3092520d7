// y[M, N] = x[M, K] @ W[N, K]^T with W kept in GGUF's quantized blocks (Q4_0, Q4_1, Q8_0: 32
// weights per block, an fp16 scale, for Q4_1 an fp16 minimum), the layout llama.cpp writes
// (ggml-common.h). A decode step on a CPU is bound by reading the weights: SmolLM2-135M's
// Q4_1/Q8_0 file is 96 MB per step against 270 MB de-quantized to bfloat16.
//
// Each weight is de-quantized exactly (d*q and d*q+m are exact or singly rounded in float32, as
// gguf-py and transformers compute them) and multiplied in float32, so results equal a float32
// matmul over the de-quantized matrix up to summation order. Activations stay float32 (or
// bfloat16 in and out); llama.cpp instead quantizes them to 8 bits, which we do not, to keep
// greedy output equal to transformers' on the same file.
//
// Two loops: for up to 8 rows of x, blocks are de-quantized into registers and used at once;
// for more, 4 weight rows are de-quantized into a float32 panel that a 4x4 register tile of
// dot products reuses over 64 rows of x at a time. The idea is vLLM's GGUF path
// (csrc/quantization/gguf/: a mat-vec kernel for small batches, de-quantize then matmul above).

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "convert.h"

namespace {

constexpr int64_t QK = 32;                                // weights per block
enum : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };          // GGML type ids
constexpr int64_t block_bytes(int64_t t) { return t == Q4_0 ? 18 : t == Q4_1 ? 20 : 34; }

inline float fp16(const uint8_t* p) {  // IEEE half -> float (little endian)
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);  // one instruction; the bit arithmetic below was a third of a block's
#endif
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
}

// One block's 32 weights as floats (scalar; the generic path and the reference for the SIMD).
inline void dequant_block(int64_t type, const uint8_t* b, float* dst) {
  const float d = fp16(b);
  if (type == Q8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < 32; ++j) dst[j] = d * static_cast<float>(q[j]);
    return;
  }
  const float m = type == Q4_1 ? fp16(b + 2) : -8.f * d;
  const uint8_t* q = b + (type == Q4_1 ? 4 : 2);
  for (int j = 0; j < 16; ++j) {
    // Q4_0's d*(q-8) as d*q + (-8d): both products exact, so the same float.
    dst[j] = std::fma(d, static_cast<float>(q[j] & 0xf), m);
    dst[j + 16] = std::fma(d, static_cast<float>(q[j] >> 4), m);
  }
}

void dequant_row(int64_t type, const uint8_t* row, int64_t k, float* dst) {
  const int64_t bb = block_bytes(type);
  for (int64_t i = 0; i < k / QK; ++i) dequant_block(type, row + i * bb, dst + i * QK);
}

// x rows as float32: the caller's buffer when it already is, else a converted copy.
template <typename T>
const float* as_f32(const T* x, int64_t n, std::vector<float>& buf) {
  if constexpr (sizeof(T) == 4) {
    return reinterpret_cast<const float*>(x);
  } else {
    buf.resize(n);
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(buf.data() + i, load16(x + i));
#endif
    for (; i < n; ++i) buf[i] = load(x[i]);
    return buf.data();
  }
}

template <typename T>
void gemm_generic(const float* x, const uint8_t* w, T* out, int64_t m, int64_t n, int64_t k,
                  int64_t type) {
  const int64_t row_bytes = k / QK * block_bytes(type);
#pragma omp parallel
  {
    std::vector<float> wrow(k);
#pragma omp for schedule(static)
    for (int64_t j = 0; j < n; ++j) {
      dequant_row(type, w + j * row_bytes, k, wrow.data());
      for (int64_t i = 0; i < m; ++i) {
        const float* xi = x + i * k;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t t = 0; t < k; ++t) s += xi[t] * wrow[t];
        store(s, out + i * n + j);
      }
    }
  }
}

#if defined(__AVX512F__)
// 32 weights of one block in two registers (lanes 0-15, 16-31).
template <int64_t TYPE>
inline void dequant_block16(const uint8_t* b, __m512& lo, __m512& hi) {
  const __m512 d = _mm512_set1_ps(fp16(b));
  if constexpr (TYPE == Q8_0) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))));
    hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))));
  } else {
    const __m512 m = TYPE == Q4_1 ? _mm512_set1_ps(fp16(b + 2)) : _mm512_mul_ps(d, _mm512_set1_ps(-8.f));
    const __m512i q = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (TYPE == Q4_1 ? 4 : 2))));
    lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(0xf))), d, m);
    hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d, m);
  }
}

// Up to 8 rows of x: each block de-quantized once, in registers, for all rows.
template <int64_t TYPE, int MR, typename T>
void gemv(const float* x, const uint8_t* w, T* out, int64_t n, int64_t k) {
  constexpr int64_t bb = block_bytes(TYPE);
  const int64_t nb = k / QK, row_bytes = nb * bb;
#pragma omp parallel for schedule(static) if (n * k >= (1 << 16))
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* row = w + j * row_bytes;
    __m512 acc_lo[MR], acc_hi[MR];  // two chains per row: half the FMA latency stalls
    for (int r = 0; r < MR; ++r) acc_lo[r] = acc_hi[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m512 lo, hi;
      dequant_block16<TYPE>(row + b * bb, lo, hi);
      for (int r = 0; r < MR; ++r) {
        acc_lo[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + r * k + b * QK), acc_lo[r]);
        acc_hi[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + r * k + b * QK + 16), acc_hi[r]);
      }
    }
    for (int r = 0; r < MR; ++r)
      store(_mm512_reduce_add_ps(_mm512_add_ps(acc_lo[r], acc_hi[r])), out + r * n + j);
  }
}

// out[r][c] for r < MR rows of x, c < NR rows of the panel, over k (a multiple of 16).
template <int MR, int NR, typename T>
inline void tile(const float* x, int64_t ldx, const float* panel, int64_t k, T* out,
                 int64_t ldo) {
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < k; t += 16) {
    __m512 wv[NR];
    for (int c = 0; c < NR; ++c) wv[c] = _mm512_loadu_ps(panel + c * k + t);
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * ldx + t);
      for (int c = 0; c < NR; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) store(_mm512_reduce_add_ps(acc[r][c]), out + r * ldo + c);
}

template <int NR, typename T>
inline void tile_rows(const float* x, int64_t rows, int64_t k, const float* panel, T* out,
                      int64_t ldo) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) tile<4, NR>(x + r * k, k, panel, k, out + r * ldo, ldo);
  switch (rows - r) {
    case 3: tile<3, NR>(x + r * k, k, panel, k, out + r * ldo, ldo); break;
    case 2: tile<2, NR>(x + r * k, k, panel, k, out + r * ldo, ldo); break;
    case 1: tile<1, NR>(x + r * k, k, panel, k, out + r * ldo, ldo); break;
    default: break;
  }
}

template <int64_t TYPE, typename T>
void gemm_panel(const float* x, const uint8_t* w, T* out, int64_t m, int64_t n, int64_t k) {
  constexpr int64_t bb = block_bytes(TYPE), NR = 4, MC = 64;
  const int64_t nb = k / QK, row_bytes = nb * bb, n_tiles = (n + NR - 1) / NR;
  // 64 rows of x (<= 400 KB at k = 1536) stay in L2 while every panel passes over them; each
  // weight is de-quantized once per 64 rows, a few percent of the multiply-adds.
  for (int64_t m0 = 0; m0 < m; m0 += MC) {
    const int64_t rows = m - m0 < MC ? m - m0 : MC;
#pragma omp parallel
    {
      std::vector<float> panel(NR * k);
#pragma omp for schedule(static)
      for (int64_t tj = 0; tj < n_tiles; ++tj) {
        const int64_t j0 = tj * NR, cols = n - j0 < NR ? n - j0 : NR;
        for (int64_t c = 0; c < cols; ++c) {
          const uint8_t* row = w + (j0 + c) * row_bytes;
          for (int64_t b = 0; b < nb; ++b) {
            __m512 lo, hi;
            dequant_block16<TYPE>(row + b * bb, lo, hi);
            _mm512_storeu_ps(panel.data() + c * k + b * QK, lo);
            _mm512_storeu_ps(panel.data() + c * k + b * QK + 16, hi);
          }
        }
        const float* xr = x + m0 * k;
        T* o = out + m0 * n + j0;
        switch (cols) {
          case 4: tile_rows<4>(xr, rows, k, panel.data(), o, n); break;
          case 3: tile_rows<3>(xr, rows, k, panel.data(), o, n); break;
          case 2: tile_rows<2>(xr, rows, k, panel.data(), o, n); break;
          default: tile_rows<1>(xr, rows, k, panel.data(), o, n); break;
        }
      }
    }
  }
}

template <int64_t TYPE, typename T>
void gemm_avx512(const float* x, const uint8_t* w, T* out, int64_t m, int64_t n, int64_t k) {
  switch (m) {
    case 1: gemv<TYPE, 1>(x, w, out, n, k); return;
    case 2: gemv<TYPE, 2>(x, w, out, n, k); return;
    case 3: gemv<TYPE, 3>(x, w, out, n, k); return;
    case 4: gemv<TYPE, 4>(x, w, out, n, k); return;
    case 5: gemv<TYPE, 5>(x, w, out, n, k); return;
    case 6: gemv<TYPE, 6>(x, w, out, n, k); return;
    case 7: gemv<TYPE, 7>(x, w, out, n, k); return;
    case 8: gemv<TYPE, 8>(x, w, out, n, k); return;
    default: gemm_panel<TYPE>(x, w, out, m, n, k);
  }
}
#endif

template <typename T>
void gguf_linear(const T* x_in, const uint8_t* w, T* out, int64_t m, int64_t n, int64_t k,
                 int64_t type, int64_t generic) {
  std::vector<float> buf;
  const float* x = as_f32(x_in, m * k, buf);
#if defined(__AVX512F__)
  if (!generic) {
    switch (type) {
      case Q4_0: gemm_avx512<Q4_0>(x, w, out, m, n, k); return;
      case Q4_1: gemm_avx512<Q4_1>(x, w, out, m, n, k); return;
      case Q8_0: gemm_avx512<Q8_0>(x, w, out, m, n, k); return;
      default: break;
    }
  }
#endif
  gemm_generic(x, w, out, m, n, k, type);
}

}  // namespace

extern "C" {

// x [m, k] contiguous, w [n, k / 32 blocks] of GGML type ``type`` (2, 3 or 8; the caller
// checks), out [m, n] contiguous in x's dtype; k a multiple of 32. ``generic``: skip the SIMD
// loops (tests compare the two).
void gguf_linear_f32(const float* x, const uint8_t* w, float* out, int64_t m, int64_t n,
                     int64_t k, int64_t type, int64_t generic) {
  gguf_linear(x, w, out, m, n, k, type, generic);
}

void gguf_linear_bf16(const uint16_t* x, const uint8_t* w, uint16_t* out, int64_t m,
                      int64_t n, int64_t k, int64_t type, int64_t generic) {
  gguf_linear(x, w, out, m, n, k, type, generic);
}

// De-quantize rows [n, k / 32 blocks] into out [n, k] float32 (loading and tests).
void gguf_dequantize(const uint8_t* w, float* out, int64_t n, int64_t k, int64_t type) {
  const int64_t row_bytes = k / QK * block_bytes(type);
  for (int64_t j = 0; j < n; ++j) dequant_row(type, w + j * row_bytes, k, out + j * k);
}

}  // extern "C"
