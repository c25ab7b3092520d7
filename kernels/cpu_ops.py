"""Our CPU kernels (``kernels/csrc/``): build, load, call.

- ``paged_decode_attention`` (``decode_attention.cpp``): the torch reference gathers every
  sequence's K/V blocks into a padded copy and runs SDPA on it, a large share of a bfloat16
  decode step (``loadtest/RESULTS.md``). This kernel reads the blocks in place, and takes
  several queries per sequence (a decode with speculative drafts) as causal decodes.
- ``paged_prefill_attention`` (``prefill_attention.cpp``): prefill chunks over the paged
  cache, flash-attention style with a register's lanes of query rows; faster than torch's SDPA
  called per sequence.
- the GGUF block products of ``gguf_gemm.cpp``, wrapped in ``kernels/gguf_ops.py``.
- ``rms_norm`` (optionally fused with the residual add), ``silu_and_mul`` and
  ``rotary_embedding`` (``elementwise.cpp``): one pass each where torch runs 3-9 elementwise
  ops, a real share of a bfloat16 prefill step; ``reshape_and_cache``, the KV write, in one
  call instead of four ops. Same ideas as vLLM's ``csrc/cpu/`` kernels.

One library per ISA tier (``kernels/cpu_isa.py``: generic, avx2, avx512), compiled on first use
with the system's C++ compiler into ``~/.cache/pagedserve/kernels/`` (once per tier), keyed by
the sources, the flags and the tier, and loaded with ctypes. ``load()`` takes the best tier the
CPU reports and ``PAGEDSERVE_CPU_ISA`` allows, and whether the int8 kernel may use VNNI
(``isa()`` says the tier, ``vnni()`` the latter, ``isa_level()`` both in one name such as
``avx512_vnni``; the start-up log ``cpu_kernels_loaded`` too). No
compiler, or a failed build: ``load()`` returns None and callers keep the torch references. All
ops take float32 or bfloat16 CPU tensors and compute in float32; the KV write and the attention
kernels also take 8-bit caches (``--kv-cache-dtype``: int8 / fp8 rows with a scale each,
``kernels/kv_quant.py``), quantized as written and dequantized to float32 as read.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator

import structlog
import torch

from pagedserve.kernels import cpu_isa, kv_quant
from pagedserve.kernels.cpu_build import CACHE_ENV as CACHE_ENV  # re-exported
from pagedserve.kernels.cpu_build import load_isa

log = structlog.get_logger(__name__)

_lock = threading.RLock()
_lib: ctypes.CDLL | None = None
_isa: str | None = None
_vnni = False  # the int8 kernel may run its vpdpbusd loop (cap, CPU flag and build allow it)
_tried = False
_error: str | None = None


def load() -> ctypes.CDLL | None:
    """The loaded library, building it on first call; None when it cannot be built (the reason
    is in ``error()``). The tier is the best one the CPU and ``PAGEDSERVE_CPU_ISA`` allow; if
    its build fails, the next lower one is tried.

    Raises:
        ValueError: ``PAGEDSERVE_CPU_ISA`` is not one of ``cpu_isa.CAPS``.
    """
    global _lib, _isa, _vnni, _tried, _error
    with _lock:
        if _tried:
            return _lib
        cap = cpu_isa.requested_cap()
        _tried, _lib, _isa, _vnni = True, None, None, False
        best = cpu_isa.select(cap)
        tiers = cpu_isa.ISAS[: cpu_isa.ISAS.index(best) + 1]
        for isa in reversed(tiers):
            try:
                _lib, _isa = load_isa(isa), isa
                _vnni = _has_vnni(_lib, isa, cap)
                break
            except RuntimeError as e:
                _error = str(e)
                log.warning("cpu_kernels_build_failed", isa=isa, reason=_error)
        if _lib is not None:
            _error = None
            torch_isa = torch.backends.cpu.get_cpu_capability()
            log.info("cpu_kernels_loaded", isa=cpu_isa.level(_isa, _vnni), tier=_isa,
                     vnni=_vnni, cpu_supports=cpu_isa.select_level(), cap=cap,
                     torch_cpu_capability=torch_isa)
            tier_cap = cpu_isa.cap_tier(cap)
            if tier_cap in ("generic", "avx2") and torch_isa.lower() not in (tier_cap,
                                                                               "default"):
                log.warning("cpu_isa_cap_not_applied_to_torch", cap=cap, torch=torch_isa,
                            hint="set PAGEDSERVE_CPU_ISA before torch is imported, or call "
                                 "kernels.cpu_isa.cap_torch_env() first")
        return _lib


def _has_vnni(lib: ctypes.CDLL, tier: str, cap: str | None) -> bool:
    """The library has the VNNI entry points and ``cpu_isa.vnni_allowed`` lets them run."""
    return hasattr(lib, "gguf_q8_linear_f32_vnni") and cpu_isa.vnni_allowed(tier, cap)


def isa() -> str | None:
    """The library tier of the loaded kernels (``generic``, ``avx2`` or ``avx512``), loading
    them if needed; None when they cannot be built."""
    return _isa if load() is not None else None


def vnni() -> bool:
    """Whether the loaded kernels' int8 product may run its ``vpdpbusd`` loop (False when they
    cannot be built)."""
    return _vnni if load() is not None else False


def isa_level() -> str | None:
    """What runs, as one of ``cpu_isa.LEVELS`` (the tier, ``_vnni`` where ``vnni()``): the
    name ``PAGEDSERVE_CPU_ISA`` takes for it; None when the kernels cannot be built."""
    return cpu_isa.level(_isa, _vnni) if load() is not None and _isa else None


@contextlib.contextmanager
def use_isa(name: str, vnni: bool = True) -> Iterator[ctypes.CDLL]:
    """Run the kernels of tier ``name`` inside the block (process-wide; tests and benchmarks),
    whatever ``PAGEDSERVE_CPU_ISA`` says; ``vnni``: let the int8 kernel use VNNI where the CPU
    has it.

    Raises:
        ValueError, RuntimeError: as ``load_isa``.
    """
    global _lib, _isa, _vnni, _tried
    with _lock:
        load()
        saved = (_lib, _isa, _vnni, _tried)
        lib = load_isa(name)
        _lib, _isa, _vnni, _tried = lib, name, vnni and _has_vnni(lib, name, None), True
    try:
        yield _lib
    finally:
        with _lock:
            _lib, _isa, _vnni, _tried = saved


def error() -> str | None:
    """Why ``load()`` returned None, if it did."""
    return _error


_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _kernel(name: str, dtype: torch.dtype):
    lib = load()
    if lib is None:
        raise RuntimeError(f"cpu kernels unavailable: {_error}")
    if dtype not in _SUFFIX:
        raise ValueError(f"cpu kernels support float32 and bfloat16, not {dtype}")
    return getattr(lib, f"{name}_{_SUFFIX[dtype]}")


def _check_caches(op: str, x: torch.Tensor, key_cache: torch.Tensor,
                  value_cache: torch.Tensor) -> int:
    """The caches' ``kv_kind`` for the C kernels, after checking they are contiguous, alike,
    and either in ``x``'s dtype or 8-bit (``kv_quant``) with rows of ``x``'s head size + 4.

    Raises:
        ValueError: says which of these fails.
    """
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError(f"{op}: the key/value caches must be contiguous")
    if key_cache.dtype != value_cache.dtype or key_cache.shape != value_cache.shape:
        raise ValueError(f"{op}: key and value caches differ ({key_cache.dtype} "
                         f"{tuple(key_cache.shape)} vs {value_cache.dtype} "
                         f"{tuple(value_cache.shape)})")
    if kv_quant.is_quantized(key_cache.dtype):
        if kv_quant.head_size_of(key_cache) != x.shape[-1]:
            raise ValueError(f"{op}: 8-bit cache rows of {key_cache.shape[-1]} elements do not "
                             f"hold head_size {x.shape[-1]} + {kv_quant.SCALE_BYTES} scale bytes")
        return kv_quant.kind(key_cache)
    if key_cache.dtype != x.dtype or key_cache.shape[-1] != x.shape[-1]:
        raise ValueError(f"{op}: caches in {key_cache.dtype} with rows of {key_cache.shape[-1]} "
                         f"for {x.dtype} heads of {x.shape[-1]}: same dtype and head size, or an "
                         f"8-bit cache ({', '.join(str(d) for d in kv_quant.DTYPES)})")
    return 0


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of each row of ``x`` ``[N, dim]`` (rows contiguous) times ``weight`` ``[dim]``.

    With ``residual`` (``[N, dim]`` contiguous, updated in place to ``residual + x``) the sum is
    what gets normalised, as vLLM's ``fused_add_rms_norm``. Returns a new ``[N, dim]`` tensor.
    Source: Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019).
    """
    fn = _kernel("rms_norm", x.dtype)
    rows, dim = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.dtype != x.dtype or (residual is not None and (
            residual.dtype != x.dtype or not residual.is_contiguous())):
        raise ValueError("rms_norm: weight and residual must be in x's dtype, residual contiguous")
    out = torch.empty((rows, dim), dtype=x.dtype)
    fn(out.data_ptr(), x.data_ptr(), 0 if residual is None else residual.data_ptr(),
       weight.data_ptr(), rows, dim, x.stride(0), eps)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for ``x`` ``[N, 2I]`` → ``[N, I]`` (Shazeer, "GLU Variants
    Improve Transformer", 2020)."""
    fn = _kernel("silu_and_mul", x.dtype)
    x = x.contiguous()
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, inter), dtype=x.dtype)
    fn(out.data_ptr(), x.data_ptr(), rows, inter)
    return out


