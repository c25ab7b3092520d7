// Batched LoRA deltas for mixed batches, Punica's BGMV (Chen et al., "Punica", 2023; vLLM's
// csrc/punica and vllm/lora/ops): each token row gathers its own adapter's A and B by slot.
//
//   shrink  h[t, j]  = x[t, :] . A[slot[t], j, :]                 j < PR (parts x rank)
//   expand  y[t, o] += h[t, p R : p R + R] . Bt[slot[t], :, o]    o in part p's outputs
//
// One call per linear layer, for all its parts (q/k/v, gate/up, or one): Bt is the parts' B
// concatenated and transposed per slot, [L, R, out], so the expand runs along o with full
// vectors. slot -1: no adapter (y untouched). x, A, Bt, y in T (float32 or bfloat16), h
// float32; every product sums in float32 (vector lanes of simd.h, then a scalar tail), and y
// is rounded once.
//
// Rows are cut into tiles of up to kTileRows rows sharing a slot (SGMV's segments, Punica's
// "same adapter" batching), so a tile reads each row of A and Bt once for all its rows, and the
// shrink runs 4 to 8 dot products at a time (independent FMA chains; x loaded once for them).
// Each dot sums in the same order as a plain one (vector lanes, their sum, the tail), so the
// tiling changes no result bit. Tiles x output blocks run under OpenMP only for a prefill's
// rows: at a decode step's (8 rows: ~0.1-0.3 M multiply-adds per layer) a second thread saved
// nothing measurable with the pool awake, and cost ~60 us per layer where libgomp had put it to
// sleep (more OpenMP threads than cores, as with two engines in one process).

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "convert.h"
#include "simd.h"

