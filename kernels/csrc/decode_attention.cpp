// Paged decode attention: one query token per sequence against its whole context, read in
// place through the block table (no gather copy), softmax in float32; long contexts of few
// sequences split across threads and merged (flash-decoding). Ideas after vLLM's CPU backend
// (csrc/cpu/attention.cpp, paged_attention_v1/v2).
//
// Plain C ABI over raw pointers, called through ctypes (kernels/cpu_ops.py). OpenMP threads
// over sequences; the library resolves to the libgomp torch already loaded, so it shares
// torch's thread count.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "convert.h"
#include "simd.h"

namespace {

// Each row of rows x len scores becomes exp(s - max(row)) in place (the maxima into ``maxes``
// if given).
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

// Where the K/V rows of a sequence live: token t of kv head kvh at base + offset(t) + kvh * D.
struct Paged {
  const int32_t* blocks;
  int64_t block_size, token_stride, block_stride;
  int64_t offset(int64_t t) const {
    return blocks[t / block_size] * block_stride + (t % block_size) * token_stride;
  }
};

#if PAGEDSERVE_SIMD
// Lane i of the result is the sum of a[i]'s lanes: V::W horizontal sums in one transposing
// reduction (hadd trees), where V::W separate reduce_add calls would cost 3-4x the shuffles.
template <class V>
inline typename V::F sums_of(const typename V::F* a);

#if defined(PAGEDSERVE_AVX2)
template <>
inline __m256 sums_of<Avx2>(const __m256* a) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  // h0: [sums 0-3 of the low halves | of the high halves], h1 the same for 4-7.
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}
#endif

#if defined(PAGEDSERVE_AVX512)
inline __m512 hadd512(__m512 x, __m512 y) {  // per 128-bit lane: [x0+x1, x2+x3, y0+y1, y2+y3]
  return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x88), _mm512_shuffle_ps(x, y, 0xDD));
}
template <>
inline __m512 sums_of<Avx512>(const __m512* a) {
  __m512 c[8];  // c[i]: a[i]'s 256-bit halves added (low half), a[i + 8]'s (high half)
  for (int i = 0; i < 8; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], 0x44),
                         _mm512_shuffle_f32x4(a[i], a[i + 8], 0xEE));
  // 128-bit lanes of e0: [a0-3 part 0, a0-3 part 1, a8-11 part 0, a8-11 part 1]; e1: 4-7, 12-15.
  const __m512 e0 = hadd512(hadd512(c[0], c[1]), hadd512(c[2], c[3]));
  const __m512 e1 = hadd512(hadd512(c[4], c[5]), hadd512(c[6], c[7]));
  const __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, 0x88),   // parts 0: 0-3 8-11 4-7 12-15
                                 _mm512_shuffle_f32x4(e0, e1, 0xDD));  // parts 1
  return _mm512_shuffle_f32x4(s, s, 0xD8);  // lanes in order 0-3 4-7 8-11 12-15
}
#endif

// Pass 1 of the SIMD loop: scores[h][t] = q_h . k_t, V::W tokens at a time: V::W independent
// FMA chains (one per token) per head, then one transposing reduction, instead of one
// latency-bound chain and a reduction per (token, head). Tile-major, every kv head of a tile
// before the next: each K row is read from memory once, whole and in order (a pass per kv head
// read every row three times, a third of it each time, and ran slower than the old loop once
// the cache outgrew L3).
template <class V, typename T>
void scores_simd(const float* q, const T* key_cache, const int64_t* offs, int64_t len,
                 int64_t num_kv_heads, int64_t group, int64_t head_size, float* scores) {
  constexpr int W = V::W;
  const int64_t nv = head_size / W;
  for (int64_t t0 = 0; t0 < len; t0 += W) {
    const int64_t n = std::min<int64_t>(W, len - t0);
    const T* rows[W];
    for (int i = 0; i < W; ++i)  // past the end: token t0's row again, its scores dropped
      rows[i] = key_cache + offs[t0 + (i < n ? i : 0)];
    for (int64_t h = 0; h < num_kv_heads * group; ++h) {
      const float* qh = q + h * head_size;
      const int64_t kv_off = (h / group) * head_size;
      typename V::F a[W];
      for (int i = 0; i < W; ++i) a[i] = V::zero();
      for (int64_t j = 0; j < nv; ++j) {
        const typename V::F qj = V::load(qh + W * j);
        for (int i = 0; i < W; ++i) a[i] = V::fmadd(qj, V::load(rows[i] + kv_off + W * j), a[i]);
      }
      const typename V::F sum = sums_of<V>(a);
      if (n == W) {
        V::store(sum, scores + h * len + t0);
      } else {
        alignas(64) float tmp[W];
        V::store(sum, tmp);
        std::copy(tmp, tmp + n, scores + h * len + t0);
      }
    }
  }
}

