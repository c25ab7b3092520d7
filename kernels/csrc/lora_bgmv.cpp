// Batched LoRA deltas for mixed batches, Punica's BGMV (Chen et al., "Punica", 2023; vLLM's
// csrc/punica and vllm/lora/ops): each token row gathers its own adapter's A and B by slot.
//
//   shrink  h[t, j]              = x[t, :] . A[slot[t], j, :]          j < PR (parts x rank)
//   expand  y[t, y_off + o]     += h[t, h_off : h_off + R] . B[slot[t], o, :]
//
// slot -1: no adapter (h row zero, y untouched). x, A, B, y in T (float32 or bfloat16),
// h float32; every product sums in float32 (vector lanes of simd.h, then a scalar tail).
// OpenMP over rows x outputs once a step is large enough to pay for waking the threads.

#include <omp.h>

#include <cstdint>
#include <vector>

#include "convert.h"
#include "simd.h"

namespace {

// Multiply-adds below which one thread runs: a decode step's (8 rows: ~0.1-0.3 M) costs
// less than waking OpenMP's threads, on a loaded machine by far.
constexpr int64_t kParallelMin = 1 << 20;

// a . b over n elements in float32; each side float, bfloat16 or the activations' type.
template <typename A, typename B>
inline float dot(const A* a, const B* b, int64_t n) {
  int64_t i = 0;
  float sum = 0.f;
#if PAGEDSERVE_SIMD
  Vec::F acc = Vec::zero();
  for (; i + Vec::W <= n; i += Vec::W) acc = Vec::fmadd(Vec::load(a + i), Vec::load(b + i), acc);
  sum = Vec::reduce_add(acc);
#endif
  for (; i < n; ++i) sum += load(a[i]) * load(b[i]);
  return sum;
}

template <typename T>
void shrink(float* h, const T* x, const T* a, const int32_t* slots, int64_t rows, int64_t pr,
            int64_t in) {
  const bool par = rows * pr * in >= kParallelMin;
#pragma omp parallel for collapse(2) schedule(static) if (par)
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t j = 0; j < pr; ++j) {
      const int32_t s = slots[t];
      h[t * pr + j] = s < 0 ? 0.f : dot(x + t * in, a + (int64_t(s) * pr + j) * in, in);
    }
  }
}

template <typename T>
void expand(T* y, const float* h, const T* b, const int32_t* slots, int64_t rows, int64_t out,
            int64_t rank, int64_t h_stride, int64_t h_off, int64_t y_stride, int64_t y_off) {
  const bool par = rows * out * rank >= kParallelMin;
#pragma omp parallel for collapse(2) schedule(static) if (par)
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t o = 0; o < out; ++o) {
      const int32_t s = slots[t];
      if (s < 0) continue;
      T* dst = y + t * y_stride + y_off + o;
      const float d = dot(h + t * h_stride + h_off, b + (int64_t(s) * out + o) * rank, rank);
      store(load(*dst) + d, dst);
    }
  }
}

// shrink then expand for every part at once, from B transposed per slot, bt [L, R, out]:
// y[t, o] += sum_r h[t, part(o) R + r] bt[s, r, o], part(o) = how many of the boundaries
// b1 <= b2 lie at or below o (at most 3 parts: q/k/v, gate/up, or one). The expand runs
// along o (contiguous in bt: full vectors, where R = 8..16 would leave a B row's dot all
// scalar tail), into a float32 row rounded once. One call per linear layer: the Python
// overhead of a call per part was most of a decode step's LoRA cost.
template <typename T>
void bgmv(T* y, const T* x, const T* a, const T* bt, const int32_t* slots, int64_t rows,
          int64_t in, int64_t pr, int64_t out, int64_t rank, int64_t y_stride, int64_t b1,
          int64_t b2) {
  std::vector<float> h(rows * pr);
  shrink(h.data(), x, a, slots, rows, pr, in);
  const int64_t bounds[4] = {0, b1, b2, out};
  const bool par = rows * out * rank >= kParallelMin;
#pragma omp parallel for schedule(static) if (par)
  for (int64_t t = 0; t < rows; ++t) {
    const int32_t s = slots[t];
    if (s < 0) continue;
    std::vector<float> acc(out);
    T* yrow = y + t * y_stride;
    widen(yrow, acc.data(), out);
    for (int p = 0; p < 3; ++p) {
      const int64_t lo = bounds[p], n = bounds[p + 1] - lo;
      if (n <= 0) continue;
      for (int64_t r = 0; r < rank; ++r) {
        const float hv = h[t * pr + p * rank + r];
        const T* brow = bt + (int64_t(s) * rank + r) * out + lo;
        float* dst = acc.data() + lo;
        int64_t i = 0;
#if PAGEDSERVE_SIMD
        const Vec::F hvv = Vec::set1(hv);
        for (; i + Vec::W <= n; i += Vec::W)
          Vec::store(Vec::fmadd(hvv, Vec::load(brow + i), Vec::load(dst + i)), dst + i);
#endif
        for (; i < n; ++i) dst[i] += hv * load(brow[i]);
      }
    }
    for (int64_t o = 0; o < out; ++o) store(acc[o], yrow + o);
  }
}

}  // namespace

extern "C" {

#define PAGEDSERVE_LORA(SUFFIX, T)                                                             \
  void lora_shrink_##SUFFIX(float* h, const T* x, const T* a, const int32_t* slots,            \
                            int64_t rows, int64_t pr, int64_t in) {                            \
    shrink(h, x, a, slots, rows, pr, in);                                                      \
  }                                                                                            \
  void lora_expand_##SUFFIX(T* y, const float* h, const T* b, const int32_t* slots,            \
                            int64_t rows, int64_t out, int64_t rank, int64_t h_stride,         \
                            int64_t h_off, int64_t y_stride, int64_t y_off) {                  \
    expand(y, h, b, slots, rows, out, rank, h_stride, h_off, y_stride, y_off);                 \
  }                                                                                            \
  void lora_bgmv_##SUFFIX(T* y, const T* x, const T* a, const T* bt, const int32_t* slots,      \
                          int64_t rows, int64_t in, int64_t pr, int64_t out, int64_t rank,     \
                          int64_t y_stride, int64_t b1, int64_t b2) {                          \
    bgmv(y, x, a, bt, slots, rows, in, pr, out, rank, y_stride, b1, b2);                        \
  }

PAGEDSERVE_LORA(f32, float)
PAGEDSERVE_LORA(bf16, uint16_t)

}  // extern "C"