def rotary_embedding(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    num_heads: int, head_size: int,
) -> None:
    """Non-interleaved RoPE, in place, on the first ``num_heads`` heads of each row.

    Args:
        x: ``[T, >= num_heads * head_size]`` with unit stride in its last dim (e.g. the fused
            qkv projection, rotating q's and k's heads together).
        positions: ``[T]`` int64. cos, sin: ``[max_positions, head_size]`` float32, sin with
            rotate_half's sign folded into its first half (``gpu.models.llama.RotaryEmbedding``).
    Source: Su et al., "RoFormer" (2021).
    """
    fn = _kernel("rotary", x.dtype)
    if x.stride(1) != 1 or x.shape[1] < num_heads * head_size:
        raise ValueError("rotary_embedding: x needs unit stride and num_heads * head_size columns")
    positions = positions.to(torch.int64).contiguous()
    if cos.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("rotary_embedding: cos/sin must be contiguous float32")
    fn(x.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), x.shape[0],
       num_heads, head_size, x.stride(0))


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write this step's K/V into the paged cache in one call (``reference.reshape_and_cache``'s
    contract: ``[T, num_kv_heads, head_size]`` rows, ``slot_mapping`` ``[T]`` int64, ``-1``
    skipped); into an 8-bit cache each (token, head) row is quantized with its own scale
    (``kv_quant.quantize``'s codes). Slots must be inside the cache (the scheduler's block
    tables guarantee it).

    Raises:
        ValueError: key and value differ in dtype, or the caches do not fit them
            (``_check_caches``).
    """
    fn = _kernel("reshape_and_cache", key.dtype)
    num_tokens, kv_heads, head_size = key.shape
    if value.dtype != key.dtype:
        raise ValueError("reshape_and_cache: key and value in different dtypes")
    kv_kind = _check_caches("reshape_and_cache", key, key_cache, value_cache)
    # Rows may be strided (k and v are views into the fused qkv projection); heads must not be.
    key, value = (x if x.stride(2) == 1 and x.stride(1) == head_size else x.contiguous()
                  for x in (key, value))
    slot_mapping = slot_mapping.to(torch.int64).contiguous()
    fn(key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
       slot_mapping.data_ptr(), num_tokens, kv_heads * head_size, key.stride(0), value.stride(0),
       head_size, kv_kind)


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Decode attention read in place from the paged cache (same contract as
    ``reference.paged_decode_attention``), optionally with several queries per sequence.

    Args:
        query: ``[B, num_heads, head_size]`` float32 or bfloat16, on the CPU.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, contiguous,
            the query's dtype; or 8-bit (``int8``, ``float8_e4m3fn``, ``float8_e5m2``) with rows
            of ``head_size + 4`` (``kernels/kv_quant.py``), dequantized as read.
        block_table: ``[B, max_blocks_per_seq]`` int32; seq_lens: ``[B]`` int32, each >= 1 and
            covered by its row of the block table (not checked: the scheduler guarantees it).
        out: optional contiguous buffer shaped like ``query`` to write into.
        query_start_loc: ``[B + 1]`` int32: sequence ``i`` has queries ``qsl[i]:qsl[i+1]`` of
            ``query``, its last tokens (a decode with speculative drafts); query ``j`` of
            ``q_len`` attends to the first ``seq_lens[i] - (q_len - 1 - j)`` tokens (causal).
            ``None``: one query per sequence.
        sliding_window, logits_soft_cap: as ``reference.paged_decode_attention``; with a
            window only the last ``sliding_window`` tokens of each query are read, so the
            blocks before them are never touched (they may be freed ones).

    Returns:
        ``[B, num_heads, head_size]`` in the query's dtype (softmax in float32).

    Raises:
        RuntimeError: the library could not be built (see ``error()``).
        ValueError: unsupported dtype, caches that do not fit the query (``_check_caches``), or
            ``num_heads`` not a multiple of ``num_kv_heads``.
    """
    fn = _kernel("paged_decode_attention", query.dtype)
    num_heads, head_size = query.shape[1:]
    num_seqs = seq_lens.shape[0]
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    kv_kind = _check_caches("paged_decode_attention", query, key_cache, value_cache)
    query = query.contiguous()
    block_table = block_table.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    if out is None:
        out = torch.empty_like(query)
    qsl = 0
    if query_start_loc is not None:
        query_start_loc = query_start_loc.to(torch.int32).contiguous()
        qsl = query_start_loc.data_ptr()
    fn(query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_table.data_ptr(),
       seq_lens.data_ptr(), qsl, out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_size,
       block_size, block_table.shape[1], scale, kv_kind, sliding_window or 0,
       logits_soft_cap or 0.0)
    return out