// Each row of scores becomes exp(max(s - max(row), -80)) (see softmax_rows), the maxima into
// ``maxes`` if given, with vector max and exp (simd.h's vexp).
template <class V>
void softmax_rows_simd(float* scores, int64_t rows, int64_t len, float* maxes) {
  constexpr int W = V::W;
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = scores + r * len;
    int64_t t = 0;
    float m = -1e30f;
    if (len >= W) {
      typename V::F mv = V::load(sr);
      for (t = W; t + W <= len; t += W) mv = V::max(mv, V::load(sr + t));
      alignas(64) float tmp[W];
      V::store(mv, tmp);
      m = *std::max_element(tmp, tmp + W);
    }
    for (; t < len; ++t) m = std::max(m, sr[t]);
    if (maxes) maxes[r] = m;
    const typename V::F mv = V::set1(m), floor = V::set1(-80.f);
    for (t = 0; t + W <= len; t += W)
      V::store(vexp<V>(V::max(V::sub(V::load(sr + t), mv), floor)), sr + t);
    for (; t < len; ++t) sr[t] = std::exp(std::max(sr[t] - m, -80.f));
  }
}

// Pass 2 for heads h0..h0+G-1 (one kv head's) over tokens t_lo..t_hi-1: acc[h] (+)= sum_t
// p[h][t] v_t, C vectors of the head at a time in G x C registers across the tokens (each V
// row chunk loaded once for G heads), where a load-add-store of acc per (token, head) was
// bound by the stores. ``first``: acc starts from zero.
template <class V, int G, int C, typename T>
void values_simd(const float* scores, const T* value_cache, const int64_t* offs, int64_t len,
                 int64_t t_lo, int64_t t_hi, int64_t kvh, int64_t h0, int64_t head_size,
                 float* acc, bool first) {
  constexpr int W = V::W;
  for (int64_t c0 = 0; c0 < head_size; c0 += C * W) {
    typename V::F a[G][C];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c)
        a[g][c] = first ? V::zero() : V::load(acc + (h0 + g) * head_size + c0 + W * c);
    for (int64_t t = t_lo; t < t_hi; ++t) {
      const T* v = value_cache + offs[t] + kvh * head_size + c0;
      typename V::F p[G];
      for (int g = 0; g < G; ++g) p[g] = V::set1(scores[(h0 + g) * len + t]);
      for (int c = 0; c < C; ++c) {
        const typename V::F vc = V::load(v + W * c);
        for (int g = 0; g < G; ++g) a[g][c] = V::fmadd(p[g], vc, a[g][c]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) V::store(a[g][c], acc + (h0 + g) * head_size + c0 + W * c);
  }
}

// Tokens per chunk of pass 2: every kv head and column of a chunk's V rows before the next
// chunk, so each row comes from memory once and is then reread from L1 (16 rows of 3 x 64
// float32 are 12 KiB); the accumulators go through acc once per chunk.
constexpr int64_t kValueChunk = 16;

template <class V, int C, typename T>
void values_heads(const float* scores, const T* value_cache, const int64_t* offs, int64_t len,
                  int64_t num_kv_heads, int64_t group, int64_t head_size, float* acc) {
  // Blocks of up to 4 heads: 4 x C accumulators, C value vectors and 4 broadcasts fit the
  // AVX2 tier's 16 registers at C = 2.
  for (int64_t t_lo = 0; t_lo < len; t_lo += kValueChunk) {
    const int64_t t_hi = std::min(len, t_lo + kValueChunk);
    const bool first = t_lo == 0;
    for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
      for (int64_t g0 = 0; g0 < group; g0 += 4) {
        const int64_t h0 = kvh * group + g0;
        switch (std::min<int64_t>(4, group - g0)) {
          case 1: values_simd<V, 1, C>(scores, value_cache, offs, len, t_lo, t_hi, kvh, h0,
                                       head_size, acc, first); break;
          case 2: values_simd<V, 2, C>(scores, value_cache, offs, len, t_lo, t_hi, kvh, h0,
                                       head_size, acc, first); break;
          case 3: values_simd<V, 3, C>(scores, value_cache, offs, len, t_lo, t_hi, kvh, h0,
                                       head_size, acc, first); break;
          default: values_simd<V, 4, C>(scores, value_cache, offs, len, t_lo, t_hi, kvh, h0,
                                        head_size, acc, first);
        }
      }
    }
  }
}

