// y[M, N] = x[M, K] @ W[N, K]^T with W kept in GGUF's quantized blocks (every type of
// gguf_blocks.h: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS), the layout llama.cpp writes
// (ggml-common.h). A decode step on a CPU is bound by reading the weights: SmolLM2-135M's
// Q4_1/Q8_0 file is 96 MB per step against 270 MB de-quantized to bfloat16.
//
// Each weight is de-quantized exactly (gguf_blocks.h: an exact product and at most one
// rounding, as gguf-py and transformers compute them) and multiplied in float32, so results
// equal a float32
// matmul over the de-quantized matrix up to summation order. Activations stay float32 (or
// bfloat16 in and out); llama.cpp instead quantizes them to 8 bits, which we do not, to keep
// greedy output equal to transformers' on the same file.
//
// Two loops, written once for the AVX2 and AVX-512 variants (simd.h): for up to 8 rows of x,
// blocks are de-quantized into registers (Q4_0 / Q4_1 / Q8_0 with vector code, the other types
// through the scalar decoder into a 32-float buffer) and used at once; for more, 4 weight rows are
// de-quantized into a float32 panel that a register tile of dot products (4x4 with AVX-512,
// 3x4 with AVX2's 16 registers) reuses over 64 rows of x at a time. The generic build keeps
// the portable loops only. The idea is vLLM's GGUF path
// (csrc/quantization/gguf/: a mat-vec kernel for small batches, de-quantize then matmul above).


#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "convert.h"
#include "gguf_blocks.h"
#include "simd.h"

namespace {

void dequant_row(int64_t type, const uint8_t* row, int64_t k, float* dst) {
  for (int64_t i = 0; i < k / QK; ++i) dequant_row_sub(type, row, i, dst + i * QK);
}

// x rows as float32: the caller's buffer when it already is, else a converted copy.
template <typename T>
const float* as_f32(const T* x, int64_t n, std::vector<float>& buf) {
  if constexpr (sizeof(T) == 4) {
    return reinterpret_cast<const float*>(x);
  } else {
    buf.resize(n);
    widen(x, buf.data(), n);
    return buf.data();
  }
}

template <typename T>
void gemm_generic(const float* x, const uint8_t* w, T* out, int64_t m, int64_t n, int64_t k,
                  int64_t type) {
  const int64_t row_bytes = k / block_weights(type) * block_bytes(type);
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

#if PAGEDSERVE_SIMD
// Sub-block i (32 weights) of a row in 32 / V::W registers, exactly as dequant_row_sub computes
// them: Q4_0 / Q4_1 / Q8_0 in registers (a Q4 block's byte j holds weight j in its low nibble,
// j + 16 in its high one), the other types through the scalar decoder.
template <class V, int64_t TYPE>
inline void dequant_vec(const uint8_t* row, int64_t i, typename V::F* w) {
  constexpr int C = QK / V::W;
  if constexpr (TYPE == Q4_0 || TYPE == Q4_1 || TYPE == Q8_0) {
    const uint8_t* b = row + i * block_bytes(TYPE);
    const typename V::F d = V::set1(fp16(b));
    if constexpr (TYPE == Q8_0) {
      for (int c = 0; c < C; ++c) w[c] = V::mul(d, V::int8s(b + 2 + c * V::W));
    } else {
      const typename V::F m = TYPE == Q4_1 ? V::set1(fp16(b + 2)) : V::mul(d, V::set1(-8.f));
      const uint8_t* q = b + (TYPE == Q4_1 ? 4 : 2);
      for (int c = 0; c < C; ++c)
        w[c] = V::fmadd(V::nibbles(q + (c * V::W) % 16, c * V::W >= 16 ? 4 : 0), d, m);
    }
  } else {
    alignas(64) float tmp[QK];
    dequant_row_sub(TYPE, row, i, tmp);
    for (int c = 0; c < C; ++c) w[c] = V::load(tmp + c * V::W);
  }
}

// Up to 8 rows of x: each block de-quantized once, in registers, for all rows. K chains of
// accumulators per row (as many as half the register file allows) hide the FMA latency.
template <class V, int64_t TYPE, int MR, typename T>
void gemv(const float* x, const uint8_t* w, T* out, int64_t n, int64_t k) {
  constexpr int C = QK / V::W, K0 = V::kRegs / 2 / MR, K = K0 < 1 ? 1 : K0 > C ? C : K0;
  const int64_t nb = k / QK, row_bytes = k / block_weights(TYPE) * block_bytes(TYPE);
#pragma omp parallel for schedule(static) if (n * k >= (1 << 16))
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* row = w + j * row_bytes;
    typename V::F acc[MR][K];
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < K; ++c) acc[r][c] = V::zero();
    for (int64_t b = 0; b < nb; ++b) {
      typename V::F wv[C];
      dequant_vec<V, TYPE>(row, b, wv);
      for (int r = 0; r < MR; ++r)
        for (int c = 0; c < C; ++c)
          acc[r][c % K] = V::fmadd(wv[c], V::load(x + r * k + b * QK + c * V::W), acc[r][c % K]);
    }
    for (int r = 0; r < MR; ++r) {
      for (int c = 1; c < K; ++c) acc[r][0] = V::add(acc[r][0], acc[r][c]);
      store(V::reduce_add(acc[r][0]), out + r * n + j);
    }
  }
}

