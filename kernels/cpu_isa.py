"""Which instruction-set tier our CPU kernels run at, whether their int8 kernel may use VNNI,
and the compiler flags of each tier.

No torch import here: ``cap_torch_env()`` must run before torch is imported (ATen, oneDNN and
MKL read their ISA caps once, when they first dispatch), so benchmark scripts call it first.

Library tiers, lowest first (``ISAS``), one build each:

- ``generic``: the portable loops, no ``-m`` flags (any CPU, non-x86 included);
- ``avx2``: AVX2 + FMA + F16C, 8 float32 lanes (Intel Haswell and later, AMD Zen 1-3, most
  cloud instances);
- ``avx512``: AVX-512 F/BW/DQ/VL, 16 lanes (Intel Skylake-SP and later, AMD Zen 4/5). The
  kernels use no BF16 or AMX instructions, so no tier needs them.

VNNI (``vpdpbusd``, the int8 kernel's fastest loop) lives in separately built entry points of
the avx2 and avx512 libraries (``VNNI_FLAGS``) and runs only where the CPU reports the tier's
flag (``VNNI_CPU_FLAG``). CPUs come in five classes, the ``LEVELS``:

- ``avx2``: no VNNI (AMD Zen 1-3, Intel Haswell to Ice Lake client);
- ``avx2_vnni``: + AVX-VNNI (Intel Alder Lake and later client);
- ``avx512``: no VNNI (Intel Skylake-SP);
- ``avx512_vnni``: + AVX512-VNNI (Intel Cascade Lake and later, AMD Zen 4/5);
- and ``generic``.

``PAGEDSERVE_CPU_ISA`` takes a level (or ``amx``: no cap; AMX-INT8 where present, for later
kernels), so any machine can measure the lower ones: ``avx2`` and ``avx512`` run no
``vpdpbusd`` at all, the ``_vnni`` levels run it where the CPU has it. What runs is the best
both the CPU (``/proc/cpuinfo``'s flags) and the cap allow (``select_level``); a cap above the
CPU runs the best it has. An unknown value is an error, not a silent fallback. torch is capped
to the tier only (its float paths use no VNNI).
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

ISA_ENV = "PAGEDSERVE_CPU_ISA"
ISAS = ("generic", "avx2", "avx512")  # the tiers we build, lowest first
LEVELS = ("generic", "avx2", "avx2_vnni", "avx512", "avx512_vnni")  # what a CPU runs
CAPS = (*LEVELS, "amx")
# Each cap's highest tier, and whether it lets the int8 kernel run vpdpbusd.
CAP_LIMITS: dict[str, tuple[str, bool]] = {
    "generic": ("generic", False), "avx2": ("avx2", False), "avx2_vnni": ("avx2", True),
    "avx512": ("avx512", False), "avx512_vnni": ("avx512", True), "amx": ("avx512", True),
}

# The CPU flags (as /proc/cpuinfo spells them) each tier's code needs.
REQUIRED_FLAGS = {
    "generic": frozenset(),
    "avx2": frozenset({"avx", "avx2", "fma", "f16c"}),
    "avx512": frozenset({"avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq",
                         "avx512vl"}),
}

# Compile flags per tier. -ffast-math lets expf and the dot-product reductions vectorize (3x);
# it is given to the compile step only (linked with it, gcc adds crtfastmath.o, which turns on
# flush-to-zero for the whole process when the library loads).
COMMON_FLAGS = ["-O3", "-ffast-math", "-fopenmp", "-std=c++17", "-fPIC"]
# Exactly the features REQUIRED_FLAGS checks (not -march=x86-64-v3/v4, which older compilers
# lack and which would also let scalar code use BMI/MOVBE the check does not look for).
ISA_FLAGS = {
    "generic": [],
    "avx2": ["-mavx", "-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx", "-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512dq",
               "-mavx512vl", "-mprefer-vector-width=512"],
}

# The int8-activation GGUF kernel (gguf_q8_gemm.cpp) is also built with these, into entry points
# of their own that run only where the CPU reports VNNI_CPU_FLAG and the cap allows it
# (vpdpbusd: AVX-VNNI's VEX form on Intel Alder Lake+ / AMD Zen 5, AVX512-VNNI on Intel
# Cascade Lake+ / AMD Zen 4+); the tiers themselves do not require it.
VNNI_FLAGS = {"avx2": ["-mavxvnni"], "avx512": ["-mavx512vnni"]}
VNNI_CPU_FLAG = {"avx2": "avx_vnni", "avx512": "avx512_vnni"}

# What each cap tells torch (ATen's kernels, oneDNN, MKL), so it runs the same tier as ours.
TORCH_ENV = {
    "generic": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "amx": {},
}
TORCH_ENV["avx2_vnni"], TORCH_ENV["avx512_vnni"] = TORCH_ENV["avx2"], TORCH_ENV["avx512"]


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty off Linux or off x86)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return frozenset()
    try:
        text = Path("/proc/cpuinfo").read_text(errors="ignore")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def supported(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """The tiers this CPU can execute, lowest first (always starts with ``generic``)."""
    flags = cpu_flags() if flags is None else flags
    return tuple(isa for isa in ISAS if REQUIRED_FLAGS[isa] <= flags)


def requested_cap() -> str | None:
    """``PAGEDSERVE_CPU_ISA`` lower-cased, or None when unset or empty.

    Raises:
        ValueError: a value that is not one of ``CAPS``.
    """
    value = os.environ.get(ISA_ENV, "").strip().lower()
    if not value:
        return None
    if value not in CAPS:
        raise ValueError(f"{ISA_ENV}={value!r} is not one of {', '.join(CAPS)}")
    return value


def select(cap: str | None = None, flags: frozenset[str] | None = None) -> str:
    """The best library tier the CPU runs that is at or below ``cap``'s (``amx`` or None: no
    cap)."""
    usable = supported(flags)
    if cap is not None:
        top = CAP_LIMITS[cap][0]
        usable = tuple(isa for isa in usable if ISAS.index(isa) <= ISAS.index(top))
    return usable[-1]


def vnni_allowed(tier: str, cap: str | None = None,
                 flags: frozenset[str] | None = None) -> bool:
    """Whether the int8 kernel of library ``tier`` may run ``vpdpbusd``: the cap allows it
    (None: no cap) and the CPU reports ``VNNI_CPU_FLAG[tier]``."""
    if cap is not None and not CAP_LIMITS[cap][1]:
        return False
    flag = VNNI_CPU_FLAG.get(tier)
    return flag is not None and flag in (cpu_flags() if flags is None else flags)


def level(tier: str, vnni: bool) -> str:
    """The ``LEVELS`` name of ``tier`` run with (``avx2_vnni``) or without VNNI."""
    return f"{tier}_vnni" if vnni else tier


def select_level(cap: str | None = None, flags: frozenset[str] | None = None) -> str:
    """What runs under ``cap`` on a CPU with ``flags``: ``select``'s tier, with ``_vnni`` where
    ``vnni_allowed`` (e.g. ``avx2`` on Sapphire Rapids, ``avx512_vnni`` uncapped there)."""
    flags = cpu_flags() if flags is None else flags
    tier = select(cap, flags)
    return level(tier, vnni_allowed(tier, cap, flags))


def cap_tier(cap: str | None) -> str | None:
    """The highest library tier ``cap`` allows (None: no cap)."""
    return None if cap is None else CAP_LIMITS[cap][0]


def cap_torch_env() -> dict[str, str]:
    """With ``PAGEDSERVE_CPU_ISA`` set, cap torch to the same tier by setting
    ``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA`` and ``MKL_ENABLE_INSTRUCTIONS`` (values the
    user set win). Only effective before torch is imported; returns what it set."""
    cap = requested_cap()
    if cap is None:
        return {}
    if "torch" in sys.modules:
        # Too late to take effect; cpu_ops.load() logs torch's actual capability.
        return {}
    set_now = {k: v for k, v in TORCH_ENV[cap].items() if k not in os.environ}
    os.environ.update(set_now)
    return set_now
