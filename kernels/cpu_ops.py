"""Our CPU kernels (``kernels/csrc/cpu_ops.cpp``): build, load, call.

- ``paged_decode_attention``: the torch reference gathers every sequence's K/V blocks into a
  padded copy and runs SDPA on it, a large share of a bfloat16 decode step
  (``loadtest/RESULTS.md``). This kernel reads the blocks in place, and takes several queries per
  sequence (a decode with speculative drafts) as causal decodes of their own.
- ``paged_prefill_attention``: prefill chunks over the paged cache, flash-attention style
  with 16 query rows in a register's lanes; faster than torch's SDPA called per sequence.
- the GGUF block products of ``kernels/csrc/gguf_gemm.cpp`` are built into the same library
  and wrapped in ``kernels/gguf_ops.py``.
- ``rms_norm`` (optionally fused with the residual add), ``silu_and_mul`` and
  ``rotary_embedding``: one pass each where torch runs 3-9 elementwise ops, a real share of
  a bfloat16 prefill step; ``reshape_and_cache``, the KV write, in one call
  instead of four ops. Same ideas as vLLM's ``csrc/cpu/`` kernels.

The library is compiled on first use with the system's C++ compiler into
``~/.cache/pagedserve/kernels/`` (once), keyed by the source, the flags and the CPU,
and loaded with ctypes. No compiler, or a failed build: ``load()`` returns None and callers keep
the torch references. All ops take float32 or bfloat16 CPU tensors and compute in float32.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

SOURCES = [Path(__file__).parent / "csrc" / name for name in ("cpu_ops.cpp", "gguf_gemm.cpp")]
HEADERS = [Path(__file__).parent / "csrc" / "convert.h"]  # part of the build's cache key
# -ffast-math lets expf and the dot-product reductions vectorize (3x). It is given to the compile
# step only: linked with it, gcc adds crtfastmath.o, which turns on flush-to-zero for the whole
# process when the library loads.
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp",
         "-std=c++17", "-fPIC"]
LINK_FLAGS = ["-shared", "-fopenmp"]
CACHE_ENV = "PAGEDSERVE_KERNEL_CACHE"

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_error: str | None = None


def _cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "pagedserve" / "kernels"


def _cpu_key() -> str:
    """The CPU model and flags: ``-march=native`` code must not run on another CPU."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="ignore")
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "\n".join(lines)


def _build(compiler: str) -> Path:
    digest = hashlib.sha256(
        b"".join(s.read_bytes() for s in [*SOURCES, *HEADERS])
        + " ".join(FLAGS + LINK_FLAGS).encode() + _cpu_key().encode()
    ).hexdigest()[:16]
    out = _cache_dir() / f"cpu_ops-{digest}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent server processes never see half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    objs = [f"{tmp[: -len('.so')]}-{s.stem}.o" for s in SOURCES]
    try:
        for source, obj in zip(SOURCES, objs, strict=True):
            subprocess.run([compiler, *FLAGS, "-c", str(source), "-o", obj],
                           check=True, capture_output=True, text=True, timeout=300)
        subprocess.run([compiler, *LINK_FLAGS, *objs, "-o", tmp],
                       check=True, capture_output=True, text=True, timeout=300)
        os.replace(tmp, out)
    finally:
        for path in (tmp, *objs):
            if os.path.exists(path):
                os.unlink(path)
    return out


