"""Triton kernel: variable-length causal attention for prefill chunks over the paged KV cache.

Same arguments and result as ``kernels.reference.paged_prefill_attention``. Sequence ``i``'s
queries are ``query[query_start_loc[i]:query_start_loc[i+1]]``, its *last* ``q_len`` tokens of
``seq_lens[i]``; their K/V (this chunk's, written by ``reshape_and_cache`` just before, and any
earlier context: a prefix-cache hit or an earlier chunk) are read through the block table;
from an 8-bit cache (``kernels/kv_quant.py``) as codes times each row's scale, in the query's
dtype.

Flash-attention style (Dao et al., 2022): one program per (sequence, tile of ``BLOCK_M``
queries, query head) streams K/V tiles of ``BLOCK_N`` tokens up to its last query's position,
with an online softmax in float32 and base 2. GQA maps query head ``h`` to KV head
``h // group``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.attention_tiles import (
    kv_tile_offsets,
    load_kv_tile,
    online_softmax_step,
    online_softmax_step_masked,
    soft_cap,
)
from pagedserve.kernels.launch import kv_scale_view, prepare_query_and_out

LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, seq_lens_ptr,
    query_start_loc_ptr, out_ptr,
    qk_scale,  # softmax scale * log2(e)
    window,  # sliding window in tokens (read when HAS_WINDOW)
    cap,  # soft cap * log2(e), the scores' base-2 units (read when HAS_CAP)
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_kb, stride_ks, stride_kh,
    BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_CAP: tl.constexpr, QUANTIZED: tl.constexpr,
):
    seq, m_tile, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # tokens cached before this chunk

    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_SIZE
    q_pos = context_len + offs_m  # each query's position in its sequence
    q = tl.load(
        q_ptr + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :], other=0.0,
    )  # q: [M, D]
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    # Keys up to this tile's last query (causal); the first tile holds position 0, so every
    # row has a finite running max from the first iteration on.
    kv_end = tl.minimum(seq_len, context_len + (m_tile + 1) * BLOCK_M)
    # With a window, from the first query's first key: nothing before it is read.
    kv_begin = 0
    if HAS_WINDOW:
        kv_begin = tl.maximum(context_len + m_tile * BLOCK_M - window + 1, 0)
    for tile_start in range(kv_begin, kv_end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        n_mask = pos < kv_end
        kv_off = kv_tile_offsets(block_table_ptr + seq * stride_bt, pos, n_mask,
                                 (head // GROUP) * stride_kh, BLOCK_SIZE, stride_kb, stride_ks)
        k = _load_tile(k_cache_ptr, k_scale_ptr, kv_off, offs_d, n_mask, d_mask, HEAD_SIZE,
                       DOT_FP32, QUANTIZED).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # s: [M, N]
        if HAS_CAP:
            s = soft_cap(s, cap)
        m_i, l_i, acc, p = _causal_softmax_step(m_i, l_i, acc, s, pos, q_pos, n_mask, window,
                                                HAS_WINDOW)
        v = _load_tile(v_cache_ptr, v_scale_ptr, kv_off, offs_d, n_mask, d_mask, HEAD_SIZE,
                       DOT_FP32, QUANTIZED).to(q.dtype)
        acc += tl.dot(p.to(v.dtype), v, input_precision=PRECISION)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # 0 only for padding rows (not stored)
    _store_rows(out_ptr, o, q_start + offs_m, head, offs_d, m_mask, d_mask, stride_ot, stride_oh)


@triton.jit
def _store_rows(out_ptr, o, rows, head, offs_d, m_mask, d_mask, stride_ot, stride_oh):
    """The tile's output rows of ``head`` (inlined into ``_prefill_kernel``)."""
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _load_tile(cache_ptr, scale_ptr, kv_off, offs_d, n_mask, d_mask, HEAD_SIZE: tl.constexpr,
               DOT_FP32: tl.constexpr, QUANTIZED: tl.constexpr):
    """A K or V tile (inlined into ``_prefill_kernel``): ``[N, D]`` through the block table's
    offsets, float32 when the dots run in float32 or the cache is 8-bit (codes times the
    row's scale; the caller casts to the query's dtype)."""
    tile = load_kv_tile(cache_ptr, scale_ptr, kv_off, offs_d, n_mask, d_mask, HEAD_SIZE,
                        QUANTIZED)
    if DOT_FP32:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _causal_softmax_step(m_i, l_i, acc, s, pos, q_pos, n_mask, window, HAS_WINDOW: tl.constexpr):
    """One K/V tile's online-softmax step (inlined into ``_prefill_kernel``): each query row
    sees the keys at or before its position (and, with a window, within it)."""
    live = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
    if HAS_WINDOW:  # a later row's window may start past this tile: the masked step
        live = live & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(live, s, float("-inf"))
        m_i, l_i, acc, p = online_softmax_step_masked(m_i, l_i, acc, s)
    else:
        s = tl.where(live, s, float("-inf"))
        m_i, l_i, acc, p = online_softmax_step(m_i, l_i, acc, s)
    return m_i, l_i, acc, p


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Prefill attention, a drop-in for ``kernels.reference.paged_prefill_attention``
    (``sliding_window`` and ``logits_soft_cap`` too; with a window a tile of queries reads
    from its first query's window on).

    Args (beyond the reference's):
        max_query_len: the longest chunk, if the caller knows it on the host; otherwise it is
            read from ``query_start_loc`` (one device sync).
        out: ``[T, num_heads, head_size]`` to write into (last dimension contiguous).

    Returns:
        ``[T, num_heads, head_size]`` in the query's dtype.
    """
    num_tokens, num_heads, head_size = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    query, out = prepare_query_and_out(query, key_cache, out)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    head_pad = max(triton.next_power_of_2(head_size), 16)
    block_m = 16 if max_query_len <= 16 else (32 if max_query_len <= 32 else 64)
    block_n = 64 if head_pad <= 64 else 32
    # Triton's CPU interpreter (3.9) multiplies bfloat16 dot operands as raw uint16 bits:
    # there, and only there, bfloat16 tiles are upcast to float32 before tl.dot.
    dot_fp32 = query.dtype == torch.bfloat16 and query.device.type != "cuda"
    # fp32 on a GPU would otherwise run its dots in tf32 (10-bit mantissa).
    precision = "ieee" if query.dtype == torch.float32 or dot_fp32 else "tf32"
    grid = (num_seqs, triton.cdiv(max_query_len, block_m), num_heads)
    _prefill_kernel[grid](
        query, key_cache, value_cache, kv_scale_view(key_cache), kv_scale_view(value_cache),
        block_table, seq_lens, query_start_loc, out,
        scale * LOG2E, sliding_window or 0, (logits_soft_cap or 0.0) * LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        BLOCK_SIZE=block_size, HEAD_SIZE=head_size, HEAD_PAD=head_pad,
        GROUP=num_heads // kv_heads, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=precision,
        DOT_FP32=dot_fp32, HAS_WINDOW=sliding_window is not None,
        HAS_CAP=logits_soft_cap is not None, QUANTIZED=key_cache.element_size() == 1,
    )
    return out
