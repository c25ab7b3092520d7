"""Which product each GGUF linear layer runs at each batch size (``--cpu-linear-mode``).

A call's rows (the step's tokens) fall in a *band*; each band names a path:

- ``exact``: ``gguf_ops.gguf_linear``, float32 products of the exactly de-quantized weights
  (greedy output equals transformers' on the same file);
- ``int8``: ``gguf_ops.gguf_q8_linear``, activations quantized to 8 bits per 32-value block
  and integer block products (llama.cpp's arithmetic; output differs, see the README);
- ``dense``: the de-quantized weights through oneDNN/MKL (``F.linear``, or the pre-packed
  bfloat16 layer where the CPU has bfloat16 units).

Modes: ``exact`` is what the server did before the flag (a float32 model: the exact kernel at
every size; a bfloat16 one: exact up to 4 rows, dense above); ``int8``: int8 at every size;
``auto``: the fastest path per band for this ISA tier and dtype, from ``AUTO_BANDS`` (measured,
``loadtest/bench_gguf_linear.py``, figures in ``loadtest/RESULTS.md`` "int8 activations"),
except that an explicit ``--dtype float32`` means exact (the greedy-parity setting, which the
tests and fixtures pass).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

MODES = ("exact", "int8", "auto")
PATHS = ("exact", "int8", "dense")
ALL = sys.maxsize
# A bfloat16 model's exact mode: batches above this go to the dense copy (oneDNN bfloat16).
BF16_MAX_KERNEL_ROWS = 4

# (tier, dtype) -> bands (max rows, path), from loadtest/RESULTS.md "int8 activations": AMD
# EPYC Zen 5 (AVX-512, VNNI, AVX512-BF16), 2 cores, shared and loaded, 2026-12-01; medians of 5
# alternating runs of bench_gguf_linear.py, 1 thread, SmolLM2's fused shapes at 1-512 rows,
# compared per step (30 decoder layers + the lm_head).
# - avx2 tier, float32 (no bfloat16 units there): int8 2.3-3.3x the exact kernel per decoder
#   layer at every row count, and faster than float32 oneDNN at every one;
# - avx512, float32: int8 2.2-3.1x exact at every row count (one 4.6x outlier at 16);
# - avx512, bfloat16 activations: int8 1.3-2.7x oneDNN's packed bfloat16 up to 16 rows, level
#   at 32-64 rows, level or behind from 128 (0.77-1.0x): dense from 33 rows, where ties go to
#   the path the exact mode also takes.
AUTO_BANDS: dict[tuple[str, str], tuple[tuple[int, str], ...]] = {
    ("avx2", "float32"): ((ALL, "int8"),),
    ("avx512", "float32"): ((ALL, "int8"),),
    ("avx512", "bfloat16"): ((32, "int8"), (ALL, "dense")),
}


@dataclass(frozen=True, slots=True)
class LinearPlan:
    """The resolved mode and its bands: ``bands[i] = (max_rows, path)``, ascending, the last
    one ``ALL``. ``tier``: the kernels' ISA tier the table was read for."""

    mode: str
    bands: tuple[tuple[int, str], ...]
    tier: str | None = None

    def path_for(self, rows: int) -> str:
        for max_rows, path in self.bands:
            if rows <= max_rows:
                return path
        return self.bands[-1][1]

    def uses(self, path: str) -> bool:
        return any(p == path for _, p in self.bands)

    def describe(self) -> list[dict]:
        """Per band ``{"rows": "1-4", "path": "int8"}`` (``/admin/stats``, the start-up log)."""
        out, low = [], 1
        for max_rows, path in self.bands:
            out.append({"rows": f"{low}+" if max_rows == ALL else f"{low}-{max_rows}",
                        "path": path})
            low = max_rows + 1
        return out


def exact_plan(dtype: torch.dtype, tier: str | None = None) -> LinearPlan:
    """Today's paths: float32 reads the blocks at every size; bfloat16 up to 4 rows."""
    if dtype == torch.float32:
        return LinearPlan("exact", ((ALL, "exact"),), tier)
    return LinearPlan("exact", ((BF16_MAX_KERNEL_ROWS, "exact"), (ALL, "dense")), tier)


def plan_for(mode: str, dtype_flag: str, dtype: torch.dtype, tier: str | None) -> LinearPlan:
    """The plan for ``--cpu-linear-mode mode`` with ``--dtype dtype_flag`` resolved to ``dtype``
    on kernels of ISA tier ``tier``.

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in MODES:
        raise ValueError(f"unknown --cpu-linear-mode {mode!r}; choose {', '.join(MODES)}")
    if mode == "exact" or (mode == "auto" and dtype_flag == "float32"):
        return exact_plan(dtype, tier)
    if mode == "int8":
        return LinearPlan("int8", ((ALL, "int8"),), tier)
    bands = AUTO_BANDS.get((tier or "", str(dtype).removeprefix("torch.")))
    if bands is None:
        return LinearPlan("auto", exact_plan(dtype, tier).bands, tier)
    return LinearPlan("auto", bands, tier)
