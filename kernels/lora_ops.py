"""Batched LoRA deltas as kernels: Punica's BGMV shrink/expand (Chen et al., "Punica", 2023;
vLLM's ``vllm/lora/ops/triton_ops``), each token row with its own adapter slot.

Two implementations of one call, ``bgmv_add(kernel, y, x, lora_a, lora_b, token_slots)``:

- ``cpu``: our C++ kernel (``csrc/lora_bgmv.cpp``, one library per ISA tier like the others,
  ``kernels/cpu_build.py``), float32 or bfloat16; a layer binds it once (``CpuBGMV``);
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
    sum(out_p)]`` contiguous, as ``CpuBGMV`` reads them (made here when not given).
    """
    if kernel == "cpu":
        if lora_bt is None:
            lora_bt = torch.cat(lora_b, dim=1).transpose(1, 2).contiguous()
        return CpuBGMV(lora_a, lora_bt, [b.shape[1] for b in lora_b])(y, x, token_slots)
    if kernel == "triton":
        return _triton(y, x, lora_a, lora_b, token_slots)
    raise ValueError(f"unknown LoRA kernel {kernel!r} (cpu or triton)")


def cpu_supported(model_dtype: torch.dtype, lora_dtype: torch.dtype) -> bool:
    """The C++ kernels take activations and weights in one dtype, float32 or bfloat16."""
    return (model_dtype == lora_dtype and model_dtype in (torch.float32, torch.bfloat16)
            and cpu_ops.load() is not None)


class CpuBGMV:
    """The C++ BGMV bound to one layer's slot tensors: a call runs the shrink and the expand
    of every part in one kernel call (one OpenMP region), with nothing looked up, checked or
    allocated in Python beyond the two activation pointers.

    Args:
        lora_a: ``[L, P*R, in]`` contiguous, in the activations' dtype.
        lora_bt: ``[L, R, sum(out_p)]`` contiguous, same dtype (``bgmv_add``'s).
        parts: ``out_p`` per part, in output order.

    Raises:
        ValueError: the tensors are not contiguous, differ in dtype, or disagree on shapes;
            ``RuntimeError`` from ``cpu_ops`` when the kernels are not built.
    """

    def __init__(self, lora_a: torch.Tensor, lora_bt: torch.Tensor, parts: list[int]):
        if not (lora_a.is_contiguous() and lora_bt.is_contiguous()):
            raise ValueError("CpuBGMV: lora_a and lora_bt must be contiguous")
        if lora_a.dtype != lora_bt.dtype:
            raise ValueError(f"CpuBGMV: lora_a {lora_a.dtype} and lora_bt {lora_bt.dtype}")
        rank, out = lora_bt.shape[1], lora_bt.shape[2]
        if lora_a.shape[1] != len(parts) * rank or sum(parts) != out:
            raise ValueError(f"CpuBGMV: lora_a {tuple(lora_a.shape)}, lora_bt "
                             f"{tuple(lora_bt.shape)} and parts {parts} disagree")
        self.dtype = lora_a.dtype
        self._fn = cpu_ops._kernel("lora_bgmv", lora_a.dtype)
        self._tensors = (lora_a, lora_bt)  # kept alive: the kernel reads their pointers
        ends = [0]
        for n in parts:
            ends.append(ends[-1] + n)
        self._bounds = torch.tensor(ends, dtype=torch.int64)
        self._in, self._pr, self._out, self._rank = lora_a.shape[2], lora_a.shape[1], out, rank
        self._ptrs = (lora_a.data_ptr(), lora_bt.data_ptr(), self._bounds.data_ptr(),
                      len(parts))

    def __call__(self, y: torch.Tensor, x: torch.Tensor, token_slots: torch.Tensor
                 ) -> torch.Tensor:
        """``y`` ``[T, out]`` (unit stride along out) += the delta of ``x`` ``[T, in]``
        (contiguous), both in the weights' dtype; ``token_slots`` ``[T]`` int32 contiguous.
        Raises ``ValueError`` otherwise."""
        if not x.is_contiguous():
            x = x.contiguous()
        if (y.stride(1) != 1 or x.dtype != self.dtype or y.dtype != self.dtype
                or token_slots.dtype != torch.int32 or x.shape[1] != self._in
                or y.shape[1] != self._out):
            raise ValueError(f"CpuBGMV: y {y.dtype} {tuple(y.shape)} stride {y.stride()}, x "
                             f"{x.dtype} {tuple(x.shape)}, slots {token_slots.dtype}; wants "
                             f"{self.dtype}, in {self._in}, out {self._out}, int32 slots")
        a, bt, bounds, parts = self._ptrs
        self._fn(y.data_ptr(), x.data_ptr(), a, bt, token_slots.data_ptr(), bounds, parts,
                 x.shape[0], self._in, self._pr, self._out, self._rank, y.stride(0))
        return y


def _triton(y, x, lora_a, lora_b, token_slots):
    from pagedserve.kernels import lora_triton

    return lora_triton.bgmv_add(y, x, lora_a, lora_b, token_slots)
