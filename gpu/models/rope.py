"""RoPE tables the decoder families share: the config's variant (default, transformers'
scaled ones, a Llama 3.x GGUF's frequency factors, Phi-3's ``longrope`` with the set the
context needs), partial rotary (``rotary_dim``), per-layer-type parameters (Gemma 3).

Sources: Su et al., "RoFormer" (2021); transformers' ``modeling_rope_utils``; vLLM's
``vllm/model_executor/layers/rotary_embedding/`` (``phi3_long_rope_scaled_rope.py``).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedserve.gpu.layer_ops import RopeStep


def rope_parameters(config: PretrainedConfig, layer_type: str | None = None) -> dict:
    """The config's RoPE parameters (transformers 5's ``rope_parameters``, older configs'
    ``rope_scaling``), ``{}`` when it has none; ``layer_type``: the key of a config whose
    parameters are per layer type (Gemma 3's ``sliding_attention`` / ``full_attention``)."""
    params = (getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
              or {})
    return params[layer_type] if layer_type is not None else params


def rotary_dim(config: PretrainedConfig, head_size: int, layer_type: str | None = None) -> int:
    """How many leading elements of each head RoPE turns: ``head_size`` times
    ``partial_rotary_factor`` (Phi-4-mini's 0.75: 96 of 128), as transformers computes it
    (``int(head_dim * factor)``) and vLLM's ``rotary_dim``; the rest of the head passes."""
    factor = rope_parameters(config, layer_type).get(
        "partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    return int(head_size * (factor or 1.0))


def rope_inv_freq(config: PretrainedConfig, head_size: int, max_positions: int | None = None,
                  layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[rotary_dim // 2]`` and the cos/sin scaling, per the config's RoPE.

    transformers computes scaled variants (llama3, linear, yarn, ...); the default is ours,
    divided by the per-frequency ``rope_freq_factors`` a GGUF file of Llama 3.x carries
    (``gguf_file.rope_freq_factors``; llama.cpp's ``freq_factors``). ``longrope`` (``su``)
    takes its long factors when ``max_positions`` (the engine's ``max_model_len``) is longer
    than ``original_max_position_embeddings``, else its short ones: ``longrope_factors``.
    ``layer_type``: as ``rope_parameters``.
    """
    params = rope_parameters(config, layer_type)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "su":
        rope_type = "longrope"  # Phi-3's first name for it
    if rope_type not in ("default", None) and rope_type in ROPE_INIT_FUNCTIONS:
        kwargs = {"seq_len": max_positions} if rope_type == "longrope" else {}
        # On the CPU even inside a meta-device build (``build``): llama3's reads values.
        ambient = torch.empty(0).device
        kw = {} if layer_type is None else {"layer_type": layer_type}
        with torch.device("cpu"):
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kw, **kwargs)
        return inv_freq.float().to(ambient), float(scaling)
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    dim = rotary_dim(config, head_size, layer_type)
    exponent = torch.arange(0, dim, 2, dtype=torch.float) / dim
    inv_freq = 1.0 / (theta**exponent)
    factors = getattr(config, "rope_freq_factors", None)  # a Llama 3.x GGUF's (loader)
    if factors is not None:
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float)
    return inv_freq, 1.0


def longrope_factors(config: PretrainedConfig, max_positions: int) -> str | None:
    """Which of a ``longrope`` config's factor sets the engine's RoPE tables use: ``"long"``
    when ``max_positions`` exceeds ``original_max_position_embeddings``, else ``"short"``;
    ``None`` for any other RoPE.

    One set for every position, chosen once from the context length, as vLLM
    (``phi3_long_rope_scaled_rope.py``: long factors whenever ``max_model_len`` is longer
    than the original context) and llama.cpp (``rope_factors_long`` when the context is
    longer) choose it: keys are rotated when written to the paged cache, and a switch of the
    whole sequence to the long factors past the original length would leave every cached key
    rotated by the other set. transformers' ``generate`` switches instead, by the largest
    position of each forward pass (``longrope_frequency_update``): so our greedy output equals
    transformers' when the context is at most the original (short factors, as transformers
    uses for any sequence that short), and, with a longer context, for a prompt that already
    starts past the original length (transformers' prefill then takes the long factors, and
    its decode steps keep them). A prompt shorter than the original under a longer context is
    rotated with the long factors here and the short ones by transformers (which then mixes
    the two sets in its cache once generation crosses the original length); vLLM accepts the
    same difference: the long factors are the model's trained rotation for its long context,
    and a cache rotated by one set is what attention stays consistent over.
    """
    params = rope_parameters(config)
    if params.get("rope_type", params.get("type")) not in ("longrope", "su"):
        return None
    original = (params.get("original_max_position_embeddings")
                or getattr(config, "original_max_position_embeddings", None))
    return "long" if original is not None and max_positions > original else "short"


class RotaryEmbedding(nn.Module):
    """Non-interleaved (``rotate_half``) RoPE tables: ``cos``, ``sin`` ``[max_positions,
    rotary_dim]`` float32 (``rotary_dim``: the head size, less under partial rotary), read by
    every layer through the step's ``RopeStep`` (``gpu/layer_ops.py``)."""

    def __init__(self, config: PretrainedConfig, head_size: int, max_positions: int,
                 layer_type: str | None = None):
        super().__init__()
        self.config, self.head_size, self.max_positions = config, head_size, max_positions
        self.layer_type = layer_type  # of per-layer-type rope_parameters (rope_inv_freq)
        cos, sin = self._tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, scaling = rope_inv_freq(self.config, self.head_size, self.max_positions,
                                          self.layer_type)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, rotary_dim]
        # rotate_half's minus sign folded into the first half of sin: bit-identical results,
        # one negation fewer per q and k per layer (``apply_rope``).
        sin = emb.sin() * scaling
        sin[:, : inv_freq.shape[0]] *= -1
        return emb.cos() * scaling, sin

    def init_tables(self, device: torch.device) -> None:
        """Compute the tables for real, in float32, on ``device`` (after a model built on the
        meta device was materialised and cast: ``LlamaForCausalLM.build``)."""
        with torch.device("cpu"):
            cos, sin = self._tables()
        self.cos, self.sin = cos.to(device), sin.to(device)

    def step(self, positions: torch.Tensor) -> RopeStep:
        """What every layer of a forward pass over tokens at ``positions`` ``[T]`` reads."""
        return RopeStep(positions, self.cos, self.sin)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos, sin: ``[T, 1, D]`` for broadcasting over heads."""
        return self.step(positions).rows(dtype)
