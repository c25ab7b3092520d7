// The cpu_ops library: our CPU kernels behind a plain C ABI over raw pointers, called through
// ctypes (kernels/cpu_ops.py, kernels/gguf_ops.py). No torch headers, so a variant compiles in
// a few seconds. One library per ISA tier, each from the same sources with its own flags
// (kernels/cpu_isa.py): generic (portable loops), avx2 (AVX2 + FMA + F16C, 8 lanes) and
// avx512 (AVX-512 F/BW/DQ/VL, 16 lanes); the loader picks the best one the CPU runs.
//
//   decode_attention.cpp   paged decode attention (split long contexts, drafts)
//   prefill_attention.cpp  flash-style prefill attention over the paged cache
//   elementwise.cpp        RMSNorm (+ residual), SiLU-and-mul, RoPE, reshape_and_cache
//   gguf_gemm.cpp          products with Q4_0 / Q4_1 / Q8_0 blocks
//   lora_bgmv.cpp          batched LoRA deltas, each row its own adapter (Punica's BGMV)
//   simd.h, convert.h      the per-ISA vector helpers and the bfloat16 conversions
//
// Everything computes in float32 and rounds once to the tensor's dtype; OpenMP threads over
// sequences / rows, sharing the libgomp (and the thread count) torch already loaded.

#include "simd.h"

extern "C" {

// The tier this library was compiled for; the loader checks it is the one it asked for.
const char* cpu_ops_isa() {
#if defined(PAGEDSERVE_AVX512)
  return "avx512";
#elif defined(PAGEDSERVE_AVX2)
  return "avx2";
#else
  return "generic";
#endif
}

}  // extern "C"
