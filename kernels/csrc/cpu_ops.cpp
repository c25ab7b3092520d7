// Paged decode attention for the CPU: one query token per sequence against its whole context,
// read in place through the block table (no gather copy), softmax in float32.
//
// Plain C ABI over raw pointers, called through ctypes (kernels/cpu_attention.py): no torch
// headers, so it compiles in about a second. OpenMP threads over (sequence, kv head) pairs;
// the library resolves to the libgomp torch already loaded, so it shares torch's thread count.
// Idea after vLLM's CPU backend (csrc/cpu/attention.cpp): one pass for the scores of the
// query heads that share a kv head (GQA), then one pass over V.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

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

template <typename T>
void decode(const T* query, const T* key_cache, const T* value_cache, const int32_t* block_table,
            const int32_t* seq_lens, T* out, int64_t num_seqs, int64_t num_heads,
            int64_t num_kv_heads, int64_t head_size, int64_t block_size,
            int64_t block_table_stride, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_size;  // elements between a block's slots
  const int64_t block_stride = block_size * token_stride;
#pragma omp parallel
  {
    std::vector<float> q(group * head_size), row(head_size), acc(group * head_size), scores;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_seqs * num_kv_heads; ++task) {
      const int64_t seq = task / num_kv_heads, kvh = task % num_kv_heads;
      const int64_t len = seq_lens[seq];
      const int32_t* blocks = block_table + seq * block_table_stride;
      const T* q_src = query + (seq * num_heads + kvh * group) * head_size;
      for (int64_t i = 0; i < group * head_size; ++i) q[i] = load(q_src[i]) * scale;
      scores.resize(group * len);
      // Pass 1: scores[g][t] = q_g . k_t (scale folded into q).
      for (int64_t t = 0; t < len; ++t) {
        const T* k = key_cache + blocks[t / block_size] * block_stride +
                     (t % block_size) * token_stride + kvh * head_size;
#pragma omp simd
        for (int64_t d = 0; d < head_size; ++d) row[d] = load(k[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = q.data() + g * head_size;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < head_size; ++d) s += qg[d] * row[d];
          scores[g * len + t] = s;
        }
      }
      // Softmax per query head, in place; the normaliser is applied to the output.
      std::vector<float> inv_sum(group);
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * len;
        const float m = *std::max_element(sg, sg + len);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
          // Clamped so exp stays a normal float: subnormal results take slow microcode paths
          // (the library must not turn on flush-to-zero for the process); e^-80 is nothing
          // beside the maximum's e^0.
          sg[t] = std::exp(std::max(sg[t] - m, -80.f));
          sum += sg[t];
        }
        inv_sum[g] = 1.f / sum;
      }
      // Pass 2: acc[g] = sum_t p[g][t] * v_t.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const T* v = value_cache + blocks[t / block_size] * block_stride +
                     (t % block_size) * token_stride + kvh * head_size;
#pragma omp simd
        for (int64_t d = 0; d < head_size; ++d) row[d] = load(v[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* ag = acc.data() + g * head_size;
#pragma omp simd
          for (int64_t d = 0; d < head_size; ++d) ag[d] += p * row[d];
        }
      }
      T* dst = out + (seq * num_heads + kvh * group) * head_size;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_size; ++d)
          store(acc[g * head_size + d] * inv_sum[g], dst + g * head_size + d);
    }
  }
}

// out = x * rsqrt(mean(x^2) + eps) * weight per row, in float32; with a residual, first
// residual += x and normalise that (vLLM's fused_add_rms_norm). out may alias x.
template <typename T>
void rms_norm(T* out, T* x, T* residual, const T* weight, int64_t rows, int64_t dim,
              int64_t x_stride, float eps) {
#pragma omp parallel
  {
    std::vector<float> h(dim);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      T* xr = x + r * x_stride;
      float ss = 0.f;
      if (residual != nullptr) {
        T* res = residual + r * dim;
        for (int64_t i = 0; i < dim; ++i) {
          store(load(xr[i]) + load(res[i]), res + i);
          h[i] = load(res[i]);  // the stored (rounded) sum, as the unfused model sees it
        }
      } else {
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) h[i] = load(xr[i]);
      }
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < dim; ++i) ss += h[i] * h[i];
      const float inv = 1.f / std::sqrt(ss / dim + eps);
      T* o = out + r * dim;
      for (int64_t i = 0; i < dim; ++i) store(h[i] * inv * load(weight[i]), o + i);
    }
  }
}