// The loop with V::W-lane registers, for head_size % V::W == 0 (every model we serve). Each
// token's row offset is computed once (a division by the block size) for K and V and every kv
// head.
template <class V, typename T>
void attend_simd(const float* q, const T* key_cache, const T* value_cache, const Paged& pg,
                 int64_t t_begin, int64_t t_end, int64_t num_heads, int64_t group,
                 int64_t num_kv_heads, int64_t head_size, float* scores, float* acc,
                 float* maxes, std::vector<int64_t>& offs) {
  const int64_t len = t_end - t_begin;
  offs.resize(len);
  for (int64_t t = t_begin; t < t_end; ++t) offs[t - t_begin] = pg.offset(t);
  scores_simd<V>(q, key_cache, offs.data(), len, num_kv_heads, group, head_size, scores);
  softmax_rows_simd<V>(scores, num_heads, len, maxes);
  if ((head_size / V::W) % 2 == 0)
    values_heads<V, 2>(scores, value_cache, offs.data(), len, num_kv_heads, group, head_size,
                       acc);
  else
    values_heads<V, 1>(scores, value_cache, offs.data(), len, num_kv_heads, group, head_size,
                       acc);
}
#endif

// Scores, softmax and p.V of one query over tokens t_begin..t_end-1 of its sequence, for all
// heads: acc[h] = sum_t p[h][t] v_t with p = exp(s - max_h) left in scores (row length
// t_end - t_begin), unnormalised; the maxima go to ``maxes`` when it is not null.
template <typename T>
void attend(const float* q, const T* key_cache, const T* value_cache, const Paged& pg,
            int64_t t_begin, int64_t t_end, int64_t num_heads, int64_t num_kv_heads,
            int64_t head_size, float* row, float* scores, float* acc, float* maxes,
            std::vector<int64_t>& offs) {
  const int64_t group = num_heads / num_kv_heads, len = t_end - t_begin;
#if PAGEDSERVE_SIMD
  if (head_size % Vec::W == 0) {
    attend_simd<Vec>(q, key_cache, value_cache, pg, t_begin, t_end, num_heads, group,
                     num_kv_heads, head_size, scores, acc, maxes, offs);
    return;
  }
#else
  (void)offs;
#endif
  // Pass 1: scores[h][t] = q_h . k_t (scale folded into q); head h reads kv head h / group.
  for (int64_t t = t_begin; t < t_end; ++t) {
    widen(key_cache + pg.offset(t), row, pg.token_stride);
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
    widen(value_cache + pg.offset(t), row, pg.token_stride);
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

// Below this many (context token x head) pairs in a call the calling thread runs it alone:
// about 10 us of work at 64-dim heads, less than a fork and join of the team costs.
constexpr int64_t kParallelMinWork = 4096;

// Per (sequence, part) results of a split context: maxima [H], sums [H], unnormalised acc
// [H, D]; merged by their softmax maxima and sums (vLLM's paged_attention_v2).
struct Parts {
  int64_t splits, num_heads, head_size;
  std::vector<float> max, sum, acc;
  float* max_at(int64_t task) { return max.data() + task * num_heads; }
  float* sum_at(int64_t task) { return sum.data() + task * num_heads; }
  float* acc_at(int64_t task) { return acc.data() + task * num_heads * head_size; }

  template <typename T>
  void merge(int64_t seq, T* out, float* acc_buf) {
    for (int64_t h = 0; h < num_heads; ++h) {
      float m = -1e30f;
      for (int64_t part = 0; part < splits; ++part)
        m = std::max(m, max_at(seq * splits + part)[h]);
      float total = 0.f;
      std::fill(acc_buf, acc_buf + head_size, 0.f);
      for (int64_t part = 0; part < splits; ++part) {
        const int64_t task = seq * splits + part;
        const float w = std::exp(std::max(max_at(task)[h] - m, -80.f));
        total += w * sum_at(task)[h];
        const float* pa = acc_at(task) + h * head_size;
        for (int64_t d = 0; d < head_size; ++d) acc_buf[d] += w * pa[d];
      }
      const float inv = 1.f / total;
      T* dst = out + seq * num_heads * head_size + h * head_size;
      for (int64_t d = 0; d < head_size; ++d) store(acc_buf[d] * inv, dst + d);
    }
  }
};

// One part (t_begin..t_end) of a split context into its slot of ``parts``.
template <typename T>
void attend_part(const float* q, const T* kc, const T* vc, const Paged& pg, int64_t t_begin,
                 int64_t t_end, int64_t num_kv_heads, float* row, std::vector<float>& scores,
                 std::vector<int64_t>& offs, Parts& parts, int64_t task) {
  const int64_t num_heads = parts.num_heads, hd = num_heads * parts.head_size;
  float *pm = parts.max_at(task), *ps = parts.sum_at(task), *pa = parts.acc_at(task);
  if (t_begin == t_end) {  // an empty part: weight zero in the merge
    std::fill(pm, pm + num_heads, -1e30f);
    std::fill(ps, ps + num_heads, 0.f);
    std::fill(pa, pa + hd, 0.f);
    return;
  }
  const int64_t n = t_end - t_begin;
  scores.resize(num_heads * n);
  attend(q, kc, vc, pg, t_begin, t_end, num_heads, num_kv_heads, parts.head_size, row,
         scores.data(), pa, pm, offs);
  for (int64_t h = 0; h < num_heads; ++h) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) sum += scores[h * n + t];
    ps[h] = sum;
  }
}

