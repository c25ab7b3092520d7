// Our CPU kernels: paged decode attention (one query token per sequence against its whole
// context, read in place through the block table, no gather copy; softmax in float32; long
// contexts of few sequences split across threads), flash-style prefill attention, and the
// elementwise ops torch would run as several passes: RMSNorm (+ residual add), SiLU-and-mul,
// RoPE. Everything computes in float32 and rounds once to the tensor's dtype.
//
// Plain C ABI over raw pointers, called through ctypes (kernels/cpu_ops.py): no torch headers,
// so it compiles in about a second. OpenMP threads over sequences / rows; the library resolves
// to the libgomp torch already loaded, so it shares torch's thread count. Ideas after vLLM's
// CPU backend (csrc/cpu/attention.cpp, layernorm.cpp, activation.cpp, pos_encoding.cpp).

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "convert.h"

namespace {

// Each row of rows x len scores becomes exp(s - max(row)) in place (the maxima into ``maxes``
// if given); ``finish`` divides by the row sums.
inline void softmax_rows(float* scores, int64_t rows, int64_t len, float* maxes = nullptr) {
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = scores + r * len;
    const float m = *std::max_element(sr, sr + len);
    if (maxes) maxes[r] = m;
#pragma omp simd
    for (int64_t t = 0; t < len; ++t)
      // Clamped so exp stays a normal float: subnormal results take slow microcode paths
      // (the library must not turn on flush-to-zero for the process); e^-80 is nothing
      // beside the maximum's e^0.
      sr[t] = std::exp(std::max(sr[t] - m, -80.f));
  }
}

// out[h] = acc[h] / sum_t p[h][t], rounded to T.
template <typename T>
void finish(const float* acc, const float* probs, T* dst, int64_t num_heads, int64_t head_size,
            int64_t len) {
  for (int64_t h = 0; h < num_heads; ++h) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) sum += probs[h * len + t];
    const float inv = 1.f / sum;
    for (int64_t d = 0; d < head_size; ++d)
      store(acc[h * head_size + d] * inv, dst + h * head_size + d);
  }
}

#if defined(__AVX512F__)
// The decode loop with 16-lane registers, for head_size % 16 == 0 (every model we serve): a
// K/V row is converted once into registers per kv head, not stored and reloaded.
template <typename T>
void decode_seq_avx512(const float* q, const T* key_cache, const T* value_cache,
                       const int32_t* blocks, int64_t t_begin, int64_t t_end, int64_t num_heads,
                       int64_t group, int64_t num_kv_heads, int64_t head_size,
                       int64_t block_size, float* scores, float* acc, float* maxes) {
  const int64_t nv = head_size / 16, token_stride = num_kv_heads * head_size;
  const int64_t block_stride = block_size * token_stride, len = t_end - t_begin;
  for (int64_t t = t_begin; t < t_end; ++t) {
    const T* k = key_cache + blocks[t / block_size] * block_stride + (t % block_size) * token_stride;
    for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
      const T* kh = k + kvh * head_size;
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = kvh * group + g;
        const float* qh = q + h * head_size;
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qh), load16(kh));
        for (int64_t j = 1; j < nv; ++j)
          a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * j), load16(kh + 16 * j), a);
        scores[h * len + t - t_begin] = _mm512_reduce_add_ps(a);
      }
    }
  }
  softmax_rows(scores, num_heads, len, maxes);
  std::fill(acc, acc + num_heads * head_size, 0.f);
  for (int64_t t = t_begin; t < t_end; ++t) {
    const T* v = value_cache + blocks[t / block_size] * block_stride + (t % block_size) * token_stride;
    for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
      for (int64_t j = 0; j < nv; ++j) {
        const __m512 vj = load16(v + kvh * head_size + 16 * j);
        for (int64_t g = 0; g < group; ++g) {
          const int64_t h = kvh * group + g;
          float* a = acc + h * head_size + 16 * j;
          _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(scores[h * len + t - t_begin]), vj,
                                              _mm512_loadu_ps(a)));
        }
      }
    }
  }
}
#endif

