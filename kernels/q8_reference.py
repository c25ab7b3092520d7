"""The int8-activation GGUF product in torch: the same arithmetic as ``csrc/gguf_q8_gemm.cpp``
(``--cpu-linear-mode int8``), the oracle its tests compare every variant against.

Activations are quantized as llama.cpp does for each weight type: per block of 32 values
(``ggml-quants.c``'s ``quantize_row_q8_0``) against the 32-weight types, per 256 values (the
size of its Q8_K) against the K-quants, whose kernels then fold a block's 8 sub-block products
in integers or in one float sum before a single multiply by the activation scale. Either way
with a float32 scale ``d = amax * float32(1/127)`` and ``q = round_half_even(x / d)`` computed
as ``x * (1 / d)`` (llama.cpp's Q8_K keeps the sign of the largest value in its scale; the
rounding here is Q8_0's for both sizes). Each 32-value block's product with a weight sub-block
of 32 is an exact integer, scaled by ``dw * d`` (and, for types with a minimum, plus
``mw * (d * sum(q))``). Integer sums are taken in float64, where they are exact (at most
32 * 127 * 128 * 32 per sub-block, Q6_K's scaled codes).
"""

from __future__ import annotations

import torch

QK = 32
_INV_127 = torch.tensor(1.0 / 127.0, dtype=torch.float32)


K_QUANTS = (12, 13, 14)  # Q4_K, Q5_K, Q6_K: 256-weight blocks, activations per 256 values