// out[r][c] for r < MR rows of x, c < NR rows of the panel, over k (a multiple of 32).
template <class V, int MR, int NR, typename T>
inline void tile(const float* x, int64_t ldx, const float* panel, int64_t k, T* out,
                 int64_t ldo) {
  typename V::F acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = V::zero();
  for (int64_t t = 0; t < k; t += V::W) {
    typename V::F wv[NR];
    for (int c = 0; c < NR; ++c) wv[c] = V::load(panel + c * k + t);
    for (int r = 0; r < MR; ++r) {
      const typename V::F xv = V::load(x + r * ldx + t);
      for (int c = 0; c < NR; ++c) acc[r][c] = V::fmadd(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) store(V::reduce_add(acc[r][c]), out + r * ldo + c);
}

// Rows of x in tiles of TM: 4 with AVX-512's 32 registers (16 accumulators); 3 with AVX2's 16
// (12 accumulators and the 4 weight vectors, x read as FMA memory operands: 15% faster than 2).
template <class V, int NR, typename T>
inline void tile_rows(const float* x, int64_t rows, int64_t k, const float* panel, T* out,
                      int64_t ldo) {
  constexpr int TM = V::kRegs >= 32 ? 4 : 3;
  int64_t r = 0;
  for (; r + TM <= rows; r += TM) tile<V, TM, NR>(x + r * k, k, panel, k, out + r * ldo, ldo);
  switch (rows - r) {
    case 3: tile<V, 3, NR>(x + r * k, k, panel, k, out + r * ldo, ldo); break;
    case 2: tile<V, 2, NR>(x + r * k, k, panel, k, out + r * ldo, ldo); break;
    case 1: tile<V, 1, NR>(x + r * k, k, panel, k, out + r * ldo, ldo); break;
    default: break;
  }
}

// Up to NR weight rows j0.. de-quantized into a float32 panel [cols, k].
template <class V, int64_t TYPE>
inline void fill_panel(const uint8_t* w, int64_t row_bytes, int64_t j0, int64_t cols,
                       int64_t k, float* panel) {
  for (int64_t c = 0; c < cols; ++c) {
    const uint8_t* row = w + (j0 + c) * row_bytes;
    for (int64_t b = 0; b < k / QK; ++b) {
      typename V::F wv[QK / V::W];
      dequant_vec<V, TYPE>(row, b, wv);
      for (int i = 0; i < QK / V::W; ++i) V::store(wv[i], panel + c * k + b * QK + i * V::W);
    }
  }
}

template <class V, int64_t TYPE, typename T>
void gemm_panel(const float* x, const uint8_t* w, T* out, int64_t m, int64_t n, int64_t k) {
  constexpr int64_t NR = 4, MC = 64;
  const int64_t row_bytes = k / block_weights(TYPE) * block_bytes(TYPE);
  const int64_t n_tiles = (n + NR - 1) / NR;
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
        fill_panel<V, TYPE>(w, row_bytes, j0, cols, k, panel.data());
        const float* xr = x + m0 * k;
        T* o = out + m0 * n + j0;
        switch (cols) {
          case 4: tile_rows<V, 4>(xr, rows, k, panel.data(), o, n); break;
          case 3: tile_rows<V, 3>(xr, rows, k, panel.data(), o, n); break;
          case 2: tile_rows<V, 2>(xr, rows, k, panel.data(), o, n); break;
          default: tile_rows<V, 1>(xr, rows, k, panel.data(), o, n); break;
        }
      }
    }
  }
}

