// Causal attention of prefill chunks over the paged cache, flash-attention style (Dao et al.,
// "FlashAttention", 2022), with V::W query rows (token x head of one GQA group) in a
// register's lanes: scores of a key for all rows are one vector, so the online softmax
// (running max, sum, rescale) is all lane-wise, with no horizontal reductions. One task per
// (sequence, kv head, V::W rows); keys V::W at a time, converted to float32 once per task.
// Built for the AVX2 (8 lanes) and AVX-512 (16 lanes) variants; the generic build refuses
// (returns 1) and the caller keeps the torch reference. Caches in the query's dtype or 8-bit
// (kv_quant.h), either way converted to float32 rows as a chunk is loaded. Ideas after vLLM's
// CPU attention.

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "convert.h"
#include "kv_quant.h"
#include "simd.h"

namespace {

#if PAGEDSERVE_SIMD
struct PrefillShape {
  int64_t group, num_heads, num_kv_heads, block_size, token_stride, block_stride;
  int64_t q_row_stride, block_table_stride;
  float scale;
  int64_t window;  // sliding window in tokens, 0: none
  float cap;       // attention-logit soft cap, 0: none
};

struct Tile {  // one task: rows r0..r0+W-1 of (token, head-in-group) for kv head kvh of seq
  int64_t seq, kvh, r0;
};

// The keys and values t0..t0+n-1 of kv head kvh as float32 rows of D; rows n..W-1 zero
// (0 * NaN would poison the sums).
template <class V, int64_t D, typename C>
inline void load_chunk(const KvCache<C>& kc, const KvCache<C>& vc, const int32_t* blocks,
                       const PrefillShape& s, int64_t kvh, int64_t t0, int64_t n, float* kf,
                       float* vf) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = t0 + i;
    const int64_t base = blocks[t / s.block_size] * s.block_stride +
                         (t % s.block_size) * s.token_stride;
    if constexpr (std::is_same_v<C, uint8_t>) {  // dequantized straight into the chunk
      kc.row(base, kvh, kf + i * D);
      vc.row(base, kvh, vf + i * D);
    } else {
      const C* k = kc.row(base, kvh, nullptr);
      const C* v = vc.row(base, kvh, nullptr);
      for (int64_t j = 0; j < D; j += V::W) {
        V::store(V::load(k + j), kf + i * D + j);
        V::store(V::load(v + j), vf + i * D + j);
      }
    }
  }
  std::fill(kf + n * D, kf + V::W * D, 0.f);
  std::fill(vf + n * D, vf + V::W * D, 0.f);
}

// One chunk of W keys against the tile's rows: scores, online-softmax update of m and l,
// acc = acc * corr + p . V. qt/acc are [D][W] (lane-minor); pos: each lane's query position.
// window > 0: a lane sees keys pos - window + 1..pos only; cap > 0: scores soft-capped.
template <class V, int64_t D>
inline void chunk_step(const float* qt, const float* kf, const float* vf, const int32_t* pos,
                       int64_t t0, int64_t n, int64_t window, float cap, float* acc,
                       typename V::F& m, typename V::F& l) {
  constexpr int W = V::W;
  typename V::F sc[W];
  for (int i = 0; i < W; ++i) sc[i] = V::zero();
  for (int64_t d = 0; d < D; ++d) {
    const typename V::F qd = V::load(qt + d * W);
    for (int i = 0; i < W; ++i) sc[i] = V::fmadd(V::set1(kf[i * D + d]), qd, sc[i]);
  }
  if (cap > 0.f)
    for (int i = 0; i < W; ++i) sc[i] = vsoftcap<V>(sc[i], cap);
  typename V::M live[W];
  typename V::F mx = m;
  for (int i = 0; i < W; ++i) {  // key t0 + i is live for lanes at or after it
    live[i] = i < n ? V::ge(pos, t0 + i) : V::none();
    if (window > 0) live[i] = V::both(live[i], V::lt(pos, t0 + i + window));
    mx = V::max_where(mx, live[i], sc[i]);
  }
  const typename V::F corr = vexp<V>(V::sub(m, mx));
  m = mx;
  l = V::mul(l, corr);
  for (int i = 0; i < W; ++i) {
    sc[i] = V::keep(live[i], vexp<V>(V::sub(sc[i], m)));
    l = V::add(l, sc[i]);
  }
  for (int64_t d = 0; d < D; ++d) {
    typename V::F a = V::mul(V::load(acc + d * W), corr);
    for (int i = 0; i < W; ++i) a = V::fmadd(V::set1(vf[i * D + d]), sc[i], a);
    V::store(a, acc + d * W);
  }
}

