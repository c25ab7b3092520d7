"""Gemma 3 (text, ``Gemma3ForCausalLM``): Gemma 2's layers with

- q/k norms per head (Qwen3's ``norm_qk_heads``, with Gemma's ``(1 + weight)`` norm);
- five local (``sliding_attention``) layers to one global, from the config's ``layer_types``
  (or ``sliding_window_pattern``);
- two RoPE tables: ``rope_local_base_freq`` for the local layers, ``rope_theta`` and the
  ``rope_scaling`` (linear, factor 8 from 4B up) for the global ones;
- no attention-logit soft-capping (transformers' ``Gemma3Attention`` passes none).

The vision model (``Gemma3ForConditionalGeneration``) is refused by the registry.

Sources: Gemma Team, "Gemma 3 Technical Report" (2025); vLLM's
``vllm/model_executor/models/gemma3.py``; transformers' ``Gemma3ForCausalLM`` (the oracle).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedserve.gpu.layer_ops import RopeStep
from pagedserve.gpu.models.gemma2 import Gemma2ForCausalLM, GemmaRMSNorm, configure_gemma_attention
from pagedserve.gpu.models.llama import RotaryEmbedding
from pagedserve.gpu.models.qwen3 import Qwen3Attention


class LayerTypeRotaryEmbedding(nn.Module):
    """One ``RotaryEmbedding`` per layer type of per-type ``rope_parameters``; ``step`` gives
    every layer of a forward pass ``{layer_type: RopeStep}`` (each layer takes its own)."""

    def __init__(self, config: PretrainedConfig, head_size: int, max_positions: int):
        super().__init__()
        self.tables = nn.ModuleDict({
            t: RotaryEmbedding(config, head_size, max_positions, t)
            for t in sorted(set(config.layer_types))})

    def init_tables(self, device: torch.device) -> None:
        for table in self.tables.values():
            table.init_tables(device)

    def step(self, positions: torch.Tensor) -> dict[str, RopeStep]:
        return {t: table.step(positions) for t, table in self.tables.items()}


class Gemma3Attention(Qwen3Attention):
    """Gemma's attention settings (no soft-cap) with q/k heads normed by ``GemmaRMSNorm``,
    rotated by its layer type's table."""

    head_norm_cls = GemmaRMSNorm

    def __init__(self, config, backend, ops, parallel=None, layer_idx: int = 0):
        super().__init__(config, backend, ops, parallel, layer_idx)
        configure_gemma_attention(self, config, layer_idx, None)

    def project_qkv(self, x: torch.Tensor, rope: dict[str, RopeStep]):
        return super().project_qkv(x, rope[self.layer_type])


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Causal LM over the flattened paged batch, as ``LlamaForCausalLM`` (same arguments)."""

    attention_cls = Gemma3Attention
    rotary_cls = LayerTypeRotaryEmbedding
