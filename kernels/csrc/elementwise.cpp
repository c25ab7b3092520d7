// The elementwise ops torch would run as several passes, one pass each: RMSNorm (+ residual
// add), SiLU-and-mul, RoPE, and the KV write (reshape_and_cache). Everything computes in
// float32 and rounds once to the tensor's dtype; vector loops of Vec::W lanes (simd.h) with a
// scalar tail, or the portable loops in the generic build. Ideas after vLLM's CPU backend
// (csrc/cpu/layernorm.cpp, activation.cpp, pos_encoding.cpp, cache.cpp).

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "convert.h"
#include "kv_quant.h"
#include "simd.h"

namespace {

// Below this many elements an elementwise op runs on the calling thread: waking the other
// OpenMP threads costs more than the work (a decode step's norms are 1-32 rows).
constexpr int64_t kParallelMin = 64 * 1024;

// key/value [T, token_elems] rows (row stride key_stride / value_stride elements) copied to
// their cache slots, as vLLM's reshape_and_cache; slot -1 (padding) is skipped. kv_kind 0:
// caches in T; else 8-bit caches, each head_size row quantized (kv_quant.h).
template <typename T>
void reshape_and_cache(const T* key, const T* value, void* key_cache, void* value_cache,
                       const int64_t* slot_mapping, int64_t num_tokens, int64_t token_elems,
                       int64_t key_stride, int64_t value_stride, int64_t head_size,
                       int64_t kv_kind) {
  if (kv_kind != kKvNative) {
    const int64_t heads = token_elems / head_size, row = head_size + kScaleBytes;
    auto* kc = static_cast<uint8_t*>(key_cache);
    auto* vc = static_cast<uint8_t*>(value_cache);
    for (int64_t t = 0; t < num_tokens; ++t) {
      const int64_t slot = slot_mapping[t];
      if (slot < 0) continue;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t dst = (slot * heads + h) * row;
        quantize_row(key + t * key_stride + h * head_size, kc + dst, head_size, kv_kind);
        quantize_row(value + t * value_stride + h * head_size, vc + dst, head_size, kv_kind);
      }
    }
    return;
  }
  T* kc = static_cast<T*>(key_cache);
  T* vc = static_cast<T*>(value_cache);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slot_mapping[t];
    if (slot < 0) continue;
    std::memcpy(kc + slot * token_elems, key + t * key_stride, token_elems * sizeof(T));
    std::memcpy(vc + slot * token_elems, value + t * value_stride, token_elems * sizeof(T));
  }
}

// h = x (+ res, stored rounded into res and read back: the unfused model sees the rounded
// sum); returns sum(h^2).
template <typename T>
float gather_row(const T* x, T* res, float* h, int64_t dim) {
  int64_t i = 0;
  float ss = 0.f;
#if PAGEDSERVE_SIMD
  using V = Vec;
  typename V::F acc = V::zero();
  for (; i + V::W <= dim; i += V::W) {
    typename V::F v = V::load(x + i);
    if (res != nullptr) {
      V::store(V::add(v, V::load(res + i)), res + i);
      v = V::load(res + i);
    }
    V::store(v, h + i);
    acc = V::fmadd(v, v, acc);
  }
  ss = V::reduce_add(acc);
#endif
  for (; i < dim; ++i) {
    if (res != nullptr) store(load(x[i]) + load(res[i]), res + i);
    h[i] = res != nullptr ? load(res[i]) : load(x[i]);
    ss += h[i] * h[i];
  }
  return ss;
}

// out = x * rsqrt(mean(x^2) + eps) * weight per row, in float32; with a residual, first
// residual += x and normalise that (vLLM's fused_add_rms_norm). out may alias x.
template <typename T>
void rms_norm(T* out, T* x, T* residual, const T* weight, int64_t rows, int64_t dim,
              int64_t x_stride, float eps) {
#pragma omp parallel if (rows * dim >= kParallelMin)
  {
    std::vector<float> h(dim);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      T* res = residual != nullptr ? residual + r * dim : nullptr;
      const float ss = gather_row(x + r * x_stride, res, h.data(), dim);
      const float inv = 1.f / std::sqrt(ss / dim + eps);
      T* o = out + r * dim;
      int64_t i = 0;
#if PAGEDSERVE_SIMD
      for (; i + Vec::W <= dim; i += Vec::W) {
        const Vec::F scaled = Vec::mul(Vec::load(h.data() + i), Vec::set1(inv));
        Vec::store(Vec::mul(scaled, Vec::load(weight + i)), o + i);
      }
#endif
      for (; i < dim; ++i) store(h[i] * inv * load(weight[i]), o + i);
    }
  }
}

