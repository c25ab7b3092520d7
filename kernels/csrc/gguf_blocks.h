// GGUF's quantized block formats, as llama.cpp lays them out (ggml-common.h), and the panel
// layout the int8 kernel reads them in (gguf_q8_gemm.cpp). Both kernels see a block as 32-weight
// sub-blocks: integer codes c[32] and two floats with weight = dw * c + mw, which is how
// gguf-py's quants.dequantize computes every type here (an exact product plus at most one
// rounding), so fma(dw, c, mw) is bit-equal to it:
//
//   type  id  weights bytes  per 32-weight sub-block s
//   Q4_0   2   32     18     c = nibble - 8,            dw = d
//   Q4_1   3   32     20     c = nibble,                dw = d,       mw = m
//   Q5_0   6   32     22     c = (nibble | h << 4) - 16, dw = d
//   Q5_1   7   32     24     c = nibble | h << 4,       dw = d,       mw = m
//   Q8_0   8   32     34     c = int8,                  dw = d
//   Q4_K  12  256    144     c = nibble,                dw = d * sc_s, mw = -(dmin * m_s)
//   Q5_K  13  256    176     c = nibble | h << 4,       dw = d * sc_s, mw = -(dmin * m_s)
//   Q6_K  14  256    210     c = sc_t * (q6 - 32),      dw = d        (t: the 16-weight group)
//
// (d, dmin, m: fp16; sc_s, m_s: 6-bit, packed 8 + 8 in 12 bytes; Q6_K's sc_t: int8 per 16.)
//
// Four more types only the exact kernel reads (in place, through the scalar decoder; the int8
// kernel has no panels for them, so their layers run exact in every mode):
//
//   Q2_K   10  256     84     w = fma(d * sc_t, q2, -(dmin * m_t))  (sc_t, m_t: 4-bit per 16)
//   Q3_K   11  256    110     w = d * sc_t * (q2 - 4 * !hbit)       (sc_t: 6-bit - 32, per 16)
//   IQ4_NL 20   32     18     w = d * kv[nibble]                    (kv: kvalues_iq4nl)
//   IQ4_XS 23  256    136     w = (d * sc_s) * kv[nibble]           (sc_s: 6-bit - 32, per 32)
// The K-quant products dw = d * sc and d * sc * (q6 - 32) are exact in float32 (at most 24
// significant bits), as in gguf-py.
//
// A panel holds PR = 16 consecutive rows; per block of the row, its region is PR * packed_bytes:
// the rows' code bytes (the nibbles / int8s) interleaved 4 bytes at a time (row r's bytes
// 4g..4g+3 at g * 64 + r * 4), then their high-bit bytes (Q5_*, Q5_K, Q6_K) the same way, then
// a tail: Q4_0/Q4_1/Q5_*/Q8_0: 16 fp16 d (then 16 fp16 m); Q4_K/Q5_K: the 6-bit scales decoded
// to bytes, sc[8][16] and m[8][16], then 16 fp16 d and 16 fp16 dmin (4 bytes per row more than
// the file's 12 packed ones: 148 and 180 per block); Q6_K: sc[16][16] int8, then 16 fp16 d.
// One int32 lane per row then takes four byte products at a time against 4 broadcast
// activation codes (gguf_q8_gemm.cpp), with the per-row scales one vector load away.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "simd.h"  // fp16()

namespace {

constexpr int64_t QK = 32, PR = 16;  // weights per sub-block; rows per panel
enum : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11,
                 Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23 };