// Scores, softmax and p.V of one query over tokens t_begin..t_end-1 of its sequence, for all
// heads: acc[h] = sum_t p[h][t] v_t with p = exp(s - max_h) left in scores (row length
// t_end - t_begin), unnormalised; the maxima go to ``maxes`` when it is not null.
template <typename T>
void attend(const float* q, const T* key_cache, const T* value_cache, const int32_t* blocks,
            int64_t t_begin, int64_t t_end, int64_t num_heads, int64_t num_kv_heads,
            int64_t head_size, int64_t block_size, float* row, float* scores, float* acc,
            float* maxes) {
  const int64_t group = num_heads / num_kv_heads, len = t_end - t_begin;
  const int64_t token_stride = num_kv_heads * head_size;  // one token's K (or V), all kv heads
  const int64_t block_stride = block_size * token_stride;
#if defined(__AVX512F__)
  if (head_size % 16 == 0) {
    decode_seq_avx512(q, key_cache, value_cache, blocks, t_begin, t_end, num_heads, group,
                      num_kv_heads, head_size, block_size, scores, acc, maxes);
    return;
  }
#endif
  // Pass 1: scores[h][t] = q_h . k_t (scale folded into q); head h reads kv head h / group.
  for (int64_t t = t_begin; t < t_end; ++t) {
    const T* k = key_cache + blocks[t / block_size] * block_stride + (t % block_size) * token_stride;
#pragma omp simd
    for (int64_t i = 0; i < token_stride; ++i) row[i] = load(k[i]);
    for (int64_t h = 0; h < num_heads; ++h) {
      const float* qh = q + h * head_size;
      const float* kh = row + (h / group) * head_size;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < head_size; ++d) s += qh[d] * kh[d];
      scores[h * len + t - t_begin] = s;
    }
  }
  softmax_rows(scores, num_heads, len, maxes);
  // Pass 2: acc[h] = sum_t p[h][t] * v_t.
  std::fill(acc, acc + num_heads * head_size, 0.f);
  for (int64_t t = t_begin; t < t_end; ++t) {
    const T* v = value_cache + blocks[t / block_size] * block_stride + (t % block_size) * token_stride;
#pragma omp simd
    for (int64_t i = 0; i < token_stride; ++i) row[i] = load(v[i]);
    for (int64_t h = 0; h < num_heads; ++h) {
      const float p = scores[h * len + t - t_begin];
      const float* vh = row + (h / group) * head_size;
      float* ah = acc + h * head_size;
#pragma omp simd
      for (int64_t d = 0; d < head_size; ++d) ah[d] += p * vh[d];
    }
  }
}

// Below this many tokens per part a context is not split: the merge and the second task cost
// more than the halved loop saves.
constexpr int64_t kMinSplitTokens = 512;