// query_start_loc (nullable: one query per sequence): sequence i has queries
// qsl[i]..qsl[i+1]-1, its last ones (a decode with speculative drafts); query j of q_len sees
// the first seq_len - (q_len - 1 - j) tokens, i.e. each is a decode of its own.
template <typename T>
void decode(const T* query, const T* key_cache, const T* value_cache, const int32_t* block_table,
            const int32_t* seq_lens, const int32_t* query_start_loc, T* out, int64_t num_seqs,
            int64_t num_heads, int64_t num_kv_heads, int64_t head_size, int64_t block_size,
            int64_t block_table_stride, float scale) {
  const int64_t hd = num_heads * head_size, token_stride = num_kv_heads * head_size;
  // One task per sequence: a token's K for every kv head is one contiguous row, so a block is
  // read front to back (prefetch-friendly) and each row serves all num_heads query heads.
  // Fewer plain decodes than threads: long contexts are split in parts, one task each.
  int64_t splits = 1;
  const int64_t threads = omp_get_max_threads();
  if (!query_start_loc && num_seqs < threads) {
    const int64_t longest = *std::max_element(seq_lens, seq_lens + num_seqs);
    splits = std::clamp<int64_t>(longest / kMinSplitTokens, 1, threads / num_seqs);
  }
  Parts parts{splits, num_heads, head_size, {}, {}, {}};
  if (splits > 1) {
    parts.max.resize(num_seqs * splits * num_heads);
    parts.sum.resize(num_seqs * splits * num_heads);
    parts.acc.resize(num_seqs * splits * hd);
  }
  // One task (a batch of one, not split), or too little work to share: the calling thread
  // alone, no fork and join (a parallel region per layer is a barrier per layer, and each
  // barrier waits for a thread a busy neighbour may have preempted).
  int64_t total = 0;
  for (int64_t i = 0; i < num_seqs; ++i) total += seq_lens[i];
  const bool parallel = num_seqs * splits > 1 && total * num_heads >= kParallelMinWork;
#pragma omp parallel if (parallel)
  {
    std::vector<float> q(hd), row(token_stride), acc(hd), scores;
    std::vector<int64_t> offs;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_seqs * splits; ++task) {
      const int64_t seq = task / splits, part = task % splits;
      const int64_t q_begin = query_start_loc ? query_start_loc[seq] : seq;
      const int64_t q_len = query_start_loc ? query_start_loc[seq + 1] - q_begin : 1;
      const Paged pg{block_table + seq * block_table_stride, block_size, token_stride,
                     block_size * token_stride};
      for (int64_t j = 0; j < q_len; ++j) {
        const int64_t len = seq_lens[seq] - (q_len - 1 - j);
        const T* q_src = query + (q_begin + j) * hd;
        for (int64_t i = 0; i < hd; ++i) q[i] = load(q_src[i]) * scale;
        if (splits == 1) {
          scores.resize(num_heads * len);
          attend(q.data(), key_cache, value_cache, pg, 0, len, num_heads, num_kv_heads,
                 head_size, row.data(), scores.data(), acc.data(), nullptr, offs);
          finish(acc.data(), scores.data(), out + (q_begin + j) * hd, num_heads, head_size, len);
          continue;
        }
        const int64_t chunk = (len + splits - 1) / splits;
        const int64_t t_begin = std::min(len, part * chunk), t_end = std::min(len, t_begin + chunk);
        attend_part(q.data(), key_cache, value_cache, pg, t_begin, t_end, num_kv_heads,
                    row.data(), scores, offs, parts, task);
      }
    }
    if (splits > 1) {
#pragma omp for schedule(static)
      for (int64_t seq = 0; seq < num_seqs; ++seq) parts.merge(seq, out, acc.data());
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

}  // extern "C"