// out[t, i] = silu(x[t, i]) * x[t, inter + i], x: [rows, 2 * inter] (vLLM's silu_and_mul).
template <typename T>
void silu_and_mul(T* out, const T* x, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows * inter >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = x + r * 2 * inter;
    const T* up = gate + inter;
    T* o = out + r * inter;
    int64_t i = 0;
#if PAGEDSERVE_SIMD
    using V = Vec;
    for (; i + V::W <= inter; i += V::W) {
      const typename V::F g = V::load(gate + i);
      const typename V::F e = vexp<V>(V::min(V::sub(V::zero(), g), V::set1(80.f)));  // no inf
      V::store(V::mul(V::div(g, V::add(V::set1(1.f), e)), V::load(up + i)), o + i);
    }
#endif
    for (; i < inter; ++i) {
      const float g = load(gate[i]);
      store(g / (1.f + std::exp(std::min(-g, 80.f))) * load(up[i]), o + i);
    }
  }
}

// One head of RoPE in place, h its float32 copy: x_i = h_i c_i + h_{(i + D/2) % D} s_i.
template <typename T>
inline void rotate_head(T* xh, const float* h, const float* c, const float* s, int64_t half) {
  int64_t i = 0;
#if PAGEDSERVE_SIMD
  using V = Vec;
  for (; i + V::W <= half; i += V::W) {
    const typename V::F a = V::load(h + i), b = V::load(h + i + half);
    V::store(V::fmadd(b, V::load(s + i), V::mul(a, V::load(c + i))), xh + i);
    V::store(V::fmadd(a, V::load(s + i + half), V::mul(b, V::load(c + i + half))), xh + i + half);
  }
#endif
  for (; i < half; ++i) {
    store(h[i] * c[i] + h[i + half] * s[i], xh + i);
    store(h[i + half] * c[i + half] + h[i] * s[i + half], xh + i + half);
  }
}

// Non-interleaved RoPE in place on the first num_heads heads of each row of x (q then k in
// a fused qkv row), with rotate_half's sign folded into the first half of sin
// (gpu/models/llama.py's table). Only the first rotary_dim elements of each head turn
// (partial rotary: Phi-4-mini's 96 of 128); the rest pass unchanged. cos/sin: [P, rotary_dim]
// float32.
template <typename T>
void rotary(T* x, const int64_t* positions, const float* cos, const float* sin, int64_t rows,
            int64_t num_heads, int64_t head_size, int64_t rotary_dim, int64_t row_stride) {
#pragma omp parallel if (rows * num_heads * rotary_dim >= kParallelMin)
  {
    std::vector<float> h(rotary_dim);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const float* c = cos + positions[r] * rotary_dim;
      const float* s = sin + positions[r] * rotary_dim;
      for (int64_t head = 0; head < num_heads; ++head) {
        T* xh = x + r * row_stride + head * head_size;
        widen(xh, h.data(), rotary_dim);
        rotate_head(xh, h.data(), c, s, rotary_dim / 2);
      }
    }
  }
}

}  // namespace

extern "C" {

#define PAGEDSERVE_ELEMENTWISE(SUFFIX, T)                                                       \
  void rms_norm_##SUFFIX(T* out, T* x, T* residual, const T* weight, int64_t rows,             \
                         int64_t dim, int64_t x_stride, float eps) {                           \
    rms_norm(out, x, residual, weight, rows, dim, x_stride, eps);                              \
  }                                                                                             \
  void silu_and_mul_##SUFFIX(T* out, const T* x, int64_t rows, int64_t inter) {                \
    silu_and_mul(out, x, rows, inter);                                                          \
  }                                                                                             \
  void reshape_and_cache_##SUFFIX(const T* k, const T* v, void* kc, void* vc,                 \
                                 const int64_t* slots, int64_t n, int64_t elems, int64_t ks,   \
                                 int64_t vs, int64_t head_size, int64_t kv_kind) {             \
    reshape_and_cache(k, v, kc, vc, slots, n, elems, ks, vs, head_size, kv_kind);               \
  }                                                                                             \
  void rotary_##SUFFIX(T* x, const int64_t* positions, const float* cos, const float* sin,     \
                       int64_t rows, int64_t num_heads, int64_t head_size, int64_t rotary_dim,  \
                       int64_t row_stride) {                                                    \
    rotary(x, positions, cos, sin, rows, num_heads, head_size, rotary_dim, row_stride);         \
  }

PAGEDSERVE_ELEMENTWISE(f32, float)
PAGEDSERVE_ELEMENTWISE(bf16, uint16_t)

}  // extern "C"
