"""A linear layer with LoRA slots: the base layer's output plus each row's adapter delta.

``LoRALinear`` wraps whatever the model holds for a projection (``nn.Linear``, a GGUF
kept-quantized linear, a packed oneDNN one, a rank's tensor-parallel share), so the base
weights are never touched or copied. Every wrapped layer of a model reads the same
``LoRAStep`` holder, which the runner sets before each forward pass: the layers' ``forward(x)``
signature stays the base layer's, as vLLM's ``PunicaWrapper`` does it (one mapping per step
shared by every LoRA layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.gpu.lora import punica


@dataclass(slots=True)
class LoRAStep:
    """Which adapter slot each token row of this step uses.

    Attributes:
        token_slots: ``[T]`` int32 on the model's device; -1 = base model only.
        groups: ``(slot, rows)`` per slot with rows (``punica.sgmv_add``).
    """

    token_slots: torch.Tensor
    groups: list[tuple[int, punica.Rows]]


@dataclass(slots=True)
class LoRAStepHolder:
    """The one mutable thing the LoRA layers share: the current step's mapping (``None``:
    no row has an adapter, so the layers run the base path only)."""

    step: LoRAStep | None = None
    kernel: str = "torch"  # torch (sgmv_add), or a kernel of kernels/lora_ops (bgmv)


class LoRALinear(nn.Module):
    """``base(x) + delta``; ``parts``: the output sizes of the fused projections it holds
    (``q, k, v`` for ``qkv_proj``; one for ``o_proj``), on this rank.

    Buffers: ``lora_a`` ``[max_loras, len(parts) * max_rank, in]``, ``lora_b[p]``
    ``[max_loras, parts[p], max_rank]``, zero where a slot's adapter has no such part or a
    smaller rank (zeros add nothing).
    """

    def __init__(self, base: nn.Module, parts: list[int], max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, holder: LoRAStepHolder):
        super().__init__()
        self.base, self.holder = base, holder
        self.in_features, self.out_features = base.in_features, sum(parts)
        self.max_rank = max_rank
        self.lora_a = torch.zeros(max_loras, len(parts) * max_rank, self.in_features,
                                  dtype=dtype, device=device)
        # All parts' B in one tensor, ``lora_b`` its per-part slices (torch's and Triton's).
        self.lora_b_cat = torch.zeros(max_loras, sum(parts), max_rank, dtype=dtype,
                                      device=device)
        self.lora_b = list(self.lora_b_cat.split(parts, dim=1))
        self.lora_bt: torch.Tensor | None = None  # [L, R, sum(parts)]: the C++ kernel's
        self._cpu = None  # the C++ kernel bound to this layer's slots, picked once
        if holder.kernel == "cpu":
            from pagedserve.kernels import lora_ops

            self.lora_bt = torch.zeros(max_loras, max_rank, sum(parts), dtype=dtype,
                                       device=device)
            self._cpu = lora_ops.CpuBGMV(self.lora_a, self.lora_bt, parts)

    def set_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Write one adapter's ``(A [r, in], B [out_p, r])`` per part (``None``: not adapted)
        into ``slot``, zero-padding ranks to ``max_rank``."""
        self.lora_a[slot].zero_()
        for p, ab in enumerate(parts):
            self.lora_b[p][slot].zero_()
            if ab is None:
                continue
            a, b = ab
            r = a.shape[0]
            self.lora_a[slot, p * self.max_rank:p * self.max_rank + r].copy_(a)
            self.lora_b[p][slot, :, :r].copy_(b)
        if self.lora_bt is not None:
            self.lora_bt[slot].copy_(self.lora_b_cat[slot].T)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_delta(self.base(x), x)

    def add_delta(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``y`` ``[T, out]`` (the base layer's output for ``x`` ``[T, in]``) plus each row's
        adapter delta for this step, in place; ``y`` as it is when no row has an adapter."""
        step = self.holder.step
        if step is None:
            return y
        if self._cpu is not None:
            return self._cpu(y, x, step.token_slots)
        if self.holder.kernel == "torch":
            return punica.sgmv_add(y, x, self.lora_a, self.lora_b, step.groups)
        from pagedserve.kernels import lora_ops

        return lora_ops.bgmv_add(self.holder.kernel, y, x, self.lora_a, self.lora_b,
                                 step.token_slots, self.lora_bt)

    def extra_repr(self) -> str:
        return (f"slots={self.lora_a.shape[0]}, max_rank={self.max_rank}, "
                f"parts={[b.shape[1] for b in self.lora_b]}")
