"""8-bit KV cache rows (``--kv-cache-dtype fp8|fp8_e4m3|fp8_e5m2|int8``): the layout, and the
torch reference of the quantize (on write) and the dequantize (on read).

Layout: each (token, kv head) row of ``head_size`` values is ``head_size`` 8-bit codes followed
by the row's float32 scale (4 bytes), as a GGUF ``block_q8_0`` keeps its scale beside its quants
(llama.cpp's ``ggml-common.h``). A cache is ``[num_blocks, block_size, num_kv_heads, head_size +
4]`` in the 8-bit dtype (``torch.int8``, ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``); the
last 4 elements of a row are its scale's bytes. Value = code * scale, with
``scale = absmax(row) / QMAX[dtype]``.

Why one scale per (token, head), not vLLM's per-tensor ``k_scale``/``v_scale`` (1.0 unless a
checkpoint calibrates them): int8 cannot work without a scale fitted to the values, and with
1.0 fp8 e4m3 loses rows of small values to its subnormals (below 2^-6) and clips above 448;
fitted to each row, every row uses the whole range. A row is written once, so its scale is known
when it is written: nothing to calibrate, no running maximum. Scales inside the rows: every copy
of a block (beam copy-on-write, the P/D transfer, shared-storage block files) carries them as is.
Cost: 4 bytes per ``head_size`` codes, 68 bytes per 64 values against bfloat16's 128 (1.88x the
tokens per byte; 1.94x at head_size 128).

The C kernels (``kernels/csrc/kv_quant.h``) compute the same codes: same scale arithmetic
(``absmax * (1 / QMAX)``, then ``x * (1 / scale)``), round to nearest even.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # a float32 per row
QMAX: dict[torch.dtype, float] = {
    torch.int8: 127.0,
    torch.float8_e4m3fn: 448.0,  # OCP FP8 E4M3 (no infinities): the largest finite value
    torch.float8_e5m2: 57344.0,
}
DTYPES = tuple(QMAX)
# The ``kv_kind`` argument of the C kernels: 0 = the cache is in the query's dtype.
KIND: dict[torch.dtype, int] = {torch.int8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether caches of ``dtype`` use this module's layout (codes + scale per row)."""
    return dtype in QMAX


def row_elems(head_size: int, dtype: torch.dtype) -> int:
    """Elements of one (token, kv head) row in a cache of ``dtype``."""
    return head_size + SCALE_BYTES if is_quantized(dtype) else head_size


def head_size_of(cache: torch.Tensor) -> int:
    """``head_size`` of a ``[num_blocks, block_size, num_kv_heads, row_elems]`` cache."""
    return cache.shape[-1] - SCALE_BYTES if is_quantized(cache.dtype) else cache.shape[-1]


def kind(cache: torch.Tensor) -> int:
    """The C kernels' ``kv_kind`` of a cache (0: not quantized)."""
    return KIND.get(cache.dtype, 0)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``[..., head_size]`` (any float dtype) → ``[..., head_size + 4]`` of ``dtype``:
    codes, then the float32 scale's bytes. An all-zero row has scale 0 and zero codes.

    Raises:
        ValueError: ``dtype`` is not one of ``DTYPES``.
    """
    if dtype not in QMAX:
        raise ValueError(f"not an 8-bit KV cache dtype: {dtype} (one of {DTYPES})")
    qmax = QMAX[dtype]
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) * (1.0 / qmax)  # [..., 1] float32
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    y = xf * inv
    if dtype == torch.int8:
        codes = torch.round(y).clamp_(-qmax, qmax).to(torch.int8)
    else:  # torch rounds to nearest even; the clamp keeps a rounding slip off NaN
        codes = y.clamp_(-qmax, qmax).to(dtype)
    return torch.cat([codes.view(torch.uint8), scale.view(torch.uint8)], -1).view(dtype)


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[..., head_size + 4]`` quantized rows → ``[..., head_size]`` values in ``dtype``
    (computed in float32)."""
    head_size = rows.shape[-1] - SCALE_BYTES
    raw = rows.view(torch.uint8)
    scale = raw[..., head_size:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :head_size].float() * scale).to(dtype)
