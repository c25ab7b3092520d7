"""Pure-torch reference implementations of the paged-KV kernels.

These are the CPU attention path and the oracle the Triton kernels are tested against.
Layouts follow vLLM's (``vllm/attention/ops/paged_attn.py``, simplified):

- ``key_cache`` / ``value_cache``: ``[num_blocks, block_size, num_kv_heads, head_size]``.
- A *slot* is ``block_id * block_size + offset``; ``-1`` marks a padded token that is not written.
- ``block_table``: ``[B, max_blocks_per_seq]`` int32, block ids of each sequence in order
  (entries past a sequence's last block are ignored).
- 8-bit caches (``torch.int8`` / ``float8_e4m3fn`` / ``float8_e5m2``) hold each (token, kv head)
  row as codes plus a float32 scale (``kernels/kv_quant.py``): the write quantizes, the reads
  dequantize and attend in float32.

Source: Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention" (SOSP 2023).
"""

from __future__ import annotations

import torch

from pagedserve.kernels import kv_quant


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new K/V into the paged cache, in place.

    Args:
        key, value: ``[T, num_kv_heads, head_size]``, same dtype as the caches, or any float
            dtype for 8-bit caches (quantized here, ``kv_quant.quantize``).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``
            (``head_size + 4`` for 8-bit caches).
        slot_mapping: ``[T]`` int64 slot per token; ``-1`` entries are skipped.
    """
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    kv_heads, row = key_cache.shape[2], key_cache.shape[3]
    if kv_quant.is_quantized(key_cache.dtype):
        # Bytes: index_copy_ has no float8 kernel on the CPU.
        key = kv_quant.quantize(key, key_cache.dtype).view(torch.uint8)
        value = kv_quant.quantize(value, value_cache.dtype).view(torch.uint8)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    key_cache.view(-1, kv_heads, row).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, kv_heads, row).index_copy_(0, slot_mapping, value)


def _readable(cache: torch.Tensor, query: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
    """A gathered cache slice as values to attend over, and the dtype to attend in: itself in
    the query's dtype, or an 8-bit one dequantized to float32."""
    if kv_quant.is_quantized(cache.dtype):
        return kv_quant.dequantize(cache), torch.float32
    return cache, query.dtype