// The types with int8 panels (gguf_q8_gemm.cpp).
constexpr bool known_type(int64_t t) {
  return t == Q4_0 || t == Q4_1 || t == Q5_0 || t == Q5_1 || t == Q8_0 || t == Q4_K ||
         t == Q5_K || t == Q6_K;
}
constexpr bool exact_only(int64_t t) {
  return t == Q2_K || t == Q3_K || t == IQ4_NL || t == IQ4_XS;
}
constexpr bool k_quant(int64_t t) { return t == Q4_K || t == Q5_K || t == Q6_K; }
constexpr int64_t block_weights(int64_t t) {
  return k_quant(t) || t == Q2_K || t == Q3_K || t == IQ4_XS ? 256 : 32;
}
constexpr int64_t block_bytes(int64_t t) {
  return t == Q4_0 ? 18 : t == Q4_1 ? 20 : t == Q5_0 ? 22 : t == Q5_1 ? 24 : t == Q8_0 ? 34
       : t == Q4_K ? 144 : t == Q5_K ? 176 : t == Q6_K ? 210 : t == Q2_K ? 84 : t == Q3_K ? 110
       : t == IQ4_NL ? 18 : 136;
}
constexpr int64_t packed_bytes(int64_t t) {
  return t == Q4_K ? 148 : t == Q5_K ? 180 : block_bytes(t);
}
// Per row of a panel: code bytes, high-bit bytes.
constexpr int64_t code_bytes(int64_t t) { return t == Q8_0 ? 32 : k_quant(t) ? 128 : 16; }
constexpr int64_t high_bytes(int64_t t) {
  return t == Q5_0 || t == Q5_1 ? 4 : t == Q5_K ? 32 : t == Q6_K ? 64 : 0;
}
constexpr int64_t high_off(int64_t t) { return PR * code_bytes(t); }
constexpr int64_t tail_off(int64_t t) { return PR * (code_bytes(t) + high_bytes(t)); }
// Where the file's block keeps them.
constexpr int64_t file_code_off(int64_t t) {
  return t == Q4_1 ? 4 : t == Q5_0 ? 6 : t == Q5_1 ? 8 : t == Q4_K ? 16 : t == Q5_K ? 48
       : t == Q6_K ? 0 : 2;
}
constexpr int64_t file_high_off(int64_t t) {
  return t == Q5_0 ? 2 : t == Q5_1 ? 4 : t == Q5_K ? 16 : t == Q6_K ? 128 : 0;
}

// Q4_K / Q5_K: the 6-bit scale and minimum of sub-block s from the 12 packed bytes.
inline void k_scale_min(const uint8_t* p, int s, int& sc, int& m) {
  if (s < 4) {
    sc = p[s] & 63;
    m = p[s + 4] & 63;
  } else {
    sc = (p[s + 4] & 15) | ((p[s - 4] >> 6) << 4);
    m = (p[s + 4] >> 4) | ((p[s] >> 6) << 4);
  }
}

// A block's bytes as the file stores them.
struct FileBlock {
  const uint8_t* b;
  int64_t t;
  uint8_t code(int64_t i) const { return b[file_code_off(t) + i]; }
  uint8_t high(int64_t i) const { return b[file_high_off(t) + i]; }
  float d() const { return fp16(b + (t == Q6_K ? 208 : 0)); }
  float m() const { return fp16(b + 2); }  // Q4_1 / Q5_1's minimum, Q4_K / Q5_K's dmin
  void scale_min(int s, int& sc, int& mn) const { k_scale_min(b + 4, s, sc, mn); }
  int q6_scale(int g) const { return static_cast<int8_t>(b[192 + g]); }
};

// Row ``lane``'s block inside a panel's region (see the layout above).
struct PanelBlock {
  const uint8_t* b;
  int64_t t, lane;
  uint8_t code(int64_t i) const { return b[(i / 4) * 64 + lane * 4 + i % 4]; }
  uint8_t high(int64_t i) const { return b[high_off(t) + (i / 4) * 64 + lane * 4 + i % 4]; }
  const uint8_t* tail() const { return b + tail_off(t); }
  float d() const { return fp16(tail() + (k_quant(t) ? 256 : 0) + lane * 2); }
  float m() const { return fp16(tail() + (k_quant(t) ? 288 : 32) + lane * 2); }
  void scale_min(int s, int& sc, int& mn) const {
    sc = tail()[s * 16 + lane];
    mn = tail()[128 + s * 16 + lane];
  }
  int q6_scale(int g) const { return static_cast<int8_t>(tail()[g * 16 + lane]); }
};

