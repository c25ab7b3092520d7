"""Qwen3 (dense): Llama's decoder with an RMSNorm over each head of q and of k before RoPE
(``q_norm``, ``k_norm``, one ``[head_dim]`` weight each, shared by the heads), and a
``head_dim`` set in the config rather than ``hidden_size / heads`` (128 at every size).

Sources: Qwen Team, "Qwen3 Technical Report" (2025); vLLM's
``vllm/model_executor/models/qwen3.py``; transformers' ``Qwen3Attention`` (the oracle).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.gpu.layer_ops import RopeStep
from pagedserve.gpu.models.llama import LlamaAttention, LlamaForCausalLM, RMSNorm


def norm_qk_heads(qkv: torch.Tensor, q_norm: nn.Module, k_norm: nn.Module, num_heads: int,
                  num_kv_heads: int, head_size: int) -> None:
    """Norm each head of q and of k of the fused projection ``qkv`` ``[T, (H + 2 Hkv) D]`` in
    place (``q_norm``/``k_norm`` over ``[.., D]`` rows), so one RoPE pass over q and k follows."""
    t, d = qkv.shape[0], head_size
    q_end, k_end = num_heads * d, (num_heads + num_kv_heads) * d
    qkv[:, :q_end] = q_norm(qkv[:, :q_end].reshape(-1, d)).view(t, q_end)
    qkv[:, q_end:k_end] = k_norm(qkv[:, q_end:k_end].reshape(-1, d)).view(t, k_end - q_end)


class Qwen3Attention(LlamaAttention):
    """``LlamaAttention`` whose q and k heads are RMS-normed (float32 inside) before RoPE.
    Under tensor parallelism each rank norms its own heads with the whole (replicated)
    weights. ``head_norm_cls``: the norm (Gemma 3's is ``(1 + weight)``)."""

    head_norm_cls = RMSNorm

    def __init__(self, config, backend, ops, parallel=None, layer_idx: int = 0):
        super().__init__(config, backend, ops, parallel, layer_idx)
        self.q_norm = self.head_norm_cls(self.head_size, config.rms_norm_eps, ops)
        self.k_norm = self.head_norm_cls(self.head_size, config.rms_norm_eps, ops)

    def project_qkv(self, x: torch.Tensor, rope: RopeStep):
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D]
        norm_qk_heads(qkv, self.q_norm, self.k_norm, self.num_heads, self.num_kv_heads,
                      self.head_size)
        return self.ops.rotary_qkv(qkv, rope, self.num_heads, self.num_kv_heads,
                                   self.head_size)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Causal LM over the flattened paged batch, as ``LlamaForCausalLM`` (same arguments)."""

    attention_cls = Qwen3Attention
