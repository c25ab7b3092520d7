"""Products with a GGUF file's quantized blocks (``kernels/csrc/gguf_gemm.cpp``, built into the
``cpu_ops`` library): ``gguf_linear`` multiplies the rows of every type in ``GGUF_TYPES`` in
place, ``gguf_dequantize`` expands them (tests and checks). ``gguf_q8_linear`` is the
int8-activation mode (``csrc/gguf_q8_gemm.cpp``, reference ``kernels/q8_reference.py``) over
the rows repacked into panels (``gguf_q8_repack``; ``gguf_q8_dequantize_rows`` reads rows back,
for an embedding that shares its table with a tied ``lm_head``). The block formats and the
panel layout are ``csrc/gguf_blocks.h``'s. Used by ``gpu/gguf_linear.py``.
"""

from __future__ import annotations

import torch

from pagedserve.kernels import cpu_ops
from pagedserve.kernels.cpu_ops import _SUFFIX, _kernel, error, load

# GGML type id -> (name, weights per block, bytes per block, bytes per block in the int8
# kernel's panels or None), as ggml-common.h lays them out: the formats our kernels multiply in
# place. Legacy types have 32-weight blocks, K-quants 256-weight super-blocks; Q4_K / Q5_K
# panels keep their 6-bit scales decoded to bytes (4 bytes per block more, 2.8 %). Q2_K, Q3_K,
# IQ4_NL and IQ4_XS have no int8 panels: the exact kernel reads them in every mode.
GGUF_TYPES: dict[int, tuple[str, int, int, int | None]] = {
    2: ("Q4_0", 32, 18, 18), 3: ("Q4_1", 32, 20, 20), 6: ("Q5_0", 32, 22, 22),
    7: ("Q5_1", 32, 24, 24), 8: ("Q8_0", 32, 34, 34), 12: ("Q4_K", 256, 144, 148),
    13: ("Q5_K", 256, 176, 180), 14: ("Q6_K", 256, 210, 210),
    10: ("Q2_K", 256, 84, None), 11: ("Q3_K", 256, 110, None), 20: ("IQ4_NL", 32, 18, None),
    23: ("IQ4_XS", 256, 136, None),
}
GGUF_BLOCK_BYTES = {t: v[2] for t, v in GGUF_TYPES.items()}  # bytes per block
GGUF_BLOCK_WEIGHTS = {t: v[1] for t, v in GGUF_TYPES.items()}  # weights per block
# bytes per block in panels, for the types the int8 kernel multiplies
GGUF_PACKED_BYTES = {t: v[3] for t, v in GGUF_TYPES.items() if v[3] is not None}
GGUF_BLOCK_SIZE = 32  # the smallest block: tensor-parallel splits are multiples of it


def row_bytes(qtype: int, in_features: int, packed: bool = False) -> int:
    """Bytes of one row of ``in_features`` weights of GGML type ``qtype`` (``packed``: in the
    int8 kernel's panels)."""
    per_block = (GGUF_PACKED_BYTES if packed else GGUF_BLOCK_BYTES)[qtype]
    return in_features // GGUF_BLOCK_WEIGHTS[qtype] * per_block


def _check_gguf(qweight: torch.Tensor, qtype: int, in_features: int,
                packed: bool = False) -> None:
    kinds = GGUF_PACKED_BYTES if packed else GGUF_TYPES
    if qtype not in kinds:
        names = ", ".join(f"{GGUF_TYPES[t][0]} ({t})" for t in kinds)
        mode = "int8 " if packed else ""
        raise ValueError(f"GGML type {qtype} has no {mode}kernel here; these do: {names}")
    if in_features % GGUF_BLOCK_WEIGHTS[qtype]:
        raise ValueError(f"{in_features} inputs are not whole {GGUF_TYPES[qtype][0]} blocks "
                         f"of {GGUF_BLOCK_WEIGHTS[qtype]}")
    want = row_bytes(qtype, in_features, packed)
    if (qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.shape[1] != want
            or not qweight.is_contiguous()):
        raise ValueError(
            f"qweight must be contiguous uint8 [out, {want}] for {in_features} inputs "
            f"of type {qtype}, got {qweight.dtype} {tuple(qweight.shape)}"
        )