template <class V, int64_t D, typename T, typename C>
void prefill_tile(const T* query, const KvCache<C>& kc, const KvCache<C>& vc,
                  const int32_t* block_table,
                  const int32_t* seq_lens, const int32_t* qsl, T* out, const PrefillShape& s,
                  const Tile& tile) {
  constexpr int W = V::W;
  alignas(64) float qt[D * W];   // qt[d * W + lane]: the lane's row of q, scaled, transposed
  alignas(64) float acc[D * W];  // acc[d * W + lane]
  alignas(64) float kf[W * D];   // the chunk's keys, float32, one row per key
  alignas(64) float vf[W * D];
  const int64_t q_begin = qsl[tile.seq], q_len = qsl[tile.seq + 1] - q_begin;
  const int64_t rows = std::min<int64_t>(W, q_len * s.group - tile.r0);
  const int64_t ctx = seq_lens[tile.seq] - q_len;  // tokens before the chunk
  const int32_t* blocks = block_table + tile.seq * s.block_table_stride;
  alignas(64) int32_t pos[W];  // each lane's query position; padding lanes copy the last
  for (int64_t lane = 0; lane < W; ++lane) {
    const int64_t r = tile.r0 + std::min(lane, rows - 1);
    pos[lane] = static_cast<int32_t>(ctx + r / s.group);
    const T* src = query + (q_begin + r / s.group) * s.q_row_stride +
                   (tile.kvh * s.group + r % s.group) * D;
    for (int64_t d = 0; d < D; ++d) qt[d * W + lane] = load(src[d]) * s.scale;
  }
  std::fill(acc, acc + D * W, 0.f);
  typename V::F m = V::set1(-1e30f), l = V::zero();  // finite: -ffast-math
  const int64_t kv_end = pos[W - 1] + 1;
  // With a window the keys before the first lane's window are never read (nor their blocks).
  const int64_t kv_begin = s.window > 0 ? std::max<int64_t>(0, pos[0] - s.window + 1) : 0;
  for (int64_t t0 = kv_begin; t0 < kv_end; t0 += W) {
    const int64_t n = std::min<int64_t>(W, kv_end - t0);
    load_chunk<V, D>(kc, vc, blocks, s, tile.kvh, t0, n, kf, vf);
    chunk_step<V, D>(qt, kf, vf, pos, t0, n, s.window, s.cap, acc, m, l);
  }
  alignas(64) float inv[W];
  V::store(V::div(V::set1(1.f), l), inv);
  for (int64_t lane = 0; lane < rows; ++lane) {
    const int64_t r = tile.r0 + lane;
    T* dst = out + (q_begin + r / s.group) * s.num_heads * D +
             (tile.kvh * s.group + r % s.group) * D;
    for (int64_t d = 0; d < D; ++d) store(acc[d * W + lane] * inv[lane], dst + d);
  }
}

template <class V, int64_t D, typename T, typename C>
void prefill(const T* query, const KvCache<C>& kc, const KvCache<C>& vc,
             const int32_t* block_table,
             const int32_t* seq_lens, const int32_t* qsl, T* out, int64_t num_seqs,
             const PrefillShape& s) {
  std::vector<Tile> tiles;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t rows = (qsl[seq + 1] - qsl[seq]) * s.group;
    for (int64_t r0 = (rows - 1) / V::W * V::W; r0 >= 0; r0 -= V::W)  // longest contexts first
      for (int64_t kvh = 0; kvh < s.num_kv_heads; ++kvh) tiles.push_back({seq, kvh, r0});
  }