// out[t, i] = silu(x[t, i]) * x[t, inter + i], x: [rows, 2 * inter] (vLLM's silu_and_mul).
template <typename T>
void silu_and_mul(T* out, const T* x, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = x + r * 2 * inter;
    const T* up = gate + inter;
    T* o = out + r * inter;
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i) {
      const float g = load(gate[i]);
      store(g / (1.f + std::exp(std::min(-g, 80.f))) * load(up[i]), o + i);  // no inf
    }
  }
}

// Non-interleaved RoPE in place on the first num_heads heads of each row of x (q then k in
// a fused qkv row): x_i = x_i * cos_i + x_{(i + D/2) % D} * sin_i, with rotate_half's sign
// folded into the first half of sin (gpu/models/llama.py's table). cos/sin: [P, D] float32.
template <typename T>
void rotary(T* x, const int64_t* positions, const float* cos, const float* sin, int64_t rows,
            int64_t num_heads, int64_t head_size, int64_t row_stride) {
  const int64_t half = head_size / 2;
#pragma omp parallel
  {
    std::vector<float> h(head_size);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const float* c = cos + positions[r] * head_size;
      const float* s = sin + positions[r] * head_size;
      for (int64_t head = 0; head < num_heads; ++head) {
        T* xh = x + r * row_stride + head * head_size;
        for (int64_t i = 0; i < head_size; ++i) h[i] = load(xh[i]);
        for (int64_t i = 0; i < half; ++i) {
          store(h[i] * c[i] + h[i + half] * s[i], xh + i);
          store(h[i + half] * c[i + half] + h[i] * s[i + half], xh + i + half);
        }
      }
    }
  }
}

}  // namespace

extern "C" {

// All tensors contiguous: query/out [num_seqs, num_heads, head_size]; caches [num_blocks,
// block_size, num_kv_heads, head_size]; block_table [num_seqs, block_table_stride] int32;
// seq_lens [num_seqs] int32, each >= 1.
void paged_decode_attention_f32(const float* q, const float* kc, const float* vc,
                                const int32_t* bt, const int32_t* sl, float* out, int64_t n,
                                int64_t h, int64_t hkv, int64_t d, int64_t bs, int64_t bts,
                                float scale) {
  decode(q, kc, vc, bt, sl, out, n, h, hkv, d, bs, bts, scale);
}

void paged_decode_attention_bf16(const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                                 const int32_t* bt, const int32_t* sl, uint16_t* out, int64_t n,
                                 int64_t h, int64_t hkv, int64_t d, int64_t bs, int64_t bts,
                                 float scale) {
  decode(q, kc, vc, bt, sl, out, n, h, hkv, d, bs, bts, scale);
}

#define PAGEDSERVE_ELEMENTWISE(SUFFIX, T)                                                       \
  void rms_norm_##SUFFIX(T* out, T* x, T* residual, const T* weight, int64_t rows,             \
                         int64_t dim, int64_t x_stride, float eps) {                           \
    rms_norm(out, x, residual, weight, rows, dim, x_stride, eps);                              \
  }                                                                                             \
  void silu_and_mul_##SUFFIX(T* out, const T* x, int64_t rows, int64_t inter) {                \
    silu_and_mul(out, x, rows, inter);                                                          \
  }                                                                                             \
  void rotary_##SUFFIX(T* x, const int64_t* positions, const float* cos, const float* sin,     \
                       int64_t rows, int64_t num_heads, int64_t head_size, int64_t row_stride) { \
    rotary(x, positions, cos, sin, rows, num_heads, head_size, row_stride);                     \
  }

PAGEDSERVE_ELEMENTWISE(f32, float)
PAGEDSERVE_ELEMENTWISE(bf16, uint16_t)

}  // extern "C"