def gguf_linear(x: torch.Tensor, qweight: torch.Tensor, qtype: int,
                generic: bool = False) -> torch.Tensor:
    """``x @ W.T`` with ``W`` in GGUF's quantized blocks, never de-quantized in memory.

    Args:
        x: ``[..., K]`` float32 or bfloat16, K a multiple of the type's block
            (``GGUF_BLOCK_WEIGHTS``: 32, or 256 for the K-quants).
        qweight: ``[N, row_bytes(qtype, K)]`` uint8, contiguous: the tensor's rows as the GGUF
            file stores them.
        qtype: GGML type id, one of ``GGUF_TYPES``.
        generic: use the portable loops instead of the tier's vector ones (tests compare them).

    Returns:
        ``[..., N]`` in x's dtype: float32 products of the exactly de-quantized weights.

    Raises:
        ValueError: unsupported type or dtype, or shapes that do not match.
        RuntimeError: the library could not be built.
    Source: block formats from llama.cpp's ``ggml-common.h``; kernel split after vLLM's
    ``csrc/quantization/gguf/``.
    """
    fn = _kernel("gguf_linear", x.dtype)
    k = x.shape[-1]
    _check_gguf(qweight, qtype, k)
    rows = x.reshape(-1, k).contiguous()
    out = torch.empty((rows.shape[0], qweight.shape[0]), dtype=x.dtype)
    fn(rows.data_ptr(), qweight.data_ptr(), out.data_ptr(), rows.shape[0], qweight.shape[0], k,
       qtype, int(generic))
    return out.view(*x.shape[:-1], qweight.shape[0])


