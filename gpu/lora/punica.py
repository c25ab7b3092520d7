"""The batched LoRA delta in torch: Punica's SGMV and BGMV (Chen et al., "Punica: Multi-Tenant
LoRA Serving", 2023; vLLM's ``vllm/lora/ops/torch_ops``), the reference for the kernels.

Every layer holds ``max_loras`` slots of stacked weights: ``lora_a [L, P*R, in]`` (the
``P`` parts' ``A``s one under the other, each zero-padded to ``R`` = ``--max-lora-rank``) and
per part ``lora_b[p] [L, out_p, R]``. A step maps each token row to a slot or to none (-1):

- ``shrink``: ``h[t] = x[t] @ lora_a[slot[t]].T``, ``[T, P*R]``;
- ``expand``: ``y[t, off_p : off_p + out_p] += h[t, p*R : (p+1)*R] @ lora_b[p][slot[t]].T``.

``sgmv_add`` runs both per *segment*: the rows of one slot together, two small matmuls per
slot in the step (at most ``--max-loras``); ``bgmv_add`` gathers each row's weights (one
row at a time in spirit: what a decode kernel does), the oracle for the kernels' tests.
"""

from __future__ import annotations

import torch

Rows = slice | torch.Tensor  # a slot's rows: a range when contiguous, else their indices


def sgmv_add(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
             lora_b: list[torch.Tensor], groups: list[tuple[int, Rows]]) -> torch.Tensor:
    """``y`` ``[T, sum(out_p)]`` += the LoRA delta of ``x`` ``[T, in]``, in place.

    ``groups``: ``(slot, rows)`` for every slot that has rows this step; rows in no group
    get no delta. Computed in the weights' dtype, added in ``y``'s.
    """
    rank = lora_b[0].shape[-1]
    for slot, rows in groups:
        h = x[rows].to(lora_a.dtype) @ lora_a[slot].T  # [n, P*R]
        start = 0
        for p, b in enumerate(lora_b):
            out = b.shape[1]
            delta = (h[:, p * rank:(p + 1) * rank] @ b[slot].T).to(y.dtype)  # [n, out_p]
            if isinstance(rows, slice):
                y[rows, start:start + out] += delta
            else:
                y[:, start:start + out].index_add_(0, rows, delta)
            start += out
    return y


def bgmv_add(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
             lora_b: list[torch.Tensor], token_slots: torch.Tensor) -> torch.Tensor:
    """As ``sgmv_add`` from ``token_slots`` ``[T]`` (int, -1: no adapter): each row's ``A``
    and ``B`` gathered, batched matmuls over rows."""
    rank = lora_b[0].shape[-1]
    has = token_slots >= 0
    idx = token_slots.clamp(min=0).long()
    h = torch.bmm(lora_a[idx], x.to(lora_a.dtype)[:, :, None])[:, :, 0]  # [T, P*R]
    h = h * has[:, None]
    start = 0
    for p, b in enumerate(lora_b):
        out = b.shape[1]
        hp = h[:, p * rank:(p + 1) * rank, None]
        y[:, start:start + out] += torch.bmm(b[idx], hp)[:, :, 0].to(y.dtype)
        start += out
    return y
