// Paged decode attention: one query token per sequence against its whole context, read in
// place through the block table (no gather copy), softmax in float32; long contexts of few
// sequences split across threads and merged (flash-decoding). Ideas after vLLM's CPU backend
// (csrc/cpu/attention.cpp, paged_attention_v1/v2).
//
// The caches are in the query's dtype or 8-bit (kv_quant.h: codes and a scale per row,
// dequantized to float32 as they are read).
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
#include "kv_quant.h"
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

// Scores become cap * tanh(s / cap) (Gemma 2's attention-logit soft cap); cap 0: unchanged.
inline void soft_cap(float* scores, int64_t n, float cap) {
  if (cap <= 0.f) return;
  const float inv = 1.f / cap;
  for (int64_t i = 0; i < n; ++i) scores[i] = cap * std::tanh(scores[i] * inv);
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

// Where the K/V rows of a sequence live: token t's row (every kv head) at element offset(t).
struct Paged {
  const int32_t* blocks;
  int64_t block_size, token_stride, block_stride;
  int64_t offset(int64_t t) const {
    return blocks[t / block_size] * block_stride + (t % block_size) * token_stride;
  }
};

#if PAGEDSERVE_SIMD
// The loop with V::W-lane registers, for head_size % V::W == 0 (every model we serve): a K/V
// row is converted once into registers per kv head, not stored and reloaded (an 8-bit one is
// dequantized once per kv head into ``buf``, head_size floats, and serves its whole group).
template <class V, typename C>
void attend_simd(const float* q, const KvCache<C>& kc, const KvCache<C>& vc, const Paged& pg,
                 int64_t t_begin, int64_t t_end, int64_t num_heads, int64_t group,
                 int64_t num_kv_heads, int64_t head_size, float cap, float* scores,
                 float* acc, float* maxes, float* buf) {
  const int64_t nv = head_size / V::W, len = t_end - t_begin;
  for (int64_t t = t_begin; t < t_end; ++t) {
    const int64_t base = pg.offset(t);
    for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
      const auto* kh = kc.row(base, kvh, buf);
      for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
        const float* qh = q + h * head_size;
        typename V::F a = V::mul(V::load(qh), V::load(kh));
        for (int64_t j = 1; j < nv; ++j)
          a = V::fmadd(V::load(qh + V::W * j), V::load(kh + V::W * j), a);
        scores[h * len + t - t_begin] = V::reduce_add(a);
      }
    }
  }
  soft_cap(scores, num_heads * len, cap);
  softmax_rows(scores, num_heads, len, maxes);
  std::fill(acc, acc + num_heads * head_size, 0.f);
  for (int64_t t = t_begin; t < t_end; ++t) {
    const int64_t base = pg.offset(t);
    for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
      const auto* vh = vc.row(base, kvh, buf);
      for (int64_t j = 0; j < nv; ++j) {
        const typename V::F vj = V::load(vh + V::W * j);
        for (int64_t g = 0; g < group; ++g) {
          const int64_t h = kvh * group + g;
          float* a = acc + h * head_size + V::W * j;
          V::store(V::fmadd(V::set1(scores[h * len + t - t_begin]), vj, V::load(a)), a);
        }
      }
    }
  }
}
#endif