// query_start_loc (nullable: one query per sequence): sequence i has queries
// qsl[i]..qsl[i+1]-1, its last ones (a decode with speculative drafts); query j of q_len sees
// the first seq_len - (q_len - 1 - j) tokens, i.e. each is a decode of its own.
template <typename T>
void decode(const T* query, const T* key_cache, const T* value_cache, const int32_t* block_table,
            const int32_t* seq_lens, const int32_t* query_start_loc, T* out, int64_t num_seqs,
            int64_t num_heads, int64_t num_kv_heads, int64_t head_size, int64_t block_size,
            int64_t block_table_stride, float scale) {
  const int64_t hd = num_heads * head_size;
  // One task per sequence: a token's K for every kv head is one contiguous row, so a block is
  // read front to back (prefetch-friendly) and each row serves all num_heads query heads.
  // Fewer plain decodes than threads: long contexts are split in parts, one task each, merged
  // after by their softmax maxima and sums (flash-decoding; vLLM's paged_attention_v2).
  int64_t splits = 1;
  const int64_t threads = omp_get_max_threads();
  if (!query_start_loc && num_seqs < threads) {
    const int64_t longest = *std::max_element(seq_lens, seq_lens + num_seqs);
    splits = std::clamp<int64_t>(longest / kMinSplitTokens, 1, threads / num_seqs);
  }
  // Per (sequence, part): maxima [H], sums [H], unnormalised acc [H, D].
  std::vector<float> part_max, part_sum, part_acc;
  if (splits > 1) {
    part_max.resize(num_seqs * splits * num_heads);
    part_sum.resize(num_seqs * splits * num_heads);
    part_acc.resize(num_seqs * splits * hd);
  }
#pragma omp parallel
  {
    std::vector<float> q(hd), row(num_kv_heads * head_size), acc(hd);
    std::vector<float> scores;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_seqs * splits; ++task) {
      const int64_t seq = task / splits, part = task % splits;
      const int64_t q_begin = query_start_loc ? query_start_loc[seq] : seq;
      const int64_t q_len = query_start_loc ? query_start_loc[seq + 1] - q_begin : 1;
      const int32_t* blocks = block_table + seq * block_table_stride;
      for (int64_t j = 0; j < q_len; ++j) {
        const int64_t len = seq_lens[seq] - (q_len - 1 - j);
        const int64_t chunk = (len + splits - 1) / splits;
        const int64_t t_begin = std::min(len, part * chunk), t_end = std::min(len, t_begin + chunk);
        const T* q_src = query + (q_begin + j) * hd;
        for (int64_t i = 0; i < hd; ++i) q[i] = load(q_src[i]) * scale;
        if (splits == 1) {
          scores.resize(num_heads * len);
          attend(q.data(), key_cache, value_cache, blocks, 0, len, num_heads, num_kv_heads,
                 head_size, block_size, row.data(), scores.data(), acc.data(), nullptr);
          finish(acc.data(), scores.data(), out + (q_begin + j) * hd, num_heads, head_size, len);
          continue;
        }
        float* pm = part_max.data() + task * num_heads;
        float* ps = part_sum.data() + task * num_heads;
        float* pa = part_acc.data() + task * hd;
        if (t_begin == t_end) {  // an empty part: weight zero in the merge
          std::fill(pm, pm + num_heads, -1e30f);
          std::fill(ps, ps + num_heads, 0.f);
          std::fill(pa, pa + hd, 0.f);
          continue;
        }
        const int64_t n = t_end - t_begin;
        scores.resize(num_heads * n);
        attend(q.data(), key_cache, value_cache, blocks, t_begin, t_end, num_heads,
               num_kv_heads, head_size, block_size, row.data(), scores.data(), pa, pm);
        for (int64_t h = 0; h < num_heads; ++h) {
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < n; ++t) sum += scores[h * n + t];
          ps[h] = sum;
        }
      }
    }
    if (splits > 1) {
#pragma omp for schedule(static)
      for (int64_t seq = 0; seq < num_seqs; ++seq) {
        for (int64_t h = 0; h < num_heads; ++h) {
          float m = -1e30f;
          for (int64_t part = 0; part < splits; ++part)
            m = std::max(m, part_max[(seq * splits + part) * num_heads + h]);
          float total = 0.f;
          std::fill(acc.begin(), acc.begin() + head_size, 0.f);
          for (int64_t part = 0; part < splits; ++part) {
            const int64_t task = seq * splits + part;
            const float w = std::exp(std::max(part_max[task * num_heads + h] - m, -80.f));
            total += w * part_sum[task * num_heads + h];
            const float* pa = part_acc.data() + task * hd + h * head_size;
            for (int64_t d = 0; d < head_size; ++d) acc[d] += w * pa[d];
          }
          const float inv = 1.f / total;
          T* dst = out + seq * hd + h * head_size;
          for (int64_t d = 0; d < head_size; ++d) store(acc[d] * inv, dst + d);
        }
      }
    }
  }
}