// Sub-block s (0 .. block_weights / 32 - 1) of a block, either layout.
template <class B>
inline void decode_sub(const B& blk, int s, int32_t* c, float& dw, float& mw) {
  const int64_t t = blk.t;
  mw = 0.f;
  switch (t) {
    case Q8_0:
      for (int l = 0; l < 32; ++l) c[l] = static_cast<int8_t>(blk.code(l));
      dw = blk.d();
      return;
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: {
      uint32_t h = 0;
      if (t == Q5_0 || t == Q5_1)
        for (int i = 0; i < 4; ++i) h |= static_cast<uint32_t>(blk.high(i)) << (8 * i);
      const int bias = t == Q4_0 ? 8 : t == Q5_0 ? 16 : 0;
      for (int l = 0; l < 32; ++l) {
        const int nib = l < 16 ? blk.code(l) & 15 : blk.code(l - 16) >> 4;
        c[l] = (nib | static_cast<int>((h >> l) & 1) << 4) - bias;
      }
      dw = blk.d();
      if (t == Q4_1 || t == Q5_1) mw = blk.m();
      return;
    }
    case Q4_K: case Q5_K: {
      const int j = s / 2, shift = 4 * (s % 2);
      for (int l = 0; l < 32; ++l) {
        c[l] = (blk.code(32 * j + l) >> shift) & 15;
        if (t == Q5_K) c[l] |= ((blk.high(l) >> s) & 1) << 4;
      }
      int sc, mn;
      blk.scale_min(s, sc, mn);
      dw = blk.d() * static_cast<float>(sc);
      mw = -(blk.m() * static_cast<float>(mn));
      return;
    }
    default: {  // Q6_K
      const int h = s / 4, s4 = s % 4, shift = 4 * (s4 >> 1);
      for (int l = 0; l < 32; ++l) {
        const int q = ((blk.code(64 * h + 32 * (s4 & 1) + l) >> shift) & 15) |
                      ((blk.high(32 * h + l) >> (2 * s4)) & 3) << 4;
        c[l] = blk.q6_scale(2 * s + l / 16) * (q - 32);
      }
      dw = blk.d();
      return;
    }
  }
}

// Sub-block s's 32 weights as float32, bit-equal to gguf-py's de-quantization.
template <class B>
inline void dequant_sub(const B& blk, int s, float* dst) {
  int32_t c[32];
  float dw, mw;
  decode_sub(blk, s, c, dw, mw);
  for (int l = 0; l < 32; ++l) dst[l] = std::fma(dw, static_cast<float>(c[l]), mw);
}

constexpr int8_t kIQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                               1,    13,   25,  38,  53,  69,  89,  113};