// Scores, softmax and p.V of one query over tokens t_begin..t_end-1 of its sequence, for all
// heads: acc[h] = sum_t p[h][t] v_t with p = exp(s - max_h) left in scores (row length
// t_end - t_begin), unnormalised; the maxima go to ``maxes`` when it is not null. ``row``:
// num_kv_heads * head_size floats of scratch. ``cap`` > 0: scores soft-capped first.
template <typename C>
void attend(const float* q, const KvCache<C>& kc, const KvCache<C>& vc, const Paged& pg,
            int64_t t_begin, int64_t t_end, int64_t num_heads, int64_t num_kv_heads,
            int64_t head_size, float cap, float* row, float* scores, float* acc,
            float* maxes) {
  const int64_t group = num_heads / num_kv_heads, len = t_end - t_begin;
#if PAGEDSERVE_SIMD
  if (head_size % Vec::W == 0) {
    attend_simd<Vec>(q, kc, vc, pg, t_begin, t_end, num_heads, group, num_kv_heads, head_size,
                     cap, scores, acc, maxes, row);
    return;
  }
#endif
  // Pass 1: scores[h][t] = q_h . k_t (scale folded into q); head h reads kv head h / group.
  for (int64_t t = t_begin; t < t_end; ++t) {
    const float* k = kc.widened(pg.offset(t), num_kv_heads, row);
    for (int64_t h = 0; h < num_heads; ++h) {
      const float* qh = q + h * head_size;
      const float* kh = k + (h / group) * head_size;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < head_size; ++d) s += qh[d] * kh[d];
      scores[h * len + t - t_begin] = s;
    }
  }
  soft_cap(scores, num_heads * len, cap);
  softmax_rows(scores, num_heads, len, maxes);
  // Pass 2: acc[h] = sum_t p[h][t] * v_t.
  std::fill(acc, acc + num_heads * head_size, 0.f);
  for (int64_t t = t_begin; t < t_end; ++t) {
    const float* v = vc.widened(pg.offset(t), num_kv_heads, row);
    for (int64_t h = 0; h < num_heads; ++h) {
      const float p = scores[h * len + t - t_begin];
      const float* vh = v + (h / group) * head_size;
      float* ah = acc + h * head_size;
#pragma omp simd
      for (int64_t d = 0; d < head_size; ++d) ah[d] += p * vh[d];
    }
  }
}

// Below this many K elements (tokens x kv heads x head size) per part a context is not split:
// the merge and the second task cost more than the halved loop saves. 512 tokens of SmolLM2's
// 3 x 64; a model with 32 kv heads (SmolLM2-1.7B) splits from 48 tokens, where one thread
// alone reads its 2 MB of K/V per layer at half the machine's bandwidth.
constexpr int64_t kMinSplitElems = 512 * 3 * 64;

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
template <typename C>
void attend_part(const float* q, const KvCache<C>& kc, const KvCache<C>& vc, const Paged& pg,
                 int64_t t_begin,
                 int64_t t_end, int64_t num_kv_heads, float cap, float* row,
                 std::vector<float>& scores, Parts& parts, int64_t task) {
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
  attend(q, kc, vc, pg, t_begin, t_end, num_heads, num_kv_heads, parts.head_size, cap, row,
         scores.data(), pa, pm);
  for (int64_t h = 0; h < num_heads; ++h) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) sum += scores[h * n + t];
    ps[h] = sum;
  }
}

// query_start_loc (nullable: one query per sequence): sequence i has queries
// qsl[i]..qsl[i+1]-1, its last ones (a decode with speculative drafts); query j of q_len sees
// the first seq_len - (q_len - 1 - j) tokens, i.e. each is a decode of its own. window > 0:
// a query at position p reads only tokens p - window + 1..p (transformers' sliding window),
// so the blocks before them are never touched; cap > 0: scores soft-capped.
template <typename T, typename C>
void decode(const T* query, const KvCache<C>& key_cache, const KvCache<C>& value_cache,
            const int32_t* block_table, const int32_t* seq_lens, const int32_t* query_start_loc,
            T* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
            int64_t block_size, int64_t block_table_stride, float scale, int64_t window,
            float cap) {
  const auto attended = [window](int64_t len) {
    return window > 0 ? std::min(len, window) : len;
  };
  const int64_t hd = num_heads * head_size;
  const int64_t token_stride = num_kv_heads * key_cache.head_stride();
  // One task per sequence: a token's K for every kv head is one contiguous row, so a block is
  // read front to back (prefetch-friendly) and each row serves all num_heads query heads.
  // Fewer plain decodes than threads: long contexts are split in parts, one task each.
  int64_t splits = 1;
  const int64_t threads = omp_get_max_threads();
  if (!query_start_loc && num_seqs < threads) {
    const int64_t longest = attended(*std::max_element(seq_lens, seq_lens + num_seqs));
    splits = std::clamp<int64_t>(longest * num_kv_heads * head_size / kMinSplitElems, 1,
                                 threads / num_seqs);
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
  for (int64_t i = 0; i < num_seqs; ++i) total += attended(seq_lens[i]);
  const bool parallel = num_seqs * splits > 1 && total * num_heads >= kParallelMinWork;
#pragma omp parallel if (parallel)
  {
    std::vector<float> q(hd), row(num_kv_heads * head_size), acc(hd), scores;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_seqs * splits; ++task) {
      const int64_t seq = task / splits, part = task % splits;
      const int64_t q_begin = query_start_loc ? query_start_loc[seq] : seq;
      const int64_t q_len = query_start_loc ? query_start_loc[seq + 1] - q_begin : 1;
      const Paged pg{block_table + seq * block_table_stride, block_size, token_stride,
                     block_size * token_stride};
      for (int64_t j = 0; j < q_len; ++j) {
        const int64_t end = seq_lens[seq] - (q_len - 1 - j), begin = end - attended(end);
        const int64_t len = end - begin;
        const T* q_src = query + (q_begin + j) * hd;
        for (int64_t i = 0; i < hd; ++i) q[i] = load(q_src[i]) * scale;
        if (splits == 1) {
          scores.resize(num_heads * len);
          attend(q.data(), key_cache, value_cache, pg, begin, end, num_heads, num_kv_heads,
                 head_size, cap, row.data(), scores.data(), acc.data(), nullptr);
          finish(acc.data(), scores.data(), out + (q_begin + j) * hd, num_heads, head_size, len);
          continue;
        }
        const int64_t chunk = (len + splits - 1) / splits;
        const int64_t t_begin = begin + std::min(len, part * chunk);
        const int64_t t_end = std::min(end, t_begin + chunk);
        attend_part(q.data(), key_cache, value_cache, pg, t_begin, t_end, num_kv_heads, cap,
                    row.data(), scores, parts, task);
      }
    }
    if (splits > 1) {
#pragma omp for schedule(static)
      for (int64_t seq = 0; seq < num_seqs; ++seq) parts.merge(seq, out, acc.data());
    }
  }
}

