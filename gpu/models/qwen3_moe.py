"""Qwen3-MoE: Qwen3's decoder (q/k norms, ``head_dim`` of its own) whose feed-forward block
is, in most layers, a sparse mixture of experts: a router (``gate``, ``[E, H]``) picks the top
``num_experts_per_tok`` of ``num_experts`` SiLU-GLU experts per token, renormalised when
``norm_topk_prob``; no shared expert. A layer is sparse when it is not in ``mlp_only_layers``
and ``(index + 1) % decoder_sparse_step == 0``; the others keep a dense MLP of
``intermediate_size`` (the experts' width is ``moe_intermediate_size``).

Tensor parallelism splits every expert's intermediate dimension over the ranks (gate_up
column-parallel, down row-parallel, vLLM's default for MoE without expert parallelism): each
rank routes every token the same way with the whole (replicated) router, multiplies its
slice of the experts, and the block's partial outputs are summed by one all-reduce.

Sources: Qwen Team, "Qwen3 Technical Report" (2025); vLLM's
``vllm/model_executor/models/qwen3_moe.py``; transformers' ``Qwen3MoeSparseMoeBlock`` (the
oracle).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedserve.gpu.fused_moe import FusedMoE, select_experts
from pagedserve.gpu.layer_ops import LayerOps
from pagedserve.gpu.models.llama import LlamaDecoderLayer, LlamaMLP
from pagedserve.gpu.models.qwen3 import Qwen3ForCausalLM
from pagedserve.gpu.parallel.comm import ParallelContext


def is_sparse_layer(config: PretrainedConfig, layer_index: int) -> bool:
    """Whether layer ``layer_index`` has experts (transformers' ``Qwen3MoeDecoderLayer``
    rule)."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (getattr(config, "num_experts", 0) > 0
            and layer_index not in (getattr(config, "mlp_only_layers", None) or ())
            and (layer_index + 1) % step == 0)


class Qwen3MoeSparseMoeBlock(nn.Module):
    """Router → top-k → experts (``gpu/fused_moe.py``). ``experts`` is a ``FusedMoE`` (float
    weights) or, read from a GGUF file, ``gguf_moe.GGUFFusedMoE`` (the file's blocks); both
    take ``(x, topk_weights, topk_ids)``.

    ``forward(x)``: ``[T, H]`` → ``[T, H]`` in ``x``'s dtype, all-reduced under tp.
    """

    def __init__(self, config: PretrainedConfig, ops: LayerOps,
                 parallel: ParallelContext | None = None):
        super().__init__()
        self.parallel = parallel
        self.top_k = config.num_experts_per_tok
        self.renormalize = bool(getattr(config, "norm_topk_prob", False))
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = FusedMoE(config.num_experts, config.hidden_size,
                                config.moe_intermediate_size, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, topk_weights, topk_ids)
        return out if self.parallel is None else self.parallel.all_reduce(out)


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    """Llama's decoder layer whose feed-forward block is the experts where
    ``is_sparse_layer``, else the dense MLP (``config``: this rank's share)."""

    @staticmethod
    def build_mlp(config: PretrainedConfig, ops: LayerOps, parallel: ParallelContext | None,
                  layer_idx: int) -> nn.Module:
        if is_sparse_layer(config, layer_idx):
            return Qwen3MoeSparseMoeBlock(config, ops, parallel)
        return LlamaMLP(config, ops, parallel)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Causal LM over the flattened paged batch, as ``LlamaForCausalLM`` (same arguments).
    The checkpoint's per-expert ``mlp.experts.{e}.{gate,up,down}_proj`` are stacked into the
    grouped weights by ``loader.load_weights`` (``stack_experts``)."""

    decoder_layer_cls = Qwen3MoeDecoderLayer
