"""Batched LoRA deltas as kernels: Punica's BGMV shrink/expand (Chen et al., "Punica", 2023;
vLLM's ``vllm/lora/ops/triton_ops``), each token row with its own adapter slot.

Two implementations of one call, ``bgmv_add(kernel, y, x, lora_a, lora_b, token_slots)``:

- ``cpu``: our C++ kernels (``csrc/lora_bgmv.cpp``, one library per ISA tier like the others,
  ``kernels/cpu_build.py``), float32 or bfloat16;
- ``triton``: two Triton kernels (CUDA; tests run them under ``TRITON_INTERPRET=1``).

Shapes as ``gpu/lora/punica.py`` (the torch reference, ``bgmv_add`` there): ``x [T, in]``,
``lora_a [L, P*R, in]``, ``lora_b[p] [L, out_p, R]``, ``token_slots [T]`` int32 (-1: none);
``y [T, sum(out_p)]`` is added to in place. The shrink's ``h [T, P*R]`` is float32.
"""

from __future__ import annotations

import torch

from pagedserve.kernels import cpu_ops


def bgmv_add(kernel: str, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
             lora_b: list[torch.Tensor], token_slots: torch.Tensor,
             lora_bt: torch.Tensor | None = None) -> torch.Tensor:
    """``y`` += every row's LoRA delta. Raises ``ValueError`` for an unknown ``kernel``.

    ``lora_bt``: the parts' ``B``s concatenated and transposed per slot, ``[L, R,
    sum(out_p)]`` contiguous: the C++ kernel then runs the layer in one call, vectorized
    along the outputs.
    """
    if kernel == "cpu":
        if lora_bt is not None and len(lora_b) <= 3:
            return _cpu_fused(y, x, lora_a, lora_b, lora_bt, token_slots)
        return _cpu(y, x, lora_a, lora_b, token_slots)
    if kernel == "triton":
        return _triton(y, x, lora_a, lora_b, token_slots)
    raise ValueError(f"unknown LoRA kernel {kernel!r} (cpu or triton)")


def cpu_supported(model_dtype: torch.dtype, lora_dtype: torch.dtype) -> bool:
    """The C++ kernels take activations and weights in one dtype, float32 or bfloat16."""
    return (model_dtype == lora_dtype and model_dtype in (torch.float32, torch.bfloat16)
            and cpu_ops.load() is not None)


def _cpu(y, x, lora_a, lora_b, token_slots):
    rows, pr, fan_in = x.shape[0], lora_a.shape[1], lora_a.shape[2]
    rank = lora_b[0].shape[-1]
    x = x.contiguous()
    slots = token_slots.to(torch.int32).contiguous()
    if y.stride(1) != 1:
        raise ValueError("bgmv_add: y needs unit stride in its last dim")
    h = torch.empty((rows, pr), dtype=torch.float32)
    cpu_ops._kernel("lora_shrink", x.dtype)(h.data_ptr(), x.data_ptr(), lora_a.data_ptr(),
                                            slots.data_ptr(), rows, pr, fan_in)
    expand = cpu_ops._kernel("lora_expand", y.dtype)
    start = 0
    for p, b in enumerate(lora_b):
        b = b.contiguous()  # a slice of lora_b_cat is not
        expand(y.data_ptr(), h.data_ptr(), b.data_ptr(), slots.data_ptr(), rows, b.shape[1],
               rank, pr, p * rank, y.stride(0), start)
        start += b.shape[1]
    return y


def _cpu_fused(y, x, lora_a, lora_b, lora_bt, token_slots):
    if x.stride(1) != 1 or x.stride(0) != x.shape[1]:
        x = x.contiguous()
    if y.stride(1) != 1 or token_slots.dtype != torch.int32:
        raise ValueError("bgmv_add: y needs unit stride, token_slots int32")
    ends = [b.shape[1] for b in lora_b]
    b1 = ends[0] if len(ends) > 1 else y.shape[1]
    b2 = ends[0] + ends[1] if len(ends) > 2 else y.shape[1]
    cpu_ops._kernel("lora_bgmv", x.dtype)(
        y.data_ptr(), x.data_ptr(), lora_a.data_ptr(), lora_bt.data_ptr(),
        token_slots.data_ptr(), x.shape[0], lora_a.shape[2], lora_a.shape[1],
        lora_bt.shape[2], lora_bt.shape[1], y.stride(0), b1, b2)
    return y


def _triton(y, x, lora_a, lora_b, token_slots):
    from pagedserve.kernels import lora_triton

    return lora_triton.bgmv_add(y, x, lora_a, lora_b, token_slots)