#if defined(__AVX512F__)
// e^x for 16 lanes, x clamped to [-87, 88]: Cephes' expf polynomial, scaled by 2^n with
// vscalefps (about 1 ulp).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

// Causal attention of prefill chunks over the paged cache, flash-attention style (Dao et al.,
// "FlashAttention", 2022), with 16 query rows (token x head of one GQA group) in a register's
// lanes: scores of a key for 16 rows are one vector, so the online softmax (running max, sum,
// rescale) is all lane-wise, with no horizontal reductions. One task per (sequence, kv head, 16
// rows); keys 16 at a time, converted to float32 once per task. D = head_size.
template <int64_t D, typename T>
void prefill_avx512(const T* query, int64_t q_row_stride, const T* key_cache,
                    const T* value_cache, const int32_t* block_table, const int32_t* seq_lens,
                    const int32_t* query_start_loc, T* out, int64_t num_seqs, int64_t num_heads,
                    int64_t num_kv_heads, int64_t block_size, int64_t block_table_stride,
                    float scale) {
  const int64_t group = num_heads / num_kv_heads, token_stride = num_kv_heads * D;
  const int64_t block_stride = block_size * token_stride;
  struct Task { int64_t seq, kvh, r0; };
  std::vector<Task> tasks;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t rows = (query_start_loc[seq + 1] - query_start_loc[seq]) * group;
    for (int64_t r0 = (rows - 1) / 16 * 16; r0 >= 0; r0 -= 16)  // the longest contexts first
      for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) tasks.push_back({seq, kvh, r0});
  }
#pragma omp parallel
  {
    alignas(64) float qt[D * 16];   // qt[d * 16 + lane]: the lane's row of q, scaled, transposed
    alignas(64) float acc[D * 16];  // acc[d * 16 + lane]
    alignas(64) float kf[16 * D];   // the chunk's keys, float32, one row per key
    alignas(64) float vf[16 * D];
#pragma omp for schedule(dynamic, 1)
    for (size_t task = 0; task < tasks.size(); ++task) {
      const auto [seq, kvh, r0] = tasks[task];
      const int64_t q_begin = query_start_loc[seq], q_len = query_start_loc[seq + 1] - q_begin;
      const int64_t rows = std::min<int64_t>(16, q_len * group - r0);
      const int64_t ctx = seq_lens[seq] - q_len;  // tokens before the chunk
      const int32_t* blocks = block_table + seq * block_table_stride;
      alignas(64) int32_t pos[16];  // each lane's query position; padding lanes copy the last
      for (int64_t lane = 0; lane < 16; ++lane) {
        const int64_t r = r0 + std::min(lane, rows - 1);
        pos[lane] = static_cast<int32_t>(ctx + r / group);
        const T* src = query + (q_begin + r / group) * q_row_stride + (kvh * group + r % group) * D;
        for (int64_t d = 0; d < D; ++d) qt[d * 16 + lane] = load(src[d]) * scale;
      }
      const __m512i posv = _mm512_load_si512(pos);
      std::fill(acc, acc + D * 16, 0.f);
      __m512 m = _mm512_set1_ps(-1e30f), l = _mm512_setzero_ps();  // finite: -ffast-math
      const int64_t kv_end = pos[15] + 1;
      for (int64_t t0 = 0; t0 < kv_end; t0 += 16) {
        const int64_t n = std::min<int64_t>(16, kv_end - t0);
        for (int64_t i = 0; i < n; ++i) {
          const int64_t t = t0 + i;
          const int64_t off = blocks[t / block_size] * block_stride +
                              (t % block_size) * token_stride + kvh * D;
          for (int64_t j = 0; j < D; j += 16) {
            _mm512_store_ps(kf + i * D + j, load16(key_cache + off + j));
            _mm512_store_ps(vf + i * D + j, load16(value_cache + off + j));
          }
        }
        // A short last chunk: rows past it must be numbers (0 * NaN would poison the sums).
        std::fill(kf + n * D, kf + 16 * D, 0.f);
        std::fill(vf + n * D, vf + 16 * D, 0.f);
        __m512 sc[16];
        for (int i = 0; i < 16; ++i) sc[i] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; ++d) {
          const __m512 qd = _mm512_load_ps(qt + d * 16);
          for (int i = 0; i < 16; ++i)
            sc[i] = _mm512_fmadd_ps(_mm512_set1_ps(kf[i * D + d]), qd, sc[i]);
        }
        __mmask16 live[16];
        __m512 mx = m;
        for (int i = 0; i < 16; ++i) {  // key t0 + i is live for lanes at or after it
          live[i] = i < n ? _mm512_cmp_epi32_mask(posv, _mm512_set1_epi32(static_cast<int32_t>(t0 + i)),
                                                  _MM_CMPINT_NLT)
                          : static_cast<__mmask16>(0);
          mx = _mm512_mask_max_ps(mx, live[i], mx, sc[i]);
        }
        const __m512 corr = exp16(_mm512_sub_ps(m, mx));
        m = mx;
        l = _mm512_mul_ps(l, corr);
        for (int i = 0; i < 16; ++i) {
          sc[i] = _mm512_maskz_mov_ps(live[i], exp16(_mm512_sub_ps(sc[i], m)));
          l = _mm512_add_ps(l, sc[i]);
        }
        for (int64_t d = 0; d < D; ++d) {
          __m512 a = _mm512_mul_ps(_mm512_load_ps(acc + d * 16), corr);
          for (int i = 0; i < 16; ++i)
            a = _mm512_fmadd_ps(_mm512_set1_ps(vf[i * D + d]), sc[i], a);
          _mm512_store_ps(acc + d * 16, a);
        }
      }
      alignas(64) float inv[16];
      _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), l));
      for (int64_t lane = 0; lane < rows; ++lane) {
        const int64_t r = r0 + lane;
        T* dst = out + (q_begin + r / group) * num_heads * D + (kvh * group + r % group) * D;
        for (int64_t d = 0; d < D; ++d) store(acc[d * 16 + lane] * inv[lane], dst + d);
      }
    }
  }
}
#endif