def gather_kv(
    cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """The first ``seq_len`` tokens of one sequence, ``[seq_len, num_kv_heads, head_size]``."""
    num_blocks = -(-seq_len // cache.shape[1])
    return cache[block_ids[:num_blocks]].flatten(0, 1)[:seq_len]


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """One query token per sequence against its whole paged context (decode).

    Args:
        query: ``[B, num_heads, head_size]``; query ``i`` sits at position ``seq_lens[i] - 1``.
        block_table: ``[B, max_blocks_per_seq]``; seq_lens: ``[B]`` (context incl. the query).
        scale: softmax scale, usually ``head_size ** -0.5``.
        sliding_window: a query at position ``i`` sees keys ``j`` with ``i - W < j <= i``
            (``transformers.masking_utils.sliding_window_overlay``); ``None``: all of them.
        logits_soft_cap: scores become ``cap * tanh(scores / cap)`` after scaling, before the
            mask and softmax (Gemma 2's ``attn_logit_softcapping``); ``None``: unchanged.

    Returns:
        ``[B, num_heads, head_size]`` in the query's dtype (softmax in float32).
    """
    block_size = key_cache.shape[1]
    max_len = int(seq_lens.max())
    max_blocks = -(-max_len // block_size)
    num_seqs, kv_heads, row = query.shape[0], key_cache.shape[2], key_cache.shape[3]
    blocks = block_table[:, :max_blocks].reshape(-1)
    # [B, Hkv, L, D]: every sequence padded to the longest, padding masked. index_select copies
    # whole blocks (faster than advanced indexing on the CPU: loadtest/RESULTS.md).
    shape = (num_seqs, max_blocks * block_size, kv_heads, row)
    k, dtype = _readable(key_cache.index_select(0, blocks).view(shape), query)
    v, _ = _readable(value_cache.index_select(0, blocks).view(shape), query)
    k, v = k[:, :max_len].transpose(1, 2), v[:, :max_len].transpose(1, 2)
    pos = torch.arange(max_len, device=query.device)[None, :]
    valid = pos < seq_lens[:, None]  # [B, L]
    if sliding_window is not None:
        valid &= pos >= seq_lens[:, None] - sliding_window
    # One batched call for all sequences and heads; GQA without repeating K/V. torch's CPU
    # kernel accumulates in float32 for bfloat16 inputs.
    out = attend(query.to(dtype).unsqueeze(2), k, v, valid[:, None, None, :], scale,
                 logits_soft_cap)  # [B, H, 1, D]
    return out.squeeze(2).to(query.dtype)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
    logits_soft_cap: float | None, is_causal: bool = False,
) -> torch.Tensor:
    """SDPA over ``q`` ``[B, H, Lq, D]`` and ``k``/``v`` ``[B, Hkv, L, D]`` (GQA: ``H`` a
    multiple of ``Hkv``), ``mask`` boolean (True = attend) broadcastable to ``[B, H, Lq, L]``.
    With ``logits_soft_cap`` the scores are capped (``cap * tanh(s / cap)``) before masking,
    which torch's fused kernels cannot do, so that case is computed unfused in float32."""
    if logits_soft_cap is None:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True)
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    qg = q.float().reshape(b, hkv, h // hkv, lq, d)
    s = torch.einsum("bkgqd,bkld->bkgql", qg, k.float()) * scale
    s = torch.tanh(s / logits_soft_cap) * logits_soft_cap
    if is_causal:
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    if mask is not None:
        mask = mask.expand(b, h, lq, lk).reshape(b, hkv, h // hkv, lq, lk)
        s = s.masked_fill(~mask, float("-inf"))
    o = torch.einsum("bkgql,bkld->bkgqd", s.softmax(-1), v.float())
    return o.reshape(b, h, lq, d).to(q.dtype)


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention for variable-length query chunks over paged K/V (prefill).

    Sequence ``i`` has queries ``query[query_start_loc[i]:query_start_loc[i+1]]``; they are its
    *last* tokens, so a chunk whose earlier context is already cached (a prefix-cache hit or an
    earlier chunk of a chunked prefill) attends to that context through the block table.

    Args:
        query: ``[T, num_heads, head_size]``; query_start_loc: ``[B+1]``; seq_lens: ``[B]``.
        sliding_window, logits_soft_cap: as ``paged_decode_attention``.

    Returns:
        ``[T, num_heads, head_size]`` in the query's dtype.
    """
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q = query[starts[i] : starts[i + 1]]
        q_len = q.shape[0]
        k, dtype = _readable(gather_kv(key_cache, block_table[i], seq_len), query)
        v, _ = _readable(gather_kv(value_cache, block_table[i], seq_len), query)
        if q_len == seq_len and sliding_window is None:  # no cached context: plain causal
            mask, causal = None, True
        else:  # query j sits at position seq_len - q_len + j and sees keys up to it
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
            k_pos = torch.arange(seq_len, device=query.device)[None, :]
            mask, causal = k_pos <= q_pos, False
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
        # 4-D inputs ([1, H, L, D]): only those reach torch's fused (flash) CPU kernel; 3-D
        # ones fall back to the unfused math path, many times slower (loadtest/RESULTS.md).
        o = attend(q.to(dtype).transpose(0, 1)[None], k.transpose(0, 1)[None],
                   v.transpose(0, 1)[None], mask, scale, logits_soft_cap, is_causal=causal)
        out[starts[i] : starts[i + 1]] = o[0].transpose(0, 1).to(query.dtype)
    return out
