"""``@triton.jit`` helpers the decode and prefill attention kernels share.

Both kernels walk a sequence's context in tiles of K/V tokens read through its block table,
and fold each tile into an online softmax (Milakov & Gimelshein, "Online normalizer
calculation for softmax", 2018; as in flash-attention): a running max ``m`` and sum ``l`` per
query row, in float32 and base 2, and an accumulator rescaled whenever the max grows.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def kv_tile_offsets(block_table_row_ptr, pos, n_mask, head_offset, BLOCK_SIZE: tl.constexpr,
                    stride_kb, stride_ks):
    """Element offsets ``[N]`` (int64) of tokens ``pos`` ``[N]`` of one KV head in the cache.

    ``block_table_row_ptr`` points at the sequence's block-table row; token ``p`` sits in block
    ``row[p // BLOCK_SIZE]`` at slot ``p % BLOCK_SIZE``. Masked tokens read block 0 (never used).
    """
    block = tl.load(block_table_row_ptr + pos // BLOCK_SIZE, mask=n_mask, other=0)
    return block.to(tl.int64) * stride_kb + (pos % BLOCK_SIZE) * stride_ks + head_offset


@triton.jit
def online_softmax_step(m, l_sum, acc, s):
    """Fold a tile of base-2 scores ``s`` ``[M, N]`` into the running ``(m, l_sum, acc)``.

    Returns the new max and sum ``[M]``, ``acc`` ``[M, D]`` rescaled to the new max, and the
    tile's probabilities ``p`` ``[M, N]``: the caller adds ``p @ V`` to ``acc``. A row's max
    must be finite once the first tile is folded in (each tile holds a valid token per row).
    """
    m_new = tl.maximum(m, tl.max(s, axis=1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m - m_new)
    return m_new, l_sum * alpha + tl.sum(p, axis=1), acc * alpha[:, None], p


@triton.jit
def online_softmax_step_masked(m, l_sum, acc, s):
    """``online_softmax_step`` for tiles where a row may have no valid token yet (a sliding
    window starts past the tile for some rows): a row whose max is still ``-inf`` gets
    ``p = 0`` and keeps ``acc`` and ``l_sum`` at 0, instead of NaN."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m - m_safe)
    return m_new, l_sum * alpha + tl.sum(p, axis=1), acc * alpha[:, None], p


@triton.jit
def soft_cap(s, cap):
    """``cap * tanh(s / cap)`` (Gemma 2's attention-logit soft cap), ``s`` and ``cap`` in the
    same units (both base 2 here), as ``1 - 2 / (1 + e^(2y))``: saturates at +-cap, no NaN."""
    e = tl.math.exp2(s * (2.0 * 1.4426950408889634 / cap))
    return cap * (1.0 - 2.0 / (1.0 + e))


@triton.jit
def load_kv_tile(cache_ptr, scale_ptr, kv_off, offs_d, n_mask, d_mask,
                 HEAD_SIZE: tl.constexpr, QUANTIZED: tl.constexpr):
    """A K or V tile ``[N, D]`` of tokens at element offsets ``kv_off`` ``[N]``: the cache's
    values, or for an 8-bit cache (``kernels/kv_quant.py``: a row's codes, then its float32
    scale) codes times the row's scale, in float32. ``scale_ptr`` is the cache's storage as
    float32 (a row's scale at element ``(row + HEAD_SIZE) / 4``; rows are 4-byte aligned)."""
    tile = tl.load(cache_ptr + kv_off[:, None] + offs_d[None, :],
                   mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    if QUANTIZED:
        scale = tl.load(scale_ptr + (kv_off + HEAD_SIZE) // 4, mask=n_mask, other=0.0)
        tile = tile.to(tl.float32) * scale[:, None]
    return tile
