"""The runner's start-up choices that depend on the machine: the compute dtype
(``--dtype auto``), whether a GGUF file's quantized blocks are kept (``--quantization``) and
which product their layers run per batch size (``--cpu-linear-mode``, ``linear_bands.py``).

Apart from ``model_runner`` so the rules read in one place; ``--dtype auto`` picks float32 on a
CPU without bfloat16 units because torch emulates bfloat16 there (issue 20's measurements,
``loadtest/RESULTS.md``).
"""

from __future__ import annotations

import torch

from pagedserve.gpu import gguf_linear, loader
from pagedserve.gpu.config import ModelConfig
from pagedserve.gpu.cpu import linear_bands
from pagedserve.kernels import cpu_isa, cpu_ops

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AMX or AVX512-BF16), so bfloat16 beats
    float32 there; elsewhere torch emulates it and float32 is faster. ``PAGEDSERVE_CPU_ISA``
    below ``avx512`` (``avx2_vnni`` too) answers as a CPU without those units would (the tier
    being measured)."""
    try:
        if cpu_isa.cap_tier(cpu_isa.requested_cap()) in ("generic", "avx2"):
            return False
    except ValueError:
        pass  # refused with its message when the kernels load
    return bool(cpu_isa.cpu_flags() & {"amx_bf16", "avx512_bf16"})


def pick_dtype(name: str, device: torch.device, gguf_in_place: bool = False) -> torch.dtype:
    """``auto``: bfloat16 on CUDA, on CPUs with bfloat16 matmul units (AMX, AVX512-BF16), and
    for a GGUF model whose blocks are multiplied in place (``gguf_in_place``: our kernels take
    either dtype at the same cost, and attention reads half the KV bytes, in half the memory);
    else float32. Parity with transformers' float32 ``generate`` holds in float32 only; pass it
    explicitly."""
    if name == "auto":
        if device.type == "cuda" or cpu_has_bf16_matmul() or gguf_in_place:
            return torch.bfloat16
        return torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def keeps_gguf_in_place(name: str | None, resolved: loader.ResolvedModel,
                        device: torch.device) -> bool:
    """Whether ``--quantization name`` (as the runner resolves it for its layout) keeps a GGUF
    file's blocks on this device, whatever the dtype (float32 and bfloat16 both can): what
    ``--dtype auto`` asks before the dtype is known."""
    return (name in (None, "gguf") and resolved.gguf_file is not None
            and gguf_linear.supported(device))


def pick_quantization(name: str | None, resolved: loader.ResolvedModel,
                      device: torch.device, dtype: torch.dtype = torch.float32) -> str | None:
    """``--quantization``: ``gguf`` keeps a GGUF file's quantized blocks (CPU, float32 or
    bfloat16 activations), ``none`` de-quantizes; unset = ``gguf`` wherever it can run.
    Raises ``ValueError``."""
    if name not in (None, "gguf", "none"):
        raise ValueError(f"unknown quantization {name!r}; choose gguf or none")
    if name == "none":
        return None
    can = (resolved.gguf_file is not None and gguf_linear.supported(device)
           and dtype in (torch.float32, torch.bfloat16))
    if name == "gguf" and not can:
        raise ValueError(
            "--quantization gguf needs a .gguf model on the CPU with the C++ kernels built, "
            f"and --dtype float32 or bfloat16 (here: {device.type}, "
            f"{str(dtype).removeprefix('torch.')})")
    return "gguf" if can else None


def pick_linear_plan(mc: ModelConfig, dtype: torch.dtype) -> linear_bands.LinearPlan:
    """``--cpu-linear-mode`` resolved for the kernels' ISA tier and the model's ``dtype``
    (``linear_bands.plan_for``: ``auto`` with an explicit ``--dtype float32`` is exact).
    Raises ``ValueError`` for an unknown mode."""
    return linear_bands.plan_for(mc.cpu_linear_mode, mc.dtype, dtype, cpu_ops.isa())
