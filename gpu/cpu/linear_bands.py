"""Which product each GGUF linear layer runs at each batch size (``--cpu-linear-mode``).

A call's rows (the step's tokens) fall in a *band*; each band names a path:

- ``exact``: ``gguf_ops.gguf_linear``, float32 products of the exactly de-quantized weights
  (greedy output equals transformers' on the same file);
- ``int8``: ``gguf_ops.gguf_q8_linear``, activations quantized to 8 bits per 32-value block
  (256 against K-quants) and integer block products (llama.cpp's arithmetic; output differs,
  see docs/cpu-performance.md).

A layer holds ONE copy of its weights, the form its path reads: the file's rows (``exact``)
or the int8 kernel's panels (``gguf_q8_repack``, the same bytes). So a plan names one path for
every band; there is no de-quantized copy at any batch size (a bfloat16 model's large batches
used to go to one, oneDNN's, at the cost of the weights' bytes a second time in bfloat16).

Modes: ``exact``: the exact kernel at every size; ``int8``: int8 at every size; ``auto``: the
path of ``AUTO_BANDS`` for this ISA tier and dtype (measured, ``loadtest/bench_gguf_linear.py``,
figures in ``loadtest/RESULTS.md`` "int8 activations"), except that an explicit
``--dtype float32`` means exact (the greedy-parity setting, which the tests and fixtures pass).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

MODES = ("exact", "int8", "auto")
PATHS = ("exact", "int8")
ALL = sys.maxsize

# (tier, dtype) -> bands (max rows, path), from loadtest/RESULTS.md "int8 activations": AMD
# EPYC Zen 5 (AVX-512, VNNI, AVX512-BF16), 2 cores, shared and loaded, 2026-12-01; medians of 5
# alternating runs of bench_gguf_linear.py, 1 thread, SmolLM2's fused shapes at 1-512 rows,
# compared per step (30 decoder layers + the lm_head):
# - avx2 and avx512, float32: int8 2.2-3.3x the exact kernel per decoder layer at every row
#   count;
# - avx512, bfloat16 activations: int8 1.3-2.7x oneDNN's packed bfloat16 up to 16 rows, level
#   from 32 (0.77-1.0x from 128); oneDNN needs a de-quantized copy, so int8 at every size.
AUTO_BANDS: dict[tuple[str, str], tuple[tuple[int, str], ...]] = {
    ("avx2", "float32"): ((ALL, "int8"),),
    ("avx2", "bfloat16"): ((ALL, "int8"),),
    ("avx512", "float32"): ((ALL, "int8"),),
    ("avx512", "bfloat16"): ((ALL, "int8"),),
}


@dataclass(frozen=True, slots=True)
class LinearPlan:
    """The resolved mode and its bands: ``bands[i] = (max_rows, path)``, ascending, the last
    one ``ALL``. ``tier``: the kernels' ISA tier the table was read for."""

    mode: str
    bands: tuple[tuple[int, str], ...]
    tier: str | None = None

    def __post_init__(self) -> None:
        paths = {p for _, p in self.bands}
        if not self.bands or len(paths) != 1 or not paths <= set(PATHS):
            raise ValueError(f"a plan's bands name one path of {', '.join(PATHS)} (a layer "
                             f"holds one form of its weights), got {self.bands}")

    @property
    def path(self) -> str:
        """The one path every band runs: which form of the weights a layer keeps."""
        return self.bands[0][1]

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


def exact_plan(tier: str | None = None) -> LinearPlan:
    """The exact kernel at every size, on the file's rows."""
    return LinearPlan("exact", ((ALL, "exact"),), tier)


def plan_for(mode: str, dtype_flag: str, dtype: torch.dtype, tier: str | None) -> LinearPlan:
    """The plan for ``--cpu-linear-mode mode`` with ``--dtype dtype_flag`` resolved to ``dtype``
    on kernels of ISA tier ``tier``.

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in MODES:
        raise ValueError(f"unknown --cpu-linear-mode {mode!r}; choose {', '.join(MODES)}")
    if mode == "exact" or (mode == "auto" and dtype_flag == "float32"):
        return exact_plan(tier)
    if mode == "int8":
        return LinearPlan("int8", ((ALL, "int8"),), tier)
    bands = AUTO_BANDS.get((tier or "", str(dtype).removeprefix("torch.")))
    if bands is None:
        return LinearPlan("auto", exact_plan(tier).bands, tier)
    return LinearPlan("auto", bands, tier)