template <class V, int64_t TYPE, typename T>
void gemm_simd(const float* x, const uint8_t* w, T* out, int64_t m, int64_t n, int64_t k) {
  switch (m) {
    case 1: gemv<V, TYPE, 1>(x, w, out, n, k); return;
    case 2: gemv<V, TYPE, 2>(x, w, out, n, k); return;
    case 3: gemv<V, TYPE, 3>(x, w, out, n, k); return;
    case 4: gemv<V, TYPE, 4>(x, w, out, n, k); return;
    case 5: gemv<V, TYPE, 5>(x, w, out, n, k); return;
    case 6: gemv<V, TYPE, 6>(x, w, out, n, k); return;
    case 7: gemv<V, TYPE, 7>(x, w, out, n, k); return;
    case 8: gemv<V, TYPE, 8>(x, w, out, n, k); return;
    default: gemm_panel<V, TYPE>(x, w, out, m, n, k);
  }
}
#endif

template <typename T>
void gguf_linear(const T* x_in, const uint8_t* w, T* out, int64_t m, int64_t n, int64_t k,
                 int64_t type, int64_t generic) {
  std::vector<float> buf;
  const float* x = as_f32(x_in, m * k, buf);
#if PAGEDSERVE_SIMD
  if (!generic) {
    switch (type) {
      case Q4_0: gemm_simd<Vec, Q4_0>(x, w, out, m, n, k); return;
      case Q4_1: gemm_simd<Vec, Q4_1>(x, w, out, m, n, k); return;
      case Q8_0: gemm_simd<Vec, Q8_0>(x, w, out, m, n, k); return;
      case Q5_0: gemm_simd<Vec, Q5_0>(x, w, out, m, n, k); return;
      case Q5_1: gemm_simd<Vec, Q5_1>(x, w, out, m, n, k); return;
      case Q4_K: gemm_simd<Vec, Q4_K>(x, w, out, m, n, k); return;
      case Q5_K: gemm_simd<Vec, Q5_K>(x, w, out, m, n, k); return;
      case Q6_K: gemm_simd<Vec, Q6_K>(x, w, out, m, n, k); return;
      case Q2_K: gemm_simd<Vec, Q2_K>(x, w, out, m, n, k); return;
      case Q3_K: gemm_simd<Vec, Q3_K>(x, w, out, m, n, k); return;
      case IQ4_NL: gemm_simd<Vec, IQ4_NL>(x, w, out, m, n, k); return;
      case IQ4_XS: gemm_simd<Vec, IQ4_XS>(x, w, out, m, n, k); return;
      default: break;
    }
  }
#else
  (void)generic;
#endif
  gemm_generic(x, w, out, m, n, k, type);
}

}  // namespace

extern "C" {

// x [m, k] contiguous, w [n, k / block_weights blocks] of GGML type ``type`` (gguf_blocks.h;
// the caller checks), out [m, n] contiguous in x's dtype; k a multiple of the type's block. ``generic``: skip the SIMD
// loops (tests compare the two).
void gguf_linear_f32(const float* x, const uint8_t* w, float* out, int64_t m, int64_t n,
                     int64_t k, int64_t type, int64_t generic) {
  gguf_linear(x, w, out, m, n, k, type, generic);
}

void gguf_linear_bf16(const uint16_t* x, const uint8_t* w, uint16_t* out, int64_t m,
                      int64_t n, int64_t k, int64_t type, int64_t generic) {
  gguf_linear(x, w, out, m, n, k, type, generic);
}

// De-quantize rows [n, k / block_weights blocks] into out [n, k] float32 (loading and tests).
void gguf_dequantize(const uint8_t* w, float* out, int64_t n, int64_t k, int64_t type) {
  const int64_t row_bytes = k / block_weights(type) * block_bytes(type);
  for (int64_t j = 0; j < n; ++j) dequant_row(type, w + j * row_bytes, k, out + j * k);
}

}  // extern "C"