// key/value [T, token_elems] rows (row stride key_stride / value_stride elements) copied to
// their cache slots, as vLLM's reshape_and_cache; slot -1 (padding) is skipped.
template <typename T>
void reshape_and_cache(const T* key, const T* value, T* key_cache, T* value_cache,
                       const int64_t* slot_mapping, int64_t num_tokens, int64_t token_elems,
                       int64_t key_stride, int64_t value_stride) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slot_mapping[t];
    if (slot < 0) continue;
    std::memcpy(key_cache + slot * token_elems, key + t * key_stride, token_elems * sizeof(T));
    std::memcpy(value_cache + slot * token_elems, value + t * value_stride,
                token_elems * sizeof(T));
  }
}

// Below this many elements an elementwise op runs on the calling thread: waking the other
// OpenMP threads costs more than the work (a decode step's norms are 1-32 rows).
constexpr int64_t kParallelMin = 64 * 1024;

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
#pragma omp parallel for schedule(static) if (rows * inter >= kParallelMin)
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
#pragma omp parallel if (rows * num_heads * head_size >= kParallelMin)
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

// All tensors contiguous: query/out [num_queries, num_heads, head_size]; caches [num_blocks,
// block_size, num_kv_heads, head_size]; block_table [num_seqs, block_table_stride] int32;
// seq_lens [num_seqs] int32, each >= its number of queries; qsl [num_seqs + 1] int32 or null.
void paged_decode_attention_f32(const float* q, const float* kc, const float* vc,
                                const int32_t* bt, const int32_t* sl, const int32_t* qsl,
                                float* out, int64_t n, int64_t h, int64_t hkv, int64_t d,
                                int64_t bs, int64_t bts, float scale) {
  decode(q, kc, vc, bt, sl, qsl, out, n, h, hkv, d, bs, bts, scale);
}