#pragma omp parallel for schedule(dynamic, 1)
  for (size_t i = 0; i < tiles.size(); ++i)
    prefill_tile<V, D>(query, kc, vc, block_table, seq_lens, qsl, out, s, tiles[i]);
}
#endif

#if PAGEDSERVE_SIMD
template <typename T, typename C>
int prefill_sizes(const T* q, const KvCache<C>& kc, const KvCache<C>& vc, const int32_t* bt,
                  const int32_t* sl, const int32_t* qsl, T* out, int64_t n, int64_t d,
                  const PrefillShape& s) {
  if (d == 64) {
    prefill<Vec, 64>(q, kc, vc, bt, sl, qsl, out, n, s);
    return 0;
  }
  if (d == 128) {
    prefill<Vec, 128>(q, kc, vc, bt, sl, qsl, out, n, s);
    return 0;
  }
  return 1;
}
#endif

// 0 when run, 1 when this build or head size has no kernel (the caller falls back). The
// caches as kv_kind says (kv_quant.h): in the query's dtype T, or 8-bit.
template <typename T>
int prefill_dispatch(const T* q, int64_t q_row_stride, const void* kc, const void* vc,
                     const int32_t* bt, const int32_t* sl, const int32_t* qsl, T* out, int64_t n,
                     int64_t h, int64_t hkv, int64_t d, int64_t bs, int64_t bts, float scale,
                     int64_t kv_kind, int64_t window, float cap) {
#if PAGEDSERVE_SIMD
  const int64_t row = kv_kind == kKvNative ? d : d + kScaleBytes;  // elements per head
  const PrefillShape s{h / hkv, h, hkv, bs, hkv * row, bs * hkv * row,
                       q_row_stride, bts, scale, window, cap};
  if (kv_kind == kKvNative) {
    const KvCache<T> k{static_cast<const T*>(kc), d}, v{static_cast<const T*>(vc), d};
    return prefill_sizes(q, k, v, bt, sl, qsl, out, n, d, s);
  }
  const KvCache<uint8_t> k{static_cast<const uint8_t*>(kc), d, kv_kind};
  const KvCache<uint8_t> v{static_cast<const uint8_t*>(vc), d, kv_kind};
  return prefill_sizes(q, k, v, bt, sl, qsl, out, n, d, s);
#else
  (void)q, (void)q_row_stride, (void)kc, (void)vc, (void)bt, (void)sl, (void)qsl, (void)out;
  (void)n, (void)h, (void)hkv, (void)d, (void)bs, (void)bts, (void)scale, (void)kv_kind;
  (void)window, (void)cap;
  return 1;
#endif
}

}  // namespace

extern "C" {

// query rows [T, >= num_heads * head_size] with row stride q_row_stride; out [T, num_heads,
// head_size] contiguous; the rest as paged_decode_attention with qsl required (window and
// cap included). Returns 0, or 1 when head_size is not 64 or 128 or this is the generic
// build (the caller falls back).
int paged_prefill_attention_f32(const float* q, int64_t qs, const void* kc, const void* vc,
                                const int32_t* bt, const int32_t* sl, const int32_t* qsl,
                                float* out, int64_t n, int64_t h, int64_t hkv, int64_t d,
                                int64_t bs, int64_t bts, float scale, int64_t kv_kind,
                                int64_t window, float cap) {
  return prefill_dispatch(q, qs, kc, vc, bt, sl, qsl, out, n, h, hkv, d, bs, bts, scale,
                          kv_kind, window, cap);
}

int paged_prefill_attention_bf16(const uint16_t* q, int64_t qs, const void* kc,
                                 const void* vc, const int32_t* bt, const int32_t* sl,
                                 const int32_t* qsl, uint16_t* out, int64_t n, int64_t h,
                                 int64_t hkv, int64_t d, int64_t bs, int64_t bts, float scale,
                                 int64_t kv_kind, int64_t window, float cap) {
  return prefill_dispatch(q, qs, kc, vc, bt, sl, qsl, out, n, h, hkv, d, bs, bts, scale,
                          kv_kind, window, cap);
}

// Whether this build has the prefill kernel (the AVX2 and AVX-512 variants).
int cpu_ops_has_prefill() { return PAGEDSERVE_SIMD; }

}  // extern "C"
