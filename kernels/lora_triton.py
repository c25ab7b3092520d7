"""Punica's BGMV shrink and expand in Triton (``kernels/lora_ops.py`` says the shapes).

``B`` may be a slice of all parts' (``lora_b_cat``): slots step by its ``stride(0)``.
One program per (token row, block of outputs): it reads its row's slot, and a row without an
adapter (-1) writes zeros (shrink) or nothing (expand). Products sum in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink(h_ptr, x_ptr, a_ptr, slots_ptr, PR, IN, BLOCK_J: tl.constexpr,
            BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    slot = tl.load(slots_ptr + t)
    s = tl.maximum(slot, 0).to(tl.int64)
    acc = tl.zeros((BLOCK_J,), dtype=tl.float32)
    for k0 in range(0, IN, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_ptr + t * IN + k, mask=k < IN, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + (s * PR + j[:, None]) * IN + k[None, :],
                    mask=(j[:, None] < PR) & (k[None, :] < IN), other=0.0).to(tl.float32)
        acc += tl.sum(a * xk[None, :], axis=1)
    acc = tl.where(slot >= 0, acc, 0.0)
    tl.store(h_ptr + t * PR + j, acc, mask=j < PR)


@triton.jit
def _expand(y_ptr, h_ptr, b_ptr, slots_ptr, OUT, R, B_SLOT, H_STRIDE, H_OFF, Y_STRIDE, Y_OFF,
            BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0)
    o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    r = tl.arange(0, BLOCK_R)
    slot = tl.load(slots_ptr + t)
    s = tl.maximum(slot, 0).to(tl.int64)
    hr = tl.load(h_ptr + t * H_STRIDE + H_OFF + r, mask=r < R, other=0.0)
    b = tl.load(b_ptr + s * B_SLOT + o[:, None] * R + r[None, :],
                mask=(o[:, None] < OUT) & (r[None, :] < R), other=0.0).to(tl.float32)
    delta = tl.sum(b * hr[None, :], axis=1)
    dst = y_ptr + t * Y_STRIDE + Y_OFF + o
    keep = (o < OUT) & ((o * 0 + slot) >= 0)  # slot broadcast first: a vector mask
    old = tl.load(dst, mask=keep, other=0.0).to(tl.float32)
    tl.store(dst, (old + delta).to(y_ptr.dtype.element_ty), mask=keep)


def bgmv_add(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
             lora_b: list[torch.Tensor], token_slots: torch.Tensor) -> torch.Tensor:
    """``y`` += each row's delta (``kernels/lora_ops.bgmv_add``'s contract)."""
    rows, pr, fan_in = x.shape[0], lora_a.shape[1], lora_a.shape[2]
    rank = lora_b[0].shape[-1]
    if rows == 0:
        return y
    x, slots = x.contiguous(), token_slots.to(torch.int32).contiguous()
    h = torch.empty((rows, pr), dtype=torch.float32, device=x.device)
    block_j = min(triton.next_power_of_2(pr), 64)
    _shrink[(rows, triton.cdiv(pr, block_j))](h, x, lora_a, slots, pr, fan_in,
                                              BLOCK_J=block_j, BLOCK_K=64)
    start, block_r = 0, triton.next_power_of_2(rank)
    for p, b in enumerate(lora_b):
        out = b.shape[1]
        if b.stride(2) != 1 or b.stride(1) != rank:  # a slot's rows must be contiguous
            b = b.contiguous()
        _expand[(rows, triton.cdiv(out, 64))](y, h, b, slots, out, rank, b.stride(0), pr,
                                              p * rank,
                                              y.stride(0), start, BLOCK_O=64, BLOCK_R=block_r)
        start += out
    return y