def quantize_activations(x: torch.Tensor, group: int = QK) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` (K a multiple of ``group``, float32 or bfloat16 widened exactly) as int8
    codes ``[M, K / 32, 32]`` (int32 tensor) and float32 scales ``[M, K / 32]``, one scale per
    ``group`` values (32 or 256) repeated for each 32-value block of the group."""
    groups = x.float().reshape(x.shape[0], -1, group)
    d = groups.abs().amax(-1) * _INV_127
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, 1.0), 0.0)
    q = torch.round(groups * inv[..., None]).clamp(-127, 127).to(torch.int32)
    per = group // QK
    return q.reshape(x.shape[0], -1, QK), d.repeat_interleave(per, dim=-1)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """``[..., 2]`` uint8 little-endian fp16 → ``[...]`` float32."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[..., 16]`` bytes → ``[..., 32]``: the low nibbles, then the high ones."""
    return torch.cat([qs & 15, qs >> 4], dim=-1).to(torch.int32)


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 packed bytes ``[..., 12]`` → 6-bit scales and minimums ``[..., 8]``."""
    s = s.to(torch.int32)
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return sc, mn


def weight_codes(qweight: torch.Tensor, qtype: int, k: int):
    """GGUF rows ``[N, row_bytes]`` uint8 as (integer codes ``[N, K / 32, 32]`` int32, scales
    ``[N, K / 32]`` float32, minimums ``[N, K / 32]`` float32 or None): weight = dw * code
    (+ mw), per 32-weight sub-block, as ``csrc/gguf_blocks.h`` lists them (Q4_K / Q5_K:
    dw = d * sc, mw = -(dmin * m); Q6_K: code = sc * (q - 32), dw = d). Written from
    llama.cpp's ``ggml-common.h`` layouts, independently of the C++ decoder."""
    n, nb = qweight.shape[0], k // QK
    if qtype in K_QUANTS:  # 256-weight blocks of 8 sub-blocks
        b = qweight.reshape(n, k // 256, -1)
        if qtype == 14:  # Q6_K: ql[128] qh[64] scales int8[16] d
            ql = b[..., 0:128].reshape(n, -1, 2, 1, 64).to(torch.int32)
            ql = torch.cat([ql & 15, ql >> 4], dim=3).reshape(n, -1, 8, 32)
            qh = b[..., 128:192].reshape(n, -1, 2, 1, 32).to(torch.int32)
            qh = (qh >> torch.tensor([0, 2, 4, 6]).view(1, 1, 1, 4, 1)) & 3
            q = (ql | (qh.reshape(n, -1, 8, 32) << 4)) - 32
            sc = b[..., 192:208].contiguous().view(torch.int8).to(torch.int32)
            codes = q.reshape(n, -1, 16, 16) * sc[..., None]
            dw = _f16(b[..., 208:210])[..., None].expand(-1, -1, 8)
            return codes.reshape(n, nb, 32), dw.reshape(n, nb), None
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _k_scale_min(b[..., 4:16])
        qs = b[..., 48:176] if qtype == 13 else b[..., 16:144]
        qs = qs.reshape(n, -1, 4, 1, 32).to(torch.int32)
        codes = torch.cat([qs & 15, qs >> 4], dim=3).reshape(n, -1, 8, 32)
        if qtype == 13:  # Q5_K: bit s of qh[l] is sub-block s's fifth bit
            qh = b[..., 16:48].reshape(n, -1, 1, 32).to(torch.int32)
            codes = codes | (((qh >> torch.arange(8).view(1, 1, 8, 1)) & 1) << 4)
        dw = d[..., None] * sc.float()
        mw = -(dmin[..., None] * mn.float())
        return codes.reshape(n, nb, 32), dw.reshape(n, nb), mw.reshape(n, nb)
    b = qweight.reshape(n, nb, -1)
    d = _f16(b[..., 0:2])
    if qtype == 8:  # Q8_0
        return b[..., 2:34].contiguous().view(torch.int8).to(torch.int32), d, None
    if qtype in (2, 3):  # Q4_0, Q4_1
        codes = _nibbles(b[..., 4:20] if qtype == 3 else b[..., 2:18])
        return (codes - 8, d, None) if qtype == 2 else (codes, d, _f16(b[..., 2:4]))
    if qtype in (6, 7):  # Q5_0, Q5_1: a 32-bit word of fifth bits, weight j's at bit j
        qh_at = 4 if qtype == 7 else 2
        h = b[..., qh_at:qh_at + 4].to(torch.int64)
        word = h[..., 0] | h[..., 1] << 8 | h[..., 2] << 16 | h[..., 3] << 24
        high = ((word[..., None] >> torch.arange(32)) & 1).to(torch.int32)
        codes = _nibbles(b[..., qh_at + 4:qh_at + 20]) | (high << 4)
        return (codes - 16, d, None) if qtype == 6 else (codes, d, _f16(b[..., 2:4]))
    raise ValueError(f"GGML type {qtype} is not one of the int8 kernel's types")


def gguf_q8_linear(x: torch.Tensor, qweight: torch.Tensor, qtype: int) -> torch.Tensor:
    """``x`` ``[M, K]`` times the GGUF rows' transpose → ``[M, N]`` float32, the int8 mode's
    arithmetic (activations per 256 values against K-quants, else per 32): per block
    ``(dw * dx) * isum`` (+ ``mw * (dx * sum(q))``), blocks summed in float64 (the kernels sum
    in float32 in their own order: that is the only difference)."""
    k = x.shape[-1]
    qx, dx = quantize_activations(x, 256 if qtype in K_QUANTS else QK)
    codes, dw, mw = weight_codes(qweight, qtype, k)
    # [nb, M, 32] @ [nb, 32, N]: exact integers in float64.
    isum = torch.bmm(qx.double().transpose(0, 1), codes.double().permute(1, 2, 0))
    scale = dw.T[:, None, :] * dx.T[:, :, None]  # [nb, M, N] float32: dw * dx
    terms = (scale * isum.float()).double()
    if mw is not None:
        sx = dx * qx.sum(-1).float()  # [M, nb] float32: dx * sum(q)
        terms = terms + (mw.T[:, None, :] * sx.T[:, :, None]).double()
    return terms.sum(0).float()