def load() -> ctypes.CDLL | None:
    """The loaded library, building it on first call; None when it cannot be built (the reason
    is in ``error()``)."""
    global _lib, _tried, _error
    with _lock:
        if _tried:
            return _lib
        _tried = True
        compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
        if compiler is None:
            _error = "no C++ compiler (g++) on PATH"
            return None
        try:
            lib = ctypes.CDLL(str(_build(compiler)))
        except subprocess.CalledProcessError as e:
            _error = f"{compiler} failed: {e.stderr.strip()[-500:]}"
            return None
        except (OSError, subprocess.SubprocessError) as e:
            _error = f"{type(e).__name__}: {e}"
            return None
        ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        signatures = {
            "paged_decode_attention": [ptr] * 7 + [i64] * 6 + [f32],
            "rms_norm": [ptr] * 4 + [i64] * 3 + [f32],
            "silu_and_mul": [ptr] * 2 + [i64] * 2,
            "rotary": [ptr] * 4 + [i64] * 4,
            "reshape_and_cache": [ptr] * 5 + [i64] * 4,
        }
        for suffix in ("f32", "bf16"):
            fn = getattr(lib, f"paged_prefill_attention_{suffix}")
            fn.argtypes = [ptr, i64] + [ptr] * 6 + [i64] * 6 + [f32]
            fn.restype = ctypes.c_int
        lib.cpu_ops_avx512.argtypes, lib.cpu_ops_avx512.restype = [], ctypes.c_int
        signatures["gguf_linear"] = [ptr] * 3 + [i64] * 5
        for name, args in signatures.items():
            for suffix in ("f32", "bf16"):
                fn = getattr(lib, f"{name}_{suffix}")
                fn.argtypes, fn.restype = args, None
        lib.gguf_dequantize.argtypes, lib.gguf_dequantize.restype = [ptr] * 2 + [i64] * 3, None
        _lib = lib
        return _lib


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
    skipped). Slots must be inside the cache (the scheduler's block tables guarantee it)."""
    fn = _kernel("reshape_and_cache", key.dtype)
    num_tokens, kv_heads, head_size = key.shape
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()
            and key_cache.dtype == value.dtype == key.dtype == value_cache.dtype):
        raise ValueError("reshape_and_cache: contiguous caches in the key's dtype")
    # Rows may be strided (k and v are views into the fused qkv projection); heads must not be.
    key, value = (x if x.stride(2) == 1 and x.stride(1) == head_size else x.contiguous()
                  for x in (key, value))
    slot_mapping = slot_mapping.to(torch.int64).contiguous()
    fn(key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
       slot_mapping.data_ptr(), num_tokens, kv_heads * head_size, key.stride(0), value.stride(0))


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention read in place from the paged cache (same contract as
    ``reference.paged_decode_attention``), optionally with several queries per sequence.

    Args:
        query: ``[B, num_heads, head_size]`` float32 or bfloat16, on the CPU.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, contiguous,
            the query's dtype.
        block_table: ``[B, max_blocks_per_seq]`` int32; seq_lens: ``[B]`` int32, each >= 1 and
            covered by its row of the block table (not checked: the scheduler guarantees it).
        out: optional contiguous buffer shaped like ``query`` to write into.
        query_start_loc: ``[B + 1]`` int32: sequence ``i`` has queries ``qsl[i]:qsl[i+1]`` of
            ``query``, its last tokens (a decode with speculative drafts); query ``j`` of
            ``q_len`` attends to the first ``seq_lens[i] - (q_len - 1 - j)`` tokens (causal).
            ``None``: one query per sequence.

    Returns:
        ``[B, num_heads, head_size]`` in the query's dtype (softmax in float32).

    Raises:
        RuntimeError: the library could not be built (see ``error()``).
        ValueError: unsupported dtype, or ``num_heads`` not a multiple of ``num_kv_heads``.
    """
    fn = _kernel("paged_decode_attention", query.dtype)
    num_heads, head_size = query.shape[1:]
    num_seqs = seq_lens.shape[0]
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if key_cache.dtype != query.dtype or not (key_cache.is_contiguous()
                                              and value_cache.is_contiguous()):
        raise ValueError("key/value caches must be contiguous and in the query's dtype")
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
       block_size, block_table.shape[1], scale)
    return out


PREFILL_HEAD_SIZES = (64, 128)


def prefill_supported(head_size: int) -> bool:
    """Whether ``paged_prefill_attention`` runs here: the library built with its AVX-512 loops
    and a head size it was instantiated for."""
    lib = load()
    return lib is not None and bool(lib.cpu_ops_avx512()) and head_size in PREFILL_HEAD_SIZES


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
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
            contiguous, the query's dtype. block_table ``[B, max_blocks]`` int32, seq_lens
            ``[B]`` int32, query_start_loc ``[B + 1]`` int32.

    Returns:
        ``[T, num_heads, head_size]`` in the query's dtype (softmax in float32).

    Raises:
        RuntimeError: the library could not be built. ValueError: head_size not in
        ``PREFILL_HEAD_SIZES``, no AVX-512, dtype or layout unsupported (callers fall back to
        the reference).
    Source: Dao et al., "FlashAttention" (2022); vLLM's CPU attention (``csrc/cpu/``).
    """
    fn = _kernel("paged_prefill_attention", query.dtype)
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    if num_heads % num_kv_heads or head_size not in PREFILL_HEAD_SIZES:
        raise ValueError(f"prefill kernel: head_size {head_size} with {num_heads}/"
                         f"{num_kv_heads} heads is not supported")
    if key_cache.dtype != query.dtype or not (key_cache.is_contiguous()
                                              and value_cache.is_contiguous()):
        raise ValueError("key/value caches must be contiguous and in the query's dtype")
    if query.stride(2) != 1 or query.stride(1) != head_size:
        query = query.contiguous()
    block_table = block_table.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    query_start_loc = query_start_loc.to(torch.int32).contiguous()
    out = torch.empty((num_tokens, num_heads, head_size), dtype=query.dtype)
    if fn(query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(),
          block_table.data_ptr(), seq_lens.data_ptr(), query_start_loc.data_ptr(),
          out.data_ptr(), seq_lens.shape[0], num_heads, num_kv_heads, head_size, block_size,
          block_table.shape[1], scale):
        raise ValueError("prefill kernel: this CPU has no AVX-512 (or head_size unsupported)")
    return out
