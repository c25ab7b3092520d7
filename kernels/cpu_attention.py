"""The CPU decode-attention kernel (``kernels/csrc/cpu_attention.cpp``): build, load, call.

The torch reference gathers every sequence's K/V blocks into a padded copy and runs SDPA on
it; at 32 decodes of ~200 tokens that gather and SDPA were 44% of a bfloat16 step. This kernel
reads the blocks in place. It is compiled on first use with the system's C++ compiler into
``~/.cache/pagedserve/kernels/`` (a second or two), keyed by the source, the flags and the
CPU, and loaded with ctypes. No compiler, or a failed build: ``load()`` returns None and the
caller keeps the torch reference.
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

SOURCE = Path(__file__).parent / "csrc" / "cpu_attention.cpp"
# -ffast-math lets expf and the dot-product reductions vectorize (3x). It is given to the compile
# step only: linked with it, gcc adds crtfastmath.o, which turns on flush-to-zero for the whole
# process when the library loads.
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-std=c++17", "-fPIC"]
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
        SOURCE.read_bytes() + " ".join(FLAGS + LINK_FLAGS).encode() + _cpu_key().encode()
    ).hexdigest()[:16]
    out = _cache_dir() / f"cpu_attention-{digest}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent server processes never see half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    obj = tmp[: -len(".so")] + ".o"
    try:
        for cmd in ([compiler, *FLAGS, "-c", str(SOURCE), "-o", obj],
                    [compiler, *LINK_FLAGS, obj, "-o", tmp]):
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
        os.replace(tmp, out)
    finally:
        for path in (tmp, obj):
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
        args = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float]
        for name in ("paged_decode_attention_f32", "paged_decode_attention_bf16"):
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = None
        _lib = lib
        return _lib


def error() -> str | None:
    """Why ``load()`` returned None, if it did."""
    return _error


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention read in place from the paged cache (same contract as
    ``reference.paged_decode_attention``).

    Args:
        query: ``[B, num_heads, head_size]`` float32 or bfloat16, on the CPU.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, contiguous,
            the query's dtype.
        block_table: ``[B, max_blocks_per_seq]`` int32; seq_lens: ``[B]`` int32, each >= 1 and
            covered by its row of the block table (not checked: the scheduler guarantees it).
        out: optional ``[B, num_heads, head_size]`` contiguous buffer to write into.

    Returns:
        ``[B, num_heads, head_size]`` in the query's dtype (softmax in float32).

    Raises:
        RuntimeError: the library could not be built (see ``error()``).
        ValueError: unsupported dtype, or ``num_heads`` not a multiple of ``num_kv_heads``.
    """
    lib = load()
    if lib is None:
        raise RuntimeError(f"cpu attention kernel unavailable: {_error}")
    num_seqs, num_heads, head_size = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if query.dtype == torch.float32:
        fn = lib.paged_decode_attention_f32
    elif query.dtype == torch.bfloat16:
        fn = lib.paged_decode_attention_bf16
    else:
        raise ValueError(f"cpu decode attention supports float32 and bfloat16, not {query.dtype}")
    if key_cache.dtype != query.dtype or not (key_cache.is_contiguous()
                                              and value_cache.is_contiguous()):
        raise ValueError("key/value caches must be contiguous and in the query's dtype")
    query = query.contiguous()
    block_table = block_table.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    if out is None:
        out = torch.empty_like(query)
    fn(query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_table.data_ptr(),
       seq_lens.data_ptr(), out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_size,
       block_size, block_table.shape[1], scale)
    return out
