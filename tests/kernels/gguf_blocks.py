"""Random GGUF blocks of every type our kernels read, and gguf-py's de-quantization of them
(the oracle): gguf-py's own quantizer where it has one (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), random
codes and scales with sane fp16 scales for the K-quants and IQ4 types, whose quantizers it
lacks."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from pagedserve.kernels import gguf_ops

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]  # int8 panels too
EXACT_ONLY = [Q.Q2_K, Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS]  # the exact kernel only
EXACT_TYPES = TYPES + EXACT_ONLY
# byte offset of each fp16 field in a block of random bytes -> (low, high) of its values
_K_HALVES = {Q.Q4_K: {0: (5e-4, 1e-2), 2: (5e-4, 1e-2)}, Q.Q5_K: {0: (2e-4, 5e-3),
             2: (5e-4, 1e-2)}, Q.Q6_K: {208: (1e-4, 1e-3)},
             Q.Q2_K: {80: (1e-3, 2e-2), 82: (1e-3, 2e-2)}, Q.Q3_K: {108: (1e-3, 1e-2)},
             Q.IQ4_NL: {0: (1e-3, 1e-2)}, Q.IQ4_XS: {0: (1e-4, 1e-3)}}


def block_weights(qtype) -> int:
    return gguf_ops.GGUF_BLOCK_WEIGHTS[int(qtype)]


def width(qtype, k: int) -> int:
    """``k`` rounded up to whole blocks of ``qtype`` (256 for the K-quants)."""
    bw = block_weights(qtype)
    return -(-k // bw) * bw


def random_blocks(qtype, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, k]`` weights of ``qtype``: (blocks uint8 ``[n, row_bytes]``, their float32 values
    by gguf-py's ``quants.dequantize``)."""
    rng = np.random.default_rng(seed)
    if qtype in _K_HALVES:
        bb, nb = gguf_ops.GGUF_BLOCK_BYTES[int(qtype)], k // block_weights(qtype)
        blocks = rng.integers(0, 256, (n, nb, bb), dtype=np.uint8)
        for at, (lo, hi) in _K_HALVES[qtype].items():
            halves = rng.uniform(lo, hi, (n, nb)).astype(np.float16)
            blocks[..., at:at + 2] = halves.view(np.uint8).reshape(n, nb, 2)
        blocks = blocks.reshape(n, -1)
    else:
        blocks = quants.quantize(rng.standard_normal((n, k), dtype=np.float32), qtype)
    return torch.from_numpy(blocks), torch.from_numpy(quants.dequantize(blocks, qtype))