// Sub-block s's 32 weights of an exact-only type's file block ``b`` (see the table above),
// bit-equal to gguf-py: one exact product (and Q2_K's one rounding subtraction) per weight.
inline void dequant_sub_exact_only(const uint8_t* b, int64_t t, int s, float* dst) {
  switch (t) {
    case Q2_K: {  // scales[16] qs[64] d dmin; q2 of weight 32 s + l: qs[32 (s / 4) + l] >> 2 (s % 4)
      const float d = fp16(b + 80), dmin = fp16(b + 82);
      const uint8_t* q = b + 16 + 32 * (s / 4);
      const int shift = 2 * (s % 4);
      for (int h = 0; h < 2; ++h) {
        const int sc = b[2 * s + h];
        const float dl = d * static_cast<float>(sc & 15), ml = -(dmin * static_cast<float>(sc >> 4));
        for (int l = 16 * h; l < 16 * h + 16; ++l)
          dst[l] = std::fma(dl, static_cast<float>((q[l] >> shift) & 3), ml);
      }
      return;
    }
    case Q3_K: {  // hmask[32] qs[64] scales[12] d
      const float d = fp16(b + 108);
      const uint8_t *sc = b + 96, *q = b + 32 + 32 * (s / 4);
      const int shift = 2 * (s % 4);
      for (int h = 0; h < 2; ++h) {
        const int g = 2 * s + h;
        const int lo = g < 8 ? sc[g] & 15 : sc[g - 8] >> 4, hi = (sc[8 + g % 4] >> (2 * (g / 4))) & 3;
        const float dl = d * static_cast<float>((lo | hi << 4) - 32);
        for (int l = 16 * h; l < 16 * h + 16; ++l) {
          const int v = ((q[l] >> shift) & 3) - (((b[l] >> s) & 1) ? 0 : 4);
          dst[l] = dl * static_cast<float>(v);
        }
      }
      return;
    }
    case IQ4_NL: {  // d qs[16]
      const float d = fp16(b);
      for (int l = 0; l < 16; ++l) {
        dst[l] = d * static_cast<float>(kIQ4NL[b[2 + l] & 15]);
        dst[l + 16] = d * static_cast<float>(kIQ4NL[b[2 + l] >> 4]);
      }
      return;
    }
    default: {  // IQ4_XS: d scales_h(u16) scales_l[4] qs[128]
      const int h = (b[2] | b[3] << 8) >> (2 * s) & 3, lo = (b[4 + s / 2] >> (4 * (s % 2))) & 15;
      const float dl = fp16(b) * static_cast<float>((lo | h << 4) - 32);
      const uint8_t* q = b + 8 + 16 * s;
      for (int l = 0; l < 16; ++l) {
        dst[l] = dl * static_cast<float>(kIQ4NL[q[l] & 15]);
        dst[l + 16] = dl * static_cast<float>(kIQ4NL[q[l] >> 4]);
      }
      return;
    }
  }
}

// A file row's 32-weight sub-block i (over the whole row).
inline void dequant_row_sub(int64_t t, const uint8_t* row, int64_t i, float* dst) {
  const int64_t per = block_weights(t) / QK;
  const uint8_t* b = row + i / per * block_bytes(t);
  if (exact_only(t)) return dequant_sub_exact_only(b, t, static_cast<int>(i % per), dst);
  dequant_sub(FileBlock{b, t}, static_cast<int>(i % per), dst);
}

// One row's block into its panel region at ``lane``.
inline void repack_block(int64_t t, const uint8_t* blk, uint8_t* dst, int64_t lane) {
  for (int64_t g = 0; g < code_bytes(t) / 4; ++g)
    std::memcpy(dst + g * 64 + lane * 4, blk + file_code_off(t) + g * 4, 4);
  for (int64_t g = 0; g < high_bytes(t) / 4; ++g)
    std::memcpy(dst + high_off(t) + g * 64 + lane * 4, blk + file_high_off(t) + g * 4, 4);
  uint8_t* tail = dst + tail_off(t);
  if (t == Q6_K) {
    for (int g = 0; g < 16; ++g) tail[g * 16 + lane] = blk[192 + g];
    std::memcpy(tail + 256 + lane * 2, blk + 208, 2);
  } else if (k_quant(t)) {
    for (int s = 0; s < 8; ++s) {
      int sc, mn;
      k_scale_min(blk + 4, s, sc, mn);
      tail[s * 16 + lane] = static_cast<uint8_t>(sc);
      tail[128 + s * 16 + lane] = static_cast<uint8_t>(mn);
    }
    std::memcpy(tail + 256 + lane * 2, blk, 2);
    std::memcpy(tail + 288 + lane * 2, blk + 2, 2);
  } else {
    std::memcpy(tail + lane * 2, blk, 2);
    if (t == Q4_1 || t == Q5_1) std::memcpy(tail + 32 + lane * 2, blk + 2, 2);
  }
}

}  // namespace
