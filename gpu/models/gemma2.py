"""Gemma 2: Llama's attention and gated MLP with Gemma's parts around them.

- RMSNorm times ``(1 + weight)`` (zero-centred weights), float32 inside, rounded once;
- four norms per layer: before and after attention, before and after the MLP;
- GeGLU (``hidden_activation`` ``gelu_pytorch_tanh``: ``llama.act_and_mul``);
- embeddings times ``sqrt(hidden_size)``, rounded to the hidden dtype first (as transformers);
- attention scale ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``;
- attention-logit soft-capping and a sliding window on the ``sliding_attention`` layers
  (every other one), passed to the attention backend;
- final-logit soft-capping ``cap * tanh(logits / cap)`` on the float32 logits, so sampling,
  logprobs and prompt logprobs all see the capped values (as transformers' ``logits``).

Sources: Gemma Team, "Gemma 2: Improving Open Language Models at a Practical Size" (2024);
vLLM's ``vllm/model_executor/models/gemma2.py``; transformers' ``Gemma2ForCausalLM`` (the
oracle).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedserve.gpu.attention import AttentionBackend, AttentionMetadata
from pagedserve.gpu.layer_ops import LayerOps, RopeStep
from pagedserve.gpu.models.llama import (
    KVCache,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    RMSNorm,
)
from pagedserve.gpu.parallel.comm import ParallelContext


class GemmaRMSNorm(RMSNorm):
    """``RMSNorm`` whose ``weight`` is stored zero-centred (transformers' checkpoint form) and
    applied as ``(1 + weight)`` in float32 (``LayerOps.gemma_rms_norm``). Same calls as
    ``RMSNorm``: ``forward(x)``, ``forward(x, residual)`` → ``(norm(x + residual), x +
    residual)``."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.ops.gemma_rms_norm(x, self.weight, self.variance_epsilon)
        residual = x + residual
        return self.ops.gemma_rms_norm(residual, self.weight, self.variance_epsilon), residual


def layer_type(config: PretrainedConfig, layer_idx: int) -> str:
    """``sliding_attention`` or ``full_attention``: the config's ``layer_types`` (transformers
    derives them from ``sliding_window_pattern`` when a config has none)."""
    types = getattr(config, "layer_types", None)
    return types[layer_idx] if types else "full_attention"


def configure_gemma_attention(attn: LlamaAttention, config: PretrainedConfig, layer_idx: int,
                              soft_cap: float | None) -> None:
    """Gemma's attention settings on a Llama-built attention: the ``query_pre_attn_scalar``
    scale, the layer's type (its window: ``LlamaModel`` sets it from ``layer_types``,
    ``gpu/models/sliding_window.py``) and the attention-logit ``soft_cap`` (None or 0:
    none)."""
    attn.scale = float(config.query_pre_attn_scalar) ** -0.5
    attn.layer_type = layer_type(config, layer_idx)
    attn.logits_soft_cap = soft_cap or None


class Gemma2Attention(LlamaAttention):
    """``LlamaAttention`` with Gemma 2's scale, window and attention-logit soft-cap."""

    def __init__(self, config, backend, ops, parallel=None, layer_idx: int = 0):
        super().__init__(config, backend, ops, parallel, layer_idx)
        configure_gemma_attention(self, config, layer_idx,
                                  getattr(config, "attn_logit_softcapping", None))


class Gemma2DecoderLayer(nn.Module):
    """Pre- and post-norms around attention and around the MLP; the residual adds fused into
    the pre-norms, as ``LlamaDecoderLayer`` does (returns ``(mlp_out, residual)``)."""

    def __init__(self, config: PretrainedConfig, backend: AttentionBackend, ops: LayerOps,
                 parallel: ParallelContext | None = None, attention=Gemma2Attention,
                 layer_idx: int = 0):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = attention(config, backend, ops, parallel, layer_idx)
        self.mlp = LlamaMLP(config, ops, parallel)
        self.input_layernorm = GemmaRMSNorm(h, eps, ops)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, ops)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, ops)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, ops)

    def forward(self, x, residual, rope: RopeStep, kv_cache: KVCache, meta: AttentionMetadata):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, rope, kv_cache, meta))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Causal LM over the flattened paged batch, as ``LlamaForCausalLM`` (same arguments),
    with Gemma's scaled embeddings and capped logits."""

    attention_cls = Gemma2Attention
    decoder_layer_cls = Gemma2DecoderLayer
    norm_cls = GemmaRMSNorm

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(input_ids)
        # sqrt(hidden) rounded to the hidden dtype before the product, as transformers does.
        return x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)

    def compute_logits(self, x: torch.Tensor, residual: torch.Tensor,
                       rows: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(x, residual, rows)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if logits is None or not cap:
            return logits
        return torch.tanh(logits / cap) * cap
