"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) in plain torch over paged KV.

Module and parameter names match transformers' ``LlamaForCausalLM`` so its state dicts load
unchanged. The forward pass takes vLLM V1's flattened batch (all scheduled tokens of all
requests concatenated, ``[T]``) and computes logits only for the tokens that are sampled.

Sources: Touvron et al., "LLaMA" (2023); RoPE from Su et al., "RoFormer" (2021); layout after
gpt-fast's ``model.py`` and vLLM's ``vllm/model_executor/models/llama.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedserve.gpu.attention import AttentionBackend, AttentionMetadata
from pagedserve.kernels import cpu_ops


def rope_inv_freq(config: PretrainedConfig, head_size: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_size // 2]`` and the cos/sin scaling, per the config's RoPE.

    transformers computes scaled variants (llama3, linear, yarn, ...); the default is ours.
    """
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", None) and rope_type in ROPE_INIT_FUNCTIONS:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        return inv_freq.float(), float(scaling)
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    exponent = torch.arange(0, head_size, 2, dtype=torch.float) / head_size
    return 1.0 / (theta**exponent), 1.0


class RotaryEmbedding(nn.Module):
    """Non-interleaved (``rotate_half``) RoPE with a precomputed cos/sin table."""

    def __init__(self, config: PretrainedConfig, head_size: int, max_positions: int):
        super().__init__()
        inv_freq, scaling = rope_inv_freq(config, head_size)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        # rotate_half's minus sign folded into the first half of sin: bit-identical results,
        # one negation fewer per q and k per layer (``apply_rope``).
        sin = emb.sin() * scaling
        sin[:, : head_size // 2] *= -1
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos, sin: ``[T, 1, D]`` for broadcasting over heads."""
        return self.cos[positions, None].to(dtype), self.sin[positions, None].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: ``[T, H, D]``; ``sin`` carries rotate_half's sign (see ``RotaryEmbedding``)."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * sin


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 as transformers does.

    ``forward(x)`` → normed ``x``; ``forward(x, residual)`` → ``(norm(x + residual), x +
    residual)``: the residual add fused in, as vLLM's layers pass it. ``fused``: one pass of our
    CPU kernel (``kernels.cpu_ops.rms_norm``, which updates ``residual`` in place).
    """

    def __init__(self, dim: int, eps: float, fused: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps
        self.fused = fused

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.fused:
            out = cpu_ops.rms_norm(x, self.weight, self.variance_epsilon, residual)
            return out if residual is None else (out, residual)
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, backend: AttentionBackend, fused: bool):
        super().__init__()
        self.fused = fused
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_size = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_size**-0.5
        # Qwen2 has q/k/v biases without saying so in attention_bias.
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        h, d = config.hidden_size, self.head_size
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        # q, k and v in one matmul: HF's q_proj/k_proj/v_proj are concatenated at load time.
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.backend = backend

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, ...],
        kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
    ) -> torch.Tensor:
        """rope: fused, ``(positions, cos_table, sin_table)``; else ``(cos, sin)`` per token."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D]
        if self.fused:  # q's and k's heads rotated together, in place
            cpu_ops.rotary_embedding(qkv, *rope, self.num_heads + self.num_kv_heads,
                                     self.head_size)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_size)  # q: [T, H, D]
        k = k.view(t, self.num_kv_heads, self.head_size)  # k: [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_size)
        if not self.fused:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        self.backend.write_kv(k, v, kv_cache, meta)
        out = self.backend.forward(q, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, fused: bool):
        super().__init__()
        self.fused = fused
        h, i = config.hidden_size, config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        # gate and up in one matmul (HF's gate_proj/up_proj concatenated at load time).
        self.gate_up_proj = nn.Linear(h, 2 * i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        if self.fused:
            return self.down_proj(cpu_ops.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, backend: AttentionBackend, fused: bool):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = LlamaAttention(config, backend, fused)
        self.mlp = LlamaMLP(config, fused)
        self.input_layernorm = RMSNorm(h, eps, fused)
        self.post_attention_layernorm = RMSNorm(h, eps, fused)

    def forward(self, x, residual, rope, kv_cache, meta):
        """Returns ``(mlp_out, residual)``: the next layer's norm adds them (vLLM's layout)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, backend: AttentionBackend, max_positions: int,
                 fused: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, backend, fused) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)
        head_size = self.layers[0].self_attn.head_size
        self.rotary_emb = RotaryEmbedding(config, head_size, max_positions)


class LlamaForCausalLM(nn.Module):
    """Causal LM over the flattened paged batch.

    Args:
        config: a transformers Llama/Mistral/Qwen2 config.
        backend: attention backend (``gpu.attention.get_attention_backend``).
        max_positions: size of the RoPE table (``max_model_len``).
        fused: norms, SiLU-and-mul and RoPE from our CPU kernels (``kernels.cpu_ops``; float32
            or bfloat16 on the CPU) instead of torch's elementwise ops.
    """

    # Our fused parameters and the HF checkpoint names they are concatenated from (dim 0, in
    # order), as vLLM's ``stacked_params_mapping``.
    stacked_params = (("qkv_proj", ("q_proj", "k_proj", "v_proj")),
                      ("gate_up_proj", ("gate_proj", "up_proj")))

    def __init__(self, config: PretrainedConfig, backend: AttentionBackend, max_positions: int,
                 fused: bool = False):
        super().__init__()
        self.config = config
        self.fused = fused
        self.model = LlamaModel(config, backend, max_positions, fused)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """input_ids, positions: ``[T]`` int64 → float32 logits ``[len(logits_indices), vocab]``."""
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        rotary = self.model.rotary_emb
        rope = (positions, rotary.cos, rotary.sin) if self.fused else rotary(positions, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, rope, kv_cache, meta)
        # Only the rows that are sampled.
        x, _ = self.model.norm(x[logits_indices], residual[logits_indices])
        return self.lm_head(x).float()
