"""Triton kernel: write a step's new K/V into the paged cache (vLLM's ``reshape_and_cache``).

Same arguments and layout as ``kernels.reference.reshape_and_cache``: one program per token
copies its ``[num_kv_heads, head_size]`` K and V rows to cache slot ``slot_mapping[t]``; a slot
of ``-1`` (a padded token, e.g. in a CUDA-graph batch) writes nothing. Into an 8-bit cache
(``kernels/kv_quant.py``) each (token, head) row is quantized on the way: its codes and its
float32 scale, the same arithmetic as ``kv_quant.quantize``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels import kv_quant
from pagedserve.kernels.launch import kv_scale_view


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


# (mantissa bits, smallest normal exponent) of each 8-bit code; int8's grid is the integers.
_GRID = {torch.int8: (0, 0), torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}


@triton.jit
def _reshape_and_cache_8bit_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, k_scale_ptr, v_scale_ptr,
    slot_mapping_ptr, stride_kt, stride_kh, stride_vt, stride_vh, inv_qmax, qmax,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    MANT_BITS: tl.constexpr, EMIN: tl.constexpr,
):
    t, head = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, HEAD_PAD)
    mask = offs < HEAD_SIZE
    row = (slot * NUM_KV_HEADS + head) * (HEAD_SIZE + 4)  # bytes: the codes, then the scale
    _quantize_row(key_ptr + t * stride_kt + head * stride_kh, key_cache_ptr + row,
                  k_scale_ptr + (row + HEAD_SIZE) // 4, offs, mask, inv_qmax, qmax, MANT_BITS, EMIN)
    _quantize_row(value_ptr + t * stride_vt + head * stride_vh, value_cache_ptr + row,
                  v_scale_ptr + (row + HEAD_SIZE) // 4, offs, mask, inv_qmax, qmax, MANT_BITS, EMIN)


@triton.jit
def _quantize_row(src_ptr, dst_ptr, scale_ptr, offs, mask, inv_qmax, qmax,
                  MANT_BITS: tl.constexpr, EMIN: tl.constexpr):
    """One row as ``kv_quant.quantize``: scale = absmax / qmax (as absmax * (1 / qmax)),
    codes = x * (1 / scale) rounded to nearest even (by adding and taking away 1.5 * 2^23 in
    units of the grid's step: exact, and the same on a GPU as in Triton's interpreter, whose own
    float8 conversion misrounds values that carry into the next binade)."""
    x = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.max(tl.abs(x), axis=0) * inv_qmax
    # IEEE division (a GPU's '/' is approximate): the reference's 1 / scale, bit for bit.
    inv = tl.where(scale > 0, tl.math.div_rn(1.0, tl.where(scale > 0, scale, 1.0)), 0.0)
    y = tl.minimum(tl.maximum(x * inv, -qmax), qmax)
    # Round to the code grid here, in float32, so that the conversion below is exact: the grid
    # step at y is 2^(exponent - MANT_BITS) (int8: 1; fp8 subnormals: that of EMIN).
    if MANT_BITS > 0:  # powers of two built from their bits: the products are exact
        e = tl.maximum(((y.to(tl.int32, bitcast=True) >> 23) & 255) - 127, EMIN) - MANT_BITS
        step = ((e + 127) << 23).to(tl.float32, bitcast=True)
        y = ((y * ((127 - e) << 23).to(tl.float32, bitcast=True) + 12582912.0) - 12582912.0) * step
    else:
        y = (y + 12582912.0) - 12582912.0  # nearest even: |y| < 2^22
    tl.store(dst_ptr + offs, y.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr, scale)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``[T, num_kv_heads, head_size]`` K/V into the caches at ``slot_mapping``, in place.

    The caches must be contiguous and of the same dtype as ``key``/``value``, or 8-bit
    (``kv_quant.DTYPES``: quantized here); K/V rows may be strided (the last dimension
    contiguous).
    """
    num_tokens, kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("reshape_and_cache: the KV caches must be contiguous")
    if key.stride(2) != 1 or value.stride(2) != 1:
        key, value = key.contiguous(), value.contiguous()
    if kv_quant.is_quantized(key_cache.dtype):
        qmax = kv_quant.QMAX[key_cache.dtype]
        _reshape_and_cache_8bit_kernel[(num_tokens, kv_heads)](
            key, value, key_cache, value_cache, kv_scale_view(key_cache),
            kv_scale_view(value_cache), slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1), 1.0 / qmax, qmax,
            HEAD_SIZE=head_size, HEAD_PAD=triton.next_power_of_2(head_size),
            NUM_KV_HEADS=kv_heads, MANT_BITS=_GRID[key_cache.dtype][0],
            EMIN=_GRID[key_cache.dtype][1],
        )
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        HEAD_SIZE=head_size, NUM_KV_HEADS=kv_heads,
        BLOCK=triton.next_power_of_2(kv_heads * head_size),
    )
