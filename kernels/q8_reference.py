"""The int8-activation GGUF product in torch: the same arithmetic as ``csrc/gguf_q8_gemm.cpp``
(``--cpu-linear-mode int8``), the oracle its tests compare every variant against.

Activations are quantized per block of 32 values as llama.cpp's Q8_0 (``ggml-quants.c``'s
``quantize_row_q8_0``), with a float32 scale: ``d = amax * float32(1/127)``,
``q = round_half_even(x / d)`` computed as ``x * (1 / d)``; each block's product with a weight
block is an exact integer, scaled by ``dw * d`` (and, for Q4_1, plus ``mw * (d * sum(q))``).
Integer sums are taken in float64, where they are exact (at most 32 * 127 * 128 per block).
"""

from __future__ import annotations

import torch

QK = 32
_INV_127 = torch.tensor(1.0 / 127.0, dtype=torch.float32)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` (K a multiple of 32, float32 or bfloat16 widened exactly) as int8 codes
    ``[M, K / 32, 32]`` (int32 tensor) and float32 scales ``[M, K / 32]``."""
    blocks = x.float().reshape(x.shape[0], -1, QK)
    d = blocks.abs().amax(-1) * _INV_127
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, 1.0), 0.0)
    q = torch.round(blocks * inv[..., None]).clamp(-127, 127).to(torch.int32)
    return q, d


def weight_codes(qweight: torch.Tensor, qtype: int, k: int):
    """GGUF rows ``[N, K / 32 * block_bytes]`` uint8 as (integer codes ``[N, K / 32, 32]``
    int32, scales ``[N, K / 32]`` float32, Q4_1 minimums or None): weight = d * code (+ m)."""
    nb = k // QK
    b = qweight.reshape(qweight.shape[0], nb, -1)
    d = b[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    if qtype == 8:  # Q8_0
        return b[..., 2:34].contiguous().view(torch.int8).to(torch.int32), d, None
    nib = b[..., 4:20] if qtype == 3 else b[..., 2:18]
    codes = torch.cat([nib & 15, nib >> 4], dim=-1).to(torch.int32)
    if qtype == 2:  # Q4_0
        return codes - 8, d, None
    if qtype == 3:  # Q4_1
        return codes, d, b[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
    raise ValueError(f"GGML type {qtype} is not one of Q4_0, Q4_1, Q8_0 (2, 3, 8)")


def gguf_q8_linear(x: torch.Tensor, qweight: torch.Tensor, qtype: int) -> torch.Tensor:
    """``x`` ``[M, K]`` times the GGUF rows' transpose → ``[M, N]`` float32, the int8 mode's
    arithmetic: per block ``(dw * dx) * isum`` (+ ``mw * (dx * sum(q))``), blocks summed in
    float64 (the kernels sum in float32 in their own order: that is the only difference)."""
    k = x.shape[-1]
    qx, dx = quantize_activations(x)
    codes, dw, mw = weight_codes(qweight, qtype, k)
    # [nb, M, 32] @ [nb, 32, N]: exact integers in float64.
    isum = torch.bmm(qx.double().transpose(0, 1), codes.double().permute(1, 2, 0))
    scale = dw.T[:, None, :] * dx.T[:, :, None]  # [nb, M, N] float32: dw * dx
    terms = (scale * isum.float()).double()
    if mw is not None:
        sx = dx * qx.sum(-1).float()  # [M, nb] float32: dx * sum(q)
        terms = terms + (mw.T[:, None, :] * sx.T[:, :, None]).double()
    return terms.sum(0).float()
