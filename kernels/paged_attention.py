"""Triton kernels: decode attention over the paged KV cache, with a split-KV variant.

Same arguments and result as ``kernels.reference.paged_decode_attention``: one query token per
sequence (at position ``seq_lens[i] - 1``) against that sequence's K/V, read through its
``block_table`` row. Layout: ``key_cache``/``value_cache`` are
``[num_blocks, block_size, num_kv_heads, head_size]``, or 8-bit caches (``--kv-cache-dtype``,
``kernels/kv_quant.py``) of ``head_size + 4`` per row, read as codes times each row's scale.

One program handles one (sequence, KV head) and all the query heads that share it (GQA), so each
K/V element is read once per sequence. It walks the context in tiles of ``TILE_N`` tokens; each
token's block id comes from the block table, so any block size works and blocks may be
scattered. Softmax is online (running max ``m``, running sum ``l_sum``), in float32, in base 2.

Split-KV ("flash-decoding", Dao et al. 2023): when the batch is too small to fill the GPU
(``batch * num_kv_heads`` programs fewer than the SMs), each sequence's context is cut into
``num_splits`` equal parts of its own length; each part yields a partial output and its
log-sum-exp, and a second kernel combines them. The split boundaries come from ``seq_lens`` on
the device, so the grid depends only on the batch size: the launch is CUDA-graph safe.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagedserve.kernels.attention_tiles import (
    kv_tile_offsets,
    load_kv_tile,
    online_softmax_step,
    soft_cap,
)
from pagedserve.kernels.launch import kv_scale_view, prepare_query_and_out

LOG2E = 1.4426950408889634
MAX_SPLITS = 16
MIN_TOKENS_PER_SPLIT = 256


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale,  # softmax scale * log2(e)
    window,  # sliding window in tokens (read when HAS_WINDOW)
    cap,  # soft cap * log2(e), the scores' base-2 units (read when HAS_CAP)
    stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
    stride_kb, stride_ks, stride_kh,
    BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # The tokens this query sees: its last `window` ones with a window (the blocks before
    # are never read), all of them otherwise.
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    # This split's tokens: an equal share of those, rounded up to whole tiles.
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), TILE_N) * TILE_N
    start = lo + split * per_split
    end = tl.minimum(seq_len, start + per_split)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_SIZE
    gd_mask = g_mask[:, None] & d_mask[None, :]
    heads = kv_head * GROUP + offs_g  # the query heads sharing this KV head
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=gd_mask, other=0.0,
    ).to(tl.float32) * qk_scale  # q: [G, D]

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
    for tile_start in range(start, end, TILE_N):
        pos = tile_start + tl.arange(0, TILE_N)
        n_mask = pos < end
        kv_off = kv_tile_offsets(block_table_ptr + seq * stride_bt, pos, n_mask,
                                 kv_head * stride_kh, BLOCK_SIZE, stride_kb, stride_ks)
        k = load_kv_tile(k_cache_ptr, k_scale_ptr, kv_off, offs_d, n_mask, d_mask, HEAD_SIZE,
                         QUANTIZED)
        s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # s: [G, N]
        if HAS_CAP:
            s = soft_cap(s, cap)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m, l_sum, acc, p = online_softmax_step(m, l_sum, acc, s)  # the tile has a valid token
        v = load_kv_tile(v_cache_ptr, v_scale_ptr, kv_off, offs_d, n_mask, d_mask, HEAD_SIZE,
                         QUANTIZED)
        acc += tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)

    _store_split(out_ptr, part_out_ptr, part_lse_ptr, m, l_sum, acc, seq, split, heads, offs_d,
                 g_mask, gd_mask, stride_ob, stride_oh, HEAD_SIZE, GROUP, NUM_SPLITS)


@triton.jit
def _store_split(
    out_ptr, part_out_ptr, part_lse_ptr, m, l_sum, acc, seq, split, heads, offs_d,
    g_mask, gd_mask, stride_ob, stride_oh,
    HEAD_SIZE: tl.constexpr, GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """A split's result (inlined into ``_decode_kernel``): with one split, the output rows of
    the query heads; with several, each head's partial output and its log-sum-exp for
    ``_reduce_splits_kernel``."""
    has_tokens = l_sum > 0  # false for an empty split (or a padded sequence of length 0)
    o = acc / tl.where(has_tokens, l_sum, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty), mask=gd_mask,
        )
    else:
        # part_out: [B, H, S, HEAD_SIZE] float32; part_lse: [B, H, S] float32, base 2.
        row = (seq * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + row[:, None] * HEAD_SIZE + offs_d[None, :], o, mask=gd_mask)
        log_sum = tl.math.log2(tl.where(has_tokens, l_sum, 1.0))
        lse = tl.where(has_tokens, m + log_sum, float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _reduce_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, stride_ob, stride_oh,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """out = sum_s w_s * o_s / sum_s w_s with w_s = 2^(lse_s - max lse)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_SIZE
    row = (seq * tl.num_programs(1) + head) * NUM_SPLITS + offs_s
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # all splits empty
    w = tl.math.exp2(lse - lse_max)  # 0 for empty splits
    o = tl.load(part_out_ptr + row[:, None] * HEAD_SIZE + offs_d[None, :],
                mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(w, axis=0)
    res = tl.sum(w[:, None] * o, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d,
             res.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(
    batch: int, kv_heads: int, device: torch.device, max_seq_len: int | None = None
) -> int:
    """Split only when ``batch * kv_heads`` programs leave SMs idle, and only long contexts.

    Depends on the batch size (and the optional host-side ``max_seq_len``), never on device
    tensors, so it is fixed for a captured CUDA graph of a given batch size.
    """
    if device.type != "cuda":
        return 1
    programs = batch * kv_heads
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= sms:
        return 1
    splits = min(triton.cdiv(2 * sms, programs), MAX_SPLITS)
    if max_seq_len is not None:
        splits = min(splits, max(1, max_seq_len // MIN_TOKENS_PER_SPLIT))
    return splits


def _tile_n(group_pad: int, head_pad: int) -> int:
    """Tokens per tile: keep the ``[G, N, D]`` product within ~8K float32 registers."""
    return max(16, min(64, triton.next_power_of_2(8192 // (group_pad * head_pad))))


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Decode attention, a drop-in for ``kernels.reference.paged_decode_attention``
    (``sliding_window`` and ``logits_soft_cap`` too: with a window only the last
    ``sliding_window`` tokens are read, so the cost is O(window) and blocks before it may be
    released ones).

    Args (beyond the reference's):
        num_splits: force the split-KV factor (``1``: no split); default ``choose_num_splits``.
        max_seq_len: the longest ``seq_lens`` entry if the caller knows it on the host (only
            used to avoid splitting short contexts; never read from the device).
        out: ``[B, num_heads, head_size]`` to write into (last dimension contiguous).

    Returns:
        ``[B, num_heads, head_size]`` in the query's dtype.
    """
    num_seqs, num_heads, head_size = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    query, out = prepare_query_and_out(query, key_cache, out)
    if num_seqs == 0:
        return out
    group = num_heads // kv_heads
    if num_splits is None:
        longest = max_seq_len if sliding_window is None or max_seq_len is None else min(
            max_seq_len, sliding_window)
        num_splits = choose_num_splits(num_seqs, kv_heads, query.device, longest)
    group_pad = max(triton.next_power_of_2(group), 2)
    head_pad = max(triton.next_power_of_2(head_size), 16)
    if num_splits > 1:
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_size,
                               dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits,
                               dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # unused
    _decode_kernel[(num_seqs, kv_heads, num_splits)](
        query, key_cache, value_cache, kv_scale_view(key_cache), kv_scale_view(value_cache),
        block_table, seq_lens, out, part_out, part_lse,
        scale * LOG2E, sliding_window or 0, (logits_soft_cap or 0.0) * LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        BLOCK_SIZE=block_size, HEAD_SIZE=head_size, HEAD_PAD=head_pad,
        GROUP=group, GROUP_PAD=group_pad, TILE_N=_tile_n(group_pad, head_pad),
        NUM_SPLITS=num_splits, HAS_WINDOW=sliding_window is not None,
        HAS_CAP=logits_soft_cap is not None, QUANTIZED=key_cache.element_size() == 1,
    )
    if num_splits > 1:
        _reduce_splits_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1),
            HEAD_SIZE=head_size, HEAD_PAD=head_pad,
            NUM_SPLITS=num_splits, SPLITS_PAD=max(triton.next_power_of_2(num_splits), 2),
        )
    return out