namespace {

// A shrink pass holds rows x dots vector accumulators: 4 x 4 at most, or 2 x 8 (a decode
// step's tiles: 8 rows over 4 adapters) where 32 registers leave room; 8 rows of A streamed
// at once gave ~10% over 4 on a step whose adapters come from memory.
#if PAGEDSERVE_SIMD
constexpr int kTileRows = Vec::kRegs >= 32 ? 4 : 2;
constexpr int kWideRows = Vec::kRegs >= 32 ? 2 : 0;  // tiles of at most this many: 8 dots
#else
constexpr int kTileRows = 4;
constexpr int kWideRows = 0;
#endif
constexpr int kTileJ = 8;  // a shrink work item's dots
constexpr int64_t kOutBlock = 512;  // outputs of one expand work item
// Multiply-adds below which one thread runs (see above).
constexpr int64_t kParallelMin = 1 << 20;

struct Tile {
  int32_t slot, n;
  int32_t rows[kTileRows];
};

// The rows with an adapter, slot by slot in order of first appearance, kTileRows at a time.
std::vector<Tile> tiles_of(const int32_t* slots, int64_t rows) {
  std::vector<Tile> tiles;
  std::vector<char> done(rows, 0);
  for (int64_t t = 0; t < rows; ++t) {
    if (slots[t] < 0 || done[t]) continue;
    Tile cur{slots[t], 0, {}};
    for (int64_t u = t; u < rows; ++u) {
      if (slots[u] != cur.slot) continue;
      done[u] = 1;
      cur.rows[cur.n++] = static_cast<int32_t>(u);
      if (cur.n == kTileRows) {
        tiles.push_back(cur);
        cur.n = 0;
      }
    }
    if (cur.n > 0) tiles.push_back(cur);
  }
  return tiles;
}

// h[row, j0 + k] for the tile's RB rows and JB outputs from j0.
template <int RB, int JB, typename T>
void shrink_tile(float* h, int64_t pr, const T* x, int64_t in, const Tile& tile, const T* a,
                 int64_t j0) {
  const T* xr[RB];
  const T* aj[JB];
  for (int i = 0; i < RB; ++i) xr[i] = x + int64_t(tile.rows[i]) * in;
  for (int k = 0; k < JB; ++k) aj[k] = a + (int64_t(tile.slot) * pr + j0 + k) * in;
  float sum[RB][JB] = {};
  int64_t e = 0;
#if PAGEDSERVE_SIMD
  Vec::F acc[RB][JB];
  for (int i = 0; i < RB; ++i)
    for (int k = 0; k < JB; ++k) acc[i][k] = Vec::zero();
  for (; e + Vec::W <= in; e += Vec::W) {
    Vec::F xv[RB];
    for (int i = 0; i < RB; ++i) xv[i] = Vec::load(xr[i] + e);
    for (int k = 0; k < JB; ++k) {
      const Vec::F av = Vec::load(aj[k] + e);
      for (int i = 0; i < RB; ++i) acc[i][k] = Vec::fmadd(xv[i], av, acc[i][k]);
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int k = 0; k < JB; ++k) sum[i][k] = Vec::reduce_add(acc[i][k]);
#endif
  for (; e < in; ++e)
    for (int i = 0; i < RB; ++i)
      for (int k = 0; k < JB; ++k) sum[i][k] += load(xr[i][e]) * load(aj[k][e]);
  for (int i = 0; i < RB; ++i)
    for (int k = 0; k < JB; ++k) h[int64_t(tile.rows[i]) * pr + j0 + k] = sum[i][k];
}

template <int RB, typename T>
void shrink_rows(float* h, int64_t pr, const T* x, int64_t in, const Tile& tile, const T* a,
                 int64_t j0) {
  const int64_t j1 = std::min<int64_t>(pr, j0 + kTileJ);
  if constexpr (RB <= kWideRows) {
    switch (j1 - j0) {
      case 8: return shrink_tile<RB, 8>(h, pr, x, in, tile, a, j0);
      case 7: return shrink_tile<RB, 7>(h, pr, x, in, tile, a, j0);
      case 6: return shrink_tile<RB, 6>(h, pr, x, in, tile, a, j0);
      case 5: return shrink_tile<RB, 5>(h, pr, x, in, tile, a, j0);
      default: break;
    }
  }
  for (int64_t j = j0; j < j1; j += 4) {
    switch (std::min<int64_t>(j1 - j, 4)) {
      case 4: shrink_tile<RB, 4>(h, pr, x, in, tile, a, j); break;
      case 3: shrink_tile<RB, 3>(h, pr, x, in, tile, a, j); break;
      case 2: shrink_tile<RB, 2>(h, pr, x, in, tile, a, j); break;
      default: shrink_tile<RB, 1>(h, pr, x, in, tile, a, j); break;
    }
  }
}

template <typename T>
void shrink_item(float* h, int64_t pr, const T* x, int64_t in, const Tile& tile, const T* a,
                 int64_t j0) {
  switch (tile.n) {
    case 1: return shrink_rows<1>(h, pr, x, in, tile, a, j0);
    case 2: return shrink_rows<2>(h, pr, x, in, tile, a, j0);
    case 3: return shrink_rows<3>(h, pr, x, in, tile, a, j0);
    default: return shrink_rows<kTileRows>(h, pr, x, in, tile, a, j0);
  }
}

// y[row, o] += h[row, h_off : h_off + rank] . bt[slot, :, o] for o in [o0, o1), the tile's rows:
// y first, then each rank's product in order, rounded once.
template <int RB, typename T>
void expand_tile(T* y, int64_t y_stride, const float* h, int64_t pr, const T* bt, int64_t out,
                 int64_t rank, const Tile& tile, int64_t h_off, int64_t o0, int64_t o1) {
  T* yr[RB];
  const float* hr[RB];
  for (int i = 0; i < RB; ++i) {
    yr[i] = y + int64_t(tile.rows[i]) * y_stride;
    hr[i] = h + int64_t(tile.rows[i]) * pr + h_off;
  }
  const T* b = bt + int64_t(tile.slot) * rank * out;
  int64_t o = o0;
#if PAGEDSERVE_SIMD
  for (; o + Vec::W <= o1; o += Vec::W) {
    Vec::F acc[RB];
    for (int i = 0; i < RB; ++i) acc[i] = Vec::load(yr[i] + o);
    for (int64_t r = 0; r < rank; ++r) {
      const Vec::F bv = Vec::load(b + r * out + o);
      for (int i = 0; i < RB; ++i) acc[i] = Vec::fmadd(Vec::set1(hr[i][r]), bv, acc[i]);
    }
    for (int i = 0; i < RB; ++i) Vec::store(acc[i], yr[i] + o);
  }
#endif
  for (; o < o1; ++o) {
    for (int i = 0; i < RB; ++i) {
      float acc = load(yr[i][o]);
      for (int64_t r = 0; r < rank; ++r) acc += hr[i][r] * load(b[r * out + o]);
      store(acc, yr[i] + o);
    }
  }
}

template <typename T>
void expand_item(T* y, int64_t y_stride, const float* h, int64_t pr, const T* bt, int64_t out,
                 int64_t rank, const Tile& tile, int64_t h_off, int64_t o0, int64_t o1) {
  switch (tile.n) {
    case 1: return expand_tile<1>(y, y_stride, h, pr, bt, out, rank, tile, h_off, o0, o1);
    case 2: return expand_tile<2>(y, y_stride, h, pr, bt, out, rank, tile, h_off, o0, o1);
    case 3: return expand_tile<3>(y, y_stride, h, pr, bt, out, rank, tile, h_off, o0, o1);
    default:
      return expand_tile<kTileRows>(y, y_stride, h, pr, bt, out, rank, tile, h_off, o0, o1);
  }
}

struct Block {
  int64_t part, o0, o1;
};

// Output blocks of at most kOutBlock, none across a part's end (bounds: parts + 1 offsets).
std::vector<Block> blocks_of(const int64_t* bounds, int64_t parts) {
  std::vector<Block> blocks;
  for (int64_t p = 0; p < parts; ++p)
    for (int64_t o = bounds[p]; o < bounds[p + 1]; o += kOutBlock)
      blocks.push_back({p, o, std::min(o + kOutBlock, bounds[p + 1])});
  return blocks;
}

template <typename T>
void bgmv(T* y, const T* x, const T* a, const T* bt, const int32_t* slots,
          const int64_t* bounds, int64_t parts, int64_t rows, int64_t in, int64_t pr,
          int64_t out, int64_t rank, int64_t y_stride) {
  const std::vector<Tile> tiles = tiles_of(slots, rows);
  if (tiles.empty()) return;
  const std::vector<Block> blocks = blocks_of(bounds, parts);
  std::vector<float> h(rows * pr);
  const int64_t nt = tiles.size(), nj = (pr + kTileJ - 1) / kTileJ, nb = blocks.size();
  int64_t active = 0;
  for (const Tile& tile : tiles) active += tile.n;
  const bool par = active * (pr * in + rank * out) >= kParallelMin;
#pragma omp parallel if (par)
  {
#pragma omp for schedule(static)
    for (int64_t item = 0; item < nt * nj; ++item)
      shrink_item(h.data(), pr, x, in, tiles[item / nj], a, (item % nj) * kTileJ);
#pragma omp for schedule(static)
    for (int64_t item = 0; item < nt * nb; ++item) {
      const Block& blk = blocks[item % nb];
      expand_item(y, y_stride, h.data(), pr, bt, out, rank, tiles[item / nb],
                  blk.part * rank, blk.o0, blk.o1);
    }
  }
}

}  // namespace

extern "C" {

#define PAGEDSERVE_LORA(SUFFIX, T)                                                             \
  void lora_bgmv_##SUFFIX(T* y, const T* x, const T* a, const T* bt, const int32_t* slots,      \
                          const int64_t* bounds, int64_t parts, int64_t rows, int64_t in,      \
                          int64_t pr, int64_t out, int64_t rank, int64_t y_stride) {           \
    bgmv(y, x, a, bt, slots, bounds, parts, rows, in, pr, out, rank, y_stride);                \
  }

PAGEDSERVE_LORA(f32, float)
PAGEDSERVE_LORA(bf16, uint16_t)

}  // extern "C"