def gguf_dequantize(qweight: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    """The weights of ``qweight`` (see ``gguf_linear``) as float32 ``[N, in_features]``."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"cpu kernels unavailable: {error()}")
    _check_gguf(qweight, qtype, in_features)
    out = torch.empty((qweight.shape[0], in_features), dtype=torch.float32)
    lib.gguf_dequantize(qweight.data_ptr(), out.data_ptr(), qweight.shape[0], in_features, qtype)
    return out


# The int8 kernel's loops: the portable one, the tier's maddubs/madd loop, its vpdpbusd one.
Q8_VARIANTS = ("generic", "simd", "vnni")


def q8_variants() -> tuple[str, ...]:
    """The int8 kernel's variants the loaded tier runs here, slowest first (``generic`` only in
    the generic tier; ``vnni`` where ``cpu_ops.vnni()``: built, reported by the CPU, and not
    capped off by ``PAGEDSERVE_CPU_ISA=avx2|avx512``)."""
    if load() is None:
        return ()
    out = ("generic",) if cpu_ops.isa() == "generic" else ("generic", "simd")
    return (*out, "vnni") if cpu_ops.vnni() else out


Q8_PANEL_ROWS = 16  # rows per repacked panel (csrc/gguf_q8_gemm.cpp)
_Q8_FUNCTIONS: dict[tuple, object] = {}


def _q8_function(dtype: torch.dtype, variant: str | None):
    """The ctypes entry point for ``dtype`` and ``variant`` on the loaded tier, checked once
    and cached (a decode step calls it ~120 times: the checks cost more than a small product)."""
    lib = load()
    key = (id(lib), dtype, variant, cpu_ops.vnni())
    fn = _Q8_FUNCTIONS.get(key)
    if fn is not None:
        return fn
    variants = q8_variants()
    chosen = variant or (variants[-1] if variants else "generic")
    if chosen not in Q8_VARIANTS:
        raise ValueError(f"int8 variant {chosen!r} is not one of {', '.join(Q8_VARIANTS)}")
    if chosen not in variants:
        raise ValueError(f"int8 variant {chosen!r} does not run here (tier {cpu_ops.isa()}, "
                         f"runs {', '.join(variants) or 'none'})")
    _kernel("gguf_q8_linear", dtype)  # the library and dtype checks
    fn = getattr(lib, f"gguf_q8_linear_{_SUFFIX[dtype]}{'_vnni' if chosen == 'vnni' else ''}")
    _Q8_FUNCTIONS[key] = fn
    return fn


def gguf_q8_repack(qweight: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    """GGUF rows (as ``gguf_linear`` takes them) repacked for ``gguf_q8_linear``: panels of 16
    rows with their codes interleaved 4 bytes at a time, the rows padded to a multiple of 16
    (``csrc/gguf_blocks.h``). Returns uint8 ``[ceil(N / 16) * 16, row_bytes(qtype, K,
    packed=True)]``: the file's bytes per row (Q4_K / Q5_K: 2.8 % more, scales decoded)."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"cpu kernels unavailable: {error()}")
    _check_gguf(qweight, qtype, in_features)
    if qtype not in GGUF_PACKED_BYTES:
        _check_gguf(qweight, qtype, in_features, packed=True)  # raises: no int8 kernel
    n = qweight.shape[0]
    padded = -(-n // Q8_PANEL_ROWS) * Q8_PANEL_ROWS
    out = torch.empty((padded, row_bytes(qtype, in_features, packed=True)), dtype=torch.uint8)
    lib.gguf_q8_repack(qweight.data_ptr(), out.data_ptr(), n, in_features, qtype)
    return out


def gguf_q8_dequantize_rows(packed: torch.Tensor, qtype: int, in_features: int,
                            index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` (int64 ``[T]``) of the weights in ``gguf_q8_repack``'s panels as float32
    ``[T, in_features]``, bit-equal to ``gguf_dequantize`` of the file's rows: an embedding
    lookup that shares the table of a tied ``lm_head`` running the int8 kernel.

    Raises:
        ValueError: unsupported type, a ``packed`` of another shape.
        IndexError: an index outside ``[0, rows)`` (``packed``'s padded rows count as inside:
            the caller bounds ids by the real vocabulary).
    """
    lib = load()
    if lib is None:
        raise RuntimeError(f"cpu kernels unavailable: {error()}")
    _check_gguf(packed, qtype, in_features, packed=True)
    if packed.shape[0] % Q8_PANEL_ROWS:
        raise ValueError(f"packed has {packed.shape[0]} rows, not a multiple of 16")
    idx = index.reshape(-1).to(torch.int64).contiguous()
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= packed.shape[0]):
        raise IndexError(f"row index outside [0, {packed.shape[0]})")
    out = torch.empty((idx.numel(), in_features), dtype=torch.float32)
    lib.gguf_q8_dequantize_rows(packed.data_ptr(), idx.data_ptr(), idx.numel(), out.data_ptr(),
                                in_features, qtype)
    return out


def gguf_q8_linear(x: torch.Tensor, packed: torch.Tensor, qtype: int, out_features: int,
                   variant: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` with ``x`` quantized to int8 per 32 values (per 256 against the K-quants)
    and integer block products (llama.cpp's arithmetic; ``q8_reference.gguf_q8_linear`` is the
    same in torch).

    Args:
        x: ``[..., K]`` float32 or bfloat16, K a multiple of the type's block.
        packed: ``gguf_q8_repack``'s panels of W (GGML type ``qtype``), ``out_features`` rows.
        variant: one of ``q8_variants()``; None = the fastest there (its last).
        out: ``[rows, N]`` contiguous in x's dtype to write into (tests poison it), else new.

    Returns:
        ``[..., N]`` in x's dtype.

    Raises:
        ValueError: unsupported type, dtype or variant, or shapes that do not match.
        RuntimeError: the library could not be built, or its buffers not allocated.
    """
    fn = _q8_function(x.dtype, variant)
    k = x.shape[-1]
    _check_gguf(packed, qtype, k, packed=True)
    if packed.shape[0] != -(-out_features // Q8_PANEL_ROWS) * Q8_PANEL_ROWS:
        raise ValueError(f"packed has {packed.shape[0]} rows, not {out_features} padded to 16")
    rows = x.reshape(-1, k).contiguous()
    shape = (rows.shape[0], out_features)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype)
    elif out.shape != shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {x.dtype} {shape}")
    rc = fn(rows.data_ptr(), packed.data_ptr(), out.data_ptr(), shape[0], shape[1], k, qtype,
            int(variant == "generic"))
    if rc != 0:
        raise RuntimeError(f"gguf_q8_linear failed ({rc}: -2 = out of memory)")
    return out.view(*x.shape[:-1], shape[1])
