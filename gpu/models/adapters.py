"""A decoder as a pooling model (vLLM's ``--convert embed``: ``as_embedding_model`` in
``vllm/model_executor/models/adapters.py``).

The causal LM is loaded as it is (the same class, weights, paged KV cache and prefix cache;
a GGUF kept quantized too); pooling reads its final hidden states, after the last norm,
instead of the ``lm_head``'s logits. Last-token pooling is the default for a decoder: with
causal attention only the last token has seen the whole prompt.
"""

from __future__ import annotations

import torch

from pagedserve.gpu.models.llama import KVCache, LlamaForCausalLM
from pagedserve.gpu.pooling.pooling_params import PoolingType
from pagedserve.gpu.step_inputs import StepInputs


class CausalLMForEmbedding:
    """``hidden_states`` of a ``LlamaForCausalLM`` (or a family built on it). Not a module:
    the wrapped model keeps its parameter names, so loading and memory accounting see it
    as before."""

    needs_kv_cache = True
    default_pooling_type = PoolingType.LAST

    def __init__(self, model: LlamaForCausalLM):
        if model.parallel is not None and model.parallel.layout.pp_size > 1:
            raise ValueError("pooling runs on one pipeline stage: drop -pp")
        self.model = model

    def hidden_states(self, inputs: StepInputs, kv_caches: list[KVCache],
                      token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``[T, hidden]`` final-norm hidden states of every scheduled token (their K/V
        written into ``kv_caches`` as a generation step would)."""
        m = self.model
        x, residual = m.run_layers(m.embed(inputs.input_ids), None, inputs, kv_caches)
        x, _ = m.model.norm(x, residual)
        return x