// The caches as kv_kind says (kv_quant.h): in the query's dtype T, or 8-bit.
template <typename T>
void decode_dispatch(const T* q, const void* kc, const void* vc, const int32_t* bt,
                     const int32_t* sl, const int32_t* qsl, T* out, int64_t n, int64_t h,
                     int64_t hkv, int64_t d, int64_t bs, int64_t bts, float scale,
                     int64_t kv_kind, int64_t window, float cap) {
  if (kv_kind == kKvNative) {
    const KvCache<T> k{static_cast<const T*>(kc), d}, v{static_cast<const T*>(vc), d};
    decode(q, k, v, bt, sl, qsl, out, n, h, hkv, d, bs, bts, scale, window, cap);
  } else {
    const KvCache<uint8_t> k{static_cast<const uint8_t*>(kc), d, kv_kind};
    const KvCache<uint8_t> v{static_cast<const uint8_t*>(vc), d, kv_kind};
    decode(q, k, v, bt, sl, qsl, out, n, h, hkv, d, bs, bts, scale, window, cap);
  }
}

}  // namespace

extern "C" {

// All tensors contiguous: query/out [num_queries, num_heads, head_size]; caches [num_blocks,
// block_size, num_kv_heads, head_size] in the query's dtype (kv_kind 0), or 8-bit with rows of
// head_size + 4 (kv_kind 1-3, kv_quant.h); block_table [num_seqs, block_table_stride] int32;
// seq_lens [num_seqs] int32, each >= its number of queries; qsl [num_seqs + 1] int32 or null;
// window: sliding window in tokens (0: none); cap: attention-logit soft cap (0: none).
void paged_decode_attention_f32(const float* q, const void* kc, const void* vc,
                                const int32_t* bt, const int32_t* sl, const int32_t* qsl,
                                float* out, int64_t n, int64_t h, int64_t hkv, int64_t d,
                                int64_t bs, int64_t bts, float scale, int64_t kv_kind,
                                int64_t window, float cap) {
  decode_dispatch(q, kc, vc, bt, sl, qsl, out, n, h, hkv, d, bs, bts, scale, kv_kind, window,
                  cap);
}

void paged_decode_attention_bf16(const uint16_t* q, const void* kc, const void* vc,
                                 const int32_t* bt, const int32_t* sl, const int32_t* qsl,
                                 uint16_t* out, int64_t n, int64_t h, int64_t hkv, int64_t d,
                                 int64_t bs, int64_t bts, float scale, int64_t kv_kind,
                                 int64_t window, float cap) {
  decode_dispatch(q, kc, vc, bt, sl, qsl, out, n, h, hkv, d, bs, bts, scale, kv_kind, window,
                  cap);
}

}  // extern "C"
