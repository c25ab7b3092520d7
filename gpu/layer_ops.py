"""The model's elementwise ops (norms, SiLU-and-mul, RoPE), picked once per engine.

Two namespaces with one interface, as the attention backends are (``gpu/attention.py``):
``TorchLayerOps`` (torch's elementwise ops: CUDA, float16, and the reference) and
``CpuLayerOps`` (our C++ kernels from ``kernels/cpu_ops``, one pass each where torch runs 3-9
ops; float32 or bfloat16 on the CPU). ``get_layer_ops`` picks: the kernels go with the ``cpu``
attention backend, so the ``torch`` backend stays pure torch throughout. The model holds one
namespace and its forward passes have a single path (vLLM's ``CustomOp`` picks
``forward_native`` or ``forward_cpu`` once the same way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_ops


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: ``[T, H, D]``; cos, sin ``[T, 1, D]``, ``sin`` carrying rotate_half's sign (see
    ``gpu.models.llama.RotaryEmbedding``)."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * sin


@dataclass(slots=True)
class RopeStep:
    """RoPE for one step's tokens, shared by every layer of the forward pass.

    Attributes:
        positions: ``[T]`` int64 position of each token.
        cos, sin: the model's float32 tables ``[max_positions, D]``, ``sin`` carrying
            rotate_half's sign (``gpu.models.llama.RotaryEmbedding``).
    """

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    _rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def rows(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of the step's tokens, ``[T, 1, D]`` in ``dtype`` (to broadcast over heads):
        gathered by the first layer that asks, then reused (every layer asks the same)."""
        if self._rows is None or self._rows[0].dtype != dtype:
            self._rows = (self.cos[self.positions, None].to(dtype),
                          self.sin[self.positions, None].to(dtype))
        return self._rows


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_size: int):
    """Views ``q`` ``[T, H, D]``, ``k`` and ``v`` ``[T, Hkv, D]`` of the fused projection."""
    t, q_size, kv_size = qkv.shape[0], num_heads * head_size, num_kv_heads * head_size
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (q.view(t, num_heads, head_size), k.view(t, num_kv_heads, head_size),
            v.view(t, num_kv_heads, head_size))


class LayerOps(Protocol):
    name: str

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x`` ``[N, dim]`` normalised (float32 inside) times ``weight`` ``[dim]``."""
        ...

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(x + residual), x + residual)``: the residual add fused in."""
        ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate_up[:, :I]) * gate_up[:, I:]``: ``[N, 2I]`` → ``[N, I]``."""
        ...

    def gemma_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Gemma's RMSNorm: ``x`` ``[N, dim]`` normalised times ``(1 + weight)``, all in float32,
        rounded to ``x``'s dtype once at the end (transformers' ``Gemma2RMSNorm``)."""
        ...

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GeGLU: ``gelu_tanh(gate_up[:, :I]) * gate_up[:, I:]`` (``gelu_pytorch_tanh``, Gemma's
        ``hidden_activation``): ``[N, 2I]`` → ``[N, I]``."""
        ...

    def rotary_qkv(self, qkv: torch.Tensor, rope: RopeStep, num_heads: int, num_kv_heads: int,
                   head_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """RoPE on q and k of the fused projection ``qkv`` ``[T, (H + 2 Hkv) D]``; returns
        ``(q, k, v)`` as ``split_qkv`` shapes them."""
        ...


class TorchLayerOps:
    """torch's elementwise ops, computed as transformers computes them."""

    name = "torch"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x.to(dtype)

    @staticmethod
    def add_rms_norm(x, residual, weight, eps):
        residual = x + residual
        return TorchLayerOps.rms_norm(residual, weight, eps), residual

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
        return F.silu(gate) * up

    @staticmethod
    def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return (x * (1.0 + weight.float())).to(dtype)

    @staticmethod
    def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
        return F.gelu(gate, approximate="tanh") * up

    @staticmethod
    def rotary_qkv(qkv, rope, num_heads, num_kv_heads, head_size):
        q, k, v = split_qkv(qkv, num_heads, num_kv_heads, head_size)
        cos, sin = rope.rows(qkv.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class CpuLayerOps:
    """Our C++ kernels (``kernels/cpu_ops``), looked up at call time (profilers patch them)."""

    name = "cpu"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return cpu_ops.rms_norm(x, weight, eps)

    @staticmethod
    def add_rms_norm(x, residual, weight, eps):
        return cpu_ops.rms_norm(x, weight, eps, residual), residual  # residual += x in place

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return cpu_ops.silu_and_mul(gate_up)

    # No kernels of ours for Gemma's norm and GeGLU yet: torch's, as transformers computes them.
    gemma_rms_norm = staticmethod(TorchLayerOps.gemma_rms_norm)
    gelu_tanh_and_mul = staticmethod(TorchLayerOps.gelu_tanh_and_mul)

    @staticmethod
    def rotary_qkv(qkv, rope, num_heads, num_kv_heads, head_size):
        # q's and k's heads are the first of each row: rotated together, in place, the kernel
        # reading the tables at each token's position.
        cpu_ops.rotary_embedding(qkv, rope.positions, rope.cos, rope.sin,
                                 num_heads + num_kv_heads, head_size)
        return split_qkv(qkv, num_heads, num_kv_heads, head_size)


def get_layer_ops(attention_backend: str, dtype: torch.dtype) -> LayerOps:
    """Our CPU kernels with the ``cpu`` attention backend (they take float32 or bfloat16),
    torch's ops with any other."""
    if attention_backend == "cpu" and dtype in (torch.float32, torch.bfloat16):
        return CpuLayerOps()
    return TorchLayerOps()