void paged_decode_attention_bf16(const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                                 const int32_t* bt, const int32_t* sl, const int32_t* qsl,
                                 uint16_t* out, int64_t n, int64_t h, int64_t hkv, int64_t d,
                                 int64_t bs, int64_t bts, float scale) {
  decode(q, kc, vc, bt, sl, qsl, out, n, h, hkv, d, bs, bts, scale);
}

// query rows [T, >= num_heads * head_size] with row stride q_row_stride; out [T, num_heads,
// head_size] contiguous; the rest as paged_decode_attention with qsl required. Returns 0, or
// 1 when head_size is not 64 or 128 or the CPU lacks AVX-512 (the caller falls back).
#if defined(__AVX512F__)
#define PAGEDSERVE_PREFILL(SUFFIX, T)                                                           \
  int paged_prefill_attention_##SUFFIX(const T* q, int64_t q_row_stride, const T* kc,          \
                                       const T* vc, const int32_t* bt, const int32_t* sl,      \
                                       const int32_t* qsl, T* out, int64_t n, int64_t h,       \
                                       int64_t hkv, int64_t d, int64_t bs, int64_t bts,        \
                                       float scale) {                                          \
    if (d == 64)                                                                                \
      prefill_avx512<64>(q, q_row_stride, kc, vc, bt, sl, qsl, out, n, h, hkv, bs, bts, scale); \
    else if (d == 128)                                                                          \
      prefill_avx512<128>(q, q_row_stride, kc, vc, bt, sl, qsl, out, n, h, hkv, bs, bts, scale); \
    else                                                                                        \
      return 1;                                                                                 \
    return 0;                                                                                   \
  }
#else
#define PAGEDSERVE_PREFILL(SUFFIX, T)                                                           \
  int paged_prefill_attention_##SUFFIX(const T*, int64_t, const T*, const T*, const int32_t*,  \
                                       const int32_t*, const int32_t*, T*, int64_t, int64_t,   \
                                       int64_t, int64_t, int64_t, int64_t, float) {            \
    return 1;                                                                                   \
  }
#endif
PAGEDSERVE_PREFILL(f32, float)
PAGEDSERVE_PREFILL(bf16, uint16_t)

// Whether the AVX-512 loops were compiled in (-march=native on an AVX-512 CPU).
int cpu_ops_avx512() {
#if defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}

#define PAGEDSERVE_ELEMENTWISE(SUFFIX, T)                                                       \
  void rms_norm_##SUFFIX(T* out, T* x, T* residual, const T* weight, int64_t rows,             \
                         int64_t dim, int64_t x_stride, float eps) {                           \
    rms_norm(out, x, residual, weight, rows, dim, x_stride, eps);                              \
  }                                                                                             \
  void silu_and_mul_##SUFFIX(T* out, const T* x, int64_t rows, int64_t inter) {                \
    silu_and_mul(out, x, rows, inter);                                                          \
  }                                                                                             \
  void reshape_and_cache_##SUFFIX(const T* k, const T* v, T* kc, T* vc, const int64_t* slots,  \
                                 int64_t n, int64_t elems, int64_t ks, int64_t vs) {           \
    reshape_and_cache(k, v, kc, vc, slots, n, elems, ks, vs);                                   \
  }                                                                                             \
  void rotary_##SUFFIX(T* x, const int64_t* positions, const float* cos, const float* sin,     \
                       int64_t rows, int64_t num_heads, int64_t head_size, int64_t row_stride) { \
    rotary(x, positions, cos, sin, rows, num_heads, head_size, row_stride);                     \
  }

PAGEDSERVE_ELEMENTWISE(f32, float)
PAGEDSERVE_ELEMENTWISE(bf16, uint16_t)

}  // extern "C"