PREFILL_HEAD_SIZES = (64, 128)


def prefill_supported(head_size: int) -> bool:
    """Whether ``paged_prefill_attention`` runs here: an avx2 or avx512 library and a head size
    it was instantiated for."""
    lib = load()
    return lib is not None and bool(lib.cpu_ops_has_prefill()) and head_size in PREFILL_HEAD_SIZES


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
    """Causal attention of prefill chunks over the paged cache, read in place
    (``reference.paged_prefill_attention``'s contract), flash-attention style.

    torch's fused CPU attention, which the reference calls once per sequence, ran at 76
    GFLOP/s on 256-token prompts (a third of a prefill step); this kernel tiles queries by
    (sequence, kv head, 16 tokens) so all the heads of a GQA group share each K/V row.

    Args:
        query: ``[T, num_heads, head_size]`` float32 or bfloat16 (rows may be strided, as views
            of the fused qkv projection are); sequence ``i``'s chunk is rows
            ``query_start_loc[i]:query_start_loc[i+1]``, its last tokens.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``,
            contiguous, the query's dtype, or 8-bit as ``paged_decode_attention`` takes them.
            block_table ``[B, max_blocks]`` int32, seq_lens
            ``[B]`` int32, query_start_loc ``[B + 1]`` int32.
        sliding_window, logits_soft_cap: as ``paged_decode_attention``.

    Returns:
        ``[T, num_heads, head_size]`` in the query's dtype (softmax in float32).

    Raises:
        RuntimeError: the library could not be built. ValueError: head_size not in
        ``PREFILL_HEAD_SIZES``, the generic tier, dtype or layout unsupported (callers fall back to
        the reference).
    Source: Dao et al., "FlashAttention" (2022); vLLM's CPU attention (``csrc/cpu/``).
    """
    fn = _kernel("paged_prefill_attention", query.dtype)
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    if num_heads % num_kv_heads or head_size not in PREFILL_HEAD_SIZES:
        raise ValueError(f"prefill kernel: head_size {head_size} with {num_heads}/"
                         f"{num_kv_heads} heads is not supported")
    kv_kind = _check_caches("paged_prefill_attention", query, key_cache, value_cache)
    if query.stride(2) != 1 or query.stride(1) != head_size:
        query = query.contiguous()
    block_table = block_table.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    query_start_loc = query_start_loc.to(torch.int32).contiguous()
    out = torch.empty((num_tokens, num_heads, head_size), dtype=query.dtype)
    if fn(query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(),
          block_table.data_ptr(), seq_lens.data_ptr(), query_start_loc.data_ptr(),
          out.data_ptr(), seq_lens.shape[0], num_heads, num_kv_heads, head_size, block_size,
          block_table.shape[1], scale, kv_kind, sliding_window or 0, logits_soft_cap or 0.0):
        raise ValueError(f"prefill kernel: not in the {_isa} kernels (or head_size unsupported)")
    return out
