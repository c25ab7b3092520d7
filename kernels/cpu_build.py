"""Building and binding one ISA tier of our CPU kernels (``kernels/csrc/``): compile with
the tier's flags (``kernels/cpu_isa.py``) into a cache keyed by the sources, the compiler and the
flags, load with ctypes, declare the C signatures. ``kernels/cpu_ops.py`` picks the tier.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import structlog

from pagedserve.kernels import cpu_isa

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / name for name in ("cpu_ops.cpp", "decode_attention.cpp",
                                    "prefill_attention.cpp", "elementwise.cpp", "gguf_gemm.cpp",
                                    "gguf_q8_gemm.cpp", "lora_bgmv.cpp")]
# Compiled a second time with the tier's VNNI flags (cpu_isa.VNNI_FLAGS) where it has them:
# its entry points are named *_vnni and called only when the CPU reports the flag.
VNNI_SOURCE = CSRC / "gguf_q8_gemm.cpp"
# Part of the build's cache key.
HEADERS = [CSRC / "convert.h", CSRC / "simd.h", CSRC / "kv_quant.h", CSRC / "gguf_blocks.h"]
LINK_FLAGS = ["-shared", "-fopenmp"]
CACHE_ENV = "PAGEDSERVE_KERNEL_CACHE"

log = structlog.get_logger(__name__)


def _cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "pagedserve" / "kernels"


def build(compiler: str, isa: str) -> Path:
    """The library of tier ``isa``, compiled with ``compiler`` unless already cached."""
    flags = [*cpu_isa.COMMON_FLAGS, *cpu_isa.ISA_FLAGS[isa]]
    vnni_flags = [*flags, *cpu_isa.VNNI_FLAGS[isa], "-DPAGEDSERVE_Q8_VNNI"] if isa in (
        cpu_isa.VNNI_FLAGS) else None
    digest = hashlib.sha256(
        b"".join(s.read_bytes() for s in [*SOURCES, *HEADERS])
        + " ".join([compiler, *flags, *LINK_FLAGS, *(vnni_flags or [])]).encode()
    ).hexdigest()[:16]
    out = _cache_dir() / f"cpu_ops-{isa}-{digest}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # ~15 s of compiling on a 2-core machine, before the server's next log line: say so.
    log.info("building CPU kernels (first start only)", isa=isa, cache=str(out.parent))
    start = time.perf_counter()
    # Build beside the target and rename: concurrent server processes never see half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    objs = [f"{tmp[: -len('.so')]}-{s.stem}.o" for s in SOURCES]
    try:
        for source, obj in zip(SOURCES, objs, strict=True):
            subprocess.run([compiler, *flags, "-c", str(source), "-o", obj],
                           check=True, capture_output=True, text=True, timeout=300)
        vnni_obj = f"{tmp[: -len('.so')]}-vnni.o"
        # A compiler without the VNNI flag builds the tier without those entry points.
        if vnni_flags is not None and subprocess.run(
                [compiler, *vnni_flags, "-c", str(VNNI_SOURCE), "-o", vnni_obj],
                capture_output=True, text=True, timeout=300).returncode == 0:
            objs.append(vnni_obj)
        subprocess.run([compiler, *LINK_FLAGS, *objs, "-o", tmp],
                       check=True, capture_output=True, text=True, timeout=300)
        os.replace(tmp, out)
        log.info("cpu_kernels_built", isa=isa, seconds=round(time.perf_counter() - start, 1),
                 library=str(out))
    finally:
        for path in {tmp, *objs, f"{tmp[: -len('.so')]}-vnni.o"}:
            if os.path.exists(path):
                os.unlink(path)
    return out


def bind(lib: ctypes.CDLL) -> None:
    """Declare the C signatures (ctypes would otherwise pass ints as 32-bit)."""
    ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    signatures = {
        # + kv_kind, sliding window (0: none), soft cap (0: none)
        "paged_decode_attention": [ptr] * 7 + [i64] * 6 + [f32, i64, i64, f32],
        "rms_norm": [ptr] * 4 + [i64] * 3 + [f32],
        "silu_and_mul": [ptr] * 2 + [i64] * 2,
        "rotary": [ptr] * 4 + [i64] * 5,  # + rotary_dim
        "reshape_and_cache": [ptr] * 5 + [i64] * 6,  # + head_size, kv_kind
        "gguf_linear": [ptr] * 3 + [i64] * 5,
        "lora_bgmv": [ptr] * 6 + [i64] * 7,  # + bounds, parts
    }
    for name, args in signatures.items():
        for suffix in ("f32", "bf16"):
            fn = getattr(lib, f"{name}_{suffix}")
            fn.argtypes, fn.restype = args, None
    for suffix in ("f32", "bf16"):
        fn = getattr(lib, f"paged_prefill_attention_{suffix}")
        fn.argtypes = [ptr, i64] + [ptr] * 6 + [i64] * 6 + [f32, i64, i64, f32]  # as decode
        fn.restype = ctypes.c_int
    lib.cpu_ops_isa.argtypes, lib.cpu_ops_isa.restype = [], ctypes.c_char_p
    lib.cpu_ops_has_prefill.argtypes, lib.cpu_ops_has_prefill.restype = [], ctypes.c_int
    lib.gguf_dequantize.argtypes, lib.gguf_dequantize.restype = [ptr] * 2 + [i64] * 3, None
    lib.gguf_q8_repack.argtypes, lib.gguf_q8_repack.restype = [ptr] * 2 + [i64] * 3, None
    lib.gguf_q8_dequantize_rows.argtypes = [ptr, ptr, i64, ptr, i64, i64]
    lib.gguf_q8_dequantize_rows.restype = None
    for variant in ("", "_vnni"):
        for suffix in ("f32", "bf16"):
            fn = getattr(lib, f"gguf_q8_linear_{suffix}{variant}", None)
            if fn is not None:
                fn.argtypes, fn.restype = [ptr] * 3 + [i64] * 5, ctypes.c_int


def load_isa(isa: str) -> ctypes.CDLL:
    """The library of one tier, built if needed, whatever ``PAGEDSERVE_CPU_ISA`` says (tests
    and benchmarks compare tiers with it; ``use_isa`` makes it the active one).

    Raises:
        ValueError: ``isa`` is not a tier, or this CPU cannot execute it.
        RuntimeError: no compiler, or the build failed (the message says why).
    """
    if isa not in cpu_isa.ISAS:
        raise ValueError(f"unknown CPU ISA tier {isa!r}: one of {', '.join(cpu_isa.ISAS)}")
    if isa not in cpu_isa.supported():
        missing = sorted(cpu_isa.REQUIRED_FLAGS[isa] - cpu_isa.cpu_flags())
        raise ValueError(f"this CPU cannot run the {isa} kernels (it lacks {', '.join(missing)})")
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    try:
        lib = ctypes.CDLL(str(build(compiler, isa)))
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"{compiler} failed: {e.stderr.strip()[-500:]}") from e
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"{type(e).__name__}: {e}") from e
    bind(lib)
    built = lib.cpu_ops_isa().decode()
    if built != isa:  # a compiler that ignored the -m flags
        raise RuntimeError(f"{compiler} built the {built} kernels for the {isa} flags")
    return lib
