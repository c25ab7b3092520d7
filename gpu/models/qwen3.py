"""Qwen3 (dense): Llama's decoder with an RMSNorm over each head of q and of k before RoPE
(``q_norm``, ``k_norm``, one ``[head_dim]`` weight each, shared by the heads), and a
``head_dim`` set in the config rather than ``hidden_size / heads`` (128 at every size).

Sources: Qwen Team, "Qwen3 Technical Report" (2025); vLLM's
``vllm/model_executor/models/qwen3.py``; transformers' ``Qwen3Attention`` (the oracle).
"""

from __future__ import annotations

import torch

from pagedserve.gpu.layer_ops import RopeStep
from pagedserve.gpu.models.llama import LlamaAttention, LlamaForCausalLM, RMSNorm


class Qwen3Attention(LlamaAttention):
    """``LlamaAttention`` whose q and k heads are RMS-normed (float32 inside) before RoPE.
    Under tensor parallelism each rank norms its own heads with the whole (replicated)
    weights."""

    def __init__(self, config, backend, ops, parallel=None):
        super().__init__(config, backend, ops, parallel)
        self.q_norm = RMSNorm(self.head_size, config.rms_norm_eps, ops)
        self.k_norm = RMSNorm(self.head_size, config.rms_norm_eps, ops)

    def project_qkv(self, x: torch.Tensor, rope: RopeStep):
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D]
        t, d = qkv.shape[0], self.head_size
        q_end, k_end = self.num_heads * d, (self.num_heads + self.num_kv_heads) * d
        # Normed back into the projection's rows, so the one RoPE pass over q and k follows.
        qkv[:, :q_end] = self.q_norm(qkv[:, :q_end].reshape(-1, d)).view(t, q_end)
        qkv[:, q_end:k_end] = self.k_norm(qkv[:, q_end:k_end].reshape(-1, d)).view(
            t, k_end - q_end)
        return self.ops.rotary_qkv(qkv, rope, self.num_heads, self.num_kv_heads, d)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Causal LM over the flattened paged batch, as ``LlamaForCausalLM`` (same arguments)."""

    attention_cls = Qwen3Attention
