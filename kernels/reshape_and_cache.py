"""Triton kernel: write a step's new K/V into the paged cache (vLLM's ``reshape_and_cache``).

Same arguments and layout as ``kernels.reference.reshape_and_cache``: one program per token
copies its ``[num_kv_heads, head_size]`` K and V rows to cache slot ``slot_mapping[t]``; a slot
of ``-1`` (a padded token, e.g. in a CUDA-graph batch) writes nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    HEAD_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK)  # flattened (head, dim) of one token
    mask = offs < NUM_KV_HEADS * HEAD_SIZE
    head, dim = offs // HEAD_SIZE, offs % HEAD_SIZE
    k = tl.load(key_ptr + t * stride_kt + head * stride_kh + dim, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + head * stride_vh + dim, mask=mask)
    # The cache is contiguous: a slot is NUM_KV_HEADS * HEAD_SIZE consecutive elements.
    dst = slot * (NUM_KV_HEADS * HEAD_SIZE) + offs
    tl.store(key_cache_ptr + dst, k, mask=mask)
    tl.store(value_cache_ptr + dst, v, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``[T, num_kv_heads, head_size]`` K/V into the caches at ``slot_mapping``, in place.

    The caches must be contiguous and of the same dtype as ``key``/``value``; K/V rows may be
    strided (the last dimension contiguous).
    """
    num_tokens, kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("reshape_and_cache: the KV caches must be contiguous")
    if key.stride(2) != 1 or value.stride(2) != 1:
        key, value = key.contiguous(), value.contiguous()
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        HEAD_SIZE=head_size, NUM_KV_HEADS=kv_heads,
        BLOCK=triton.next_power_of_2(kv_heads * head_size),
    )
