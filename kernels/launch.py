"""What every Triton attention wrapper does before launching: shape checks and buffers."""

from __future__ import annotations

import torch


def prepare_query_and_out(
    query: torch.Tensor, key_cache: torch.Tensor, out: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``query`` with a contiguous last dimension and the output buffer (``out``, or a
    new one like ``query``).

    Args:
        query: ``[N, num_heads, head_size]``; key_cache: ``[num_blocks, block_size,
            num_kv_heads, head_size]``.

    Raises:
        ValueError: ``num_heads`` is not a multiple of ``num_kv_heads`` (GQA needs whole groups).
    """
    num_heads, kv_heads = query.shape[1], key_cache.shape[2]
    if num_heads % kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={kv_heads}")
    if query.stride(2) != 1:
        query = query.contiguous()
    return query, torch.empty_like(query) if out is None else out


def kv_scale_view(cache: torch.Tensor) -> torch.Tensor:
    """The storage of an 8-bit cache (``kernels/kv_quant.py``) as float32, where the kernels
    read each row's scale; the cache itself otherwise (not read).

    Raises:
        ValueError: an 8-bit cache whose rows are not whole float32 words (head_size % 4).
    """
    if cache.element_size() != 1:
        return cache
    if cache.shape[-1] % 4 or not cache.is_contiguous():
        raise ValueError("8-bit KV caches need contiguous rows of head_size + 4 bytes with "
                         f"head_size a multiple of 4, not rows of {cache.shape[-1]}")
    return cache.view(torch.uint8).view(torch.float32)
