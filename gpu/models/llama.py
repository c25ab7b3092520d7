"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) in plain torch over paged KV; the
base the other families extend (``qwen3.py``; ``registry.py`` picks the class).

Module and parameter names match transformers' ``LlamaForCausalLM`` so its state dicts load
unchanged. The forward pass takes vLLM V1's flattened batch (all scheduled tokens of all
requests concatenated, ``[T]``) and computes logits only for the tokens that are sampled.

Sources: Touvron et al., "LLaMA" (2023); RoPE from Su et al., "RoFormer" (2021); layout after
gpt-fast's ``model.py`` and vLLM's ``vllm/model_executor/models/llama.py``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedserve.gpu.attention import AttentionBackend, AttentionMetadata
from pagedserve.gpu.layer_ops import LayerOps, RopeStep, TorchLayerOps
from pagedserve.gpu.layer_ops import apply_rope as apply_rope  # the reference, for tests
from pagedserve.gpu.models.sliding_window import layer_sliding_windows
from pagedserve.gpu.parallel.comm import ParallelContext
from pagedserve.gpu.parallel.layers import PPMissingLayer, VocabParallelEmbedding
from pagedserve.gpu.parallel.layout import local_config
from pagedserve.gpu.step_inputs import StepInputs

KVCache = tuple[torch.Tensor, torch.Tensor]  # one layer's (key_cache, value_cache)


def attention_head_size(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_inv_freq(config: PretrainedConfig, head_size: int,
                  layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_size // 2]`` and the cos/sin scaling, per the config's RoPE.

    transformers computes scaled variants (llama3, linear, yarn, ...); the default is ours,
    divided by the per-frequency ``rope_freq_factors`` a GGUF file of Llama 3.x carries
    (``gguf_file.rope_freq_factors``; llama.cpp's ``freq_factors``). ``layer_type``: the key of
    a config whose ``rope_parameters`` are per layer type (Gemma 3's ``sliding_attention`` /
    ``full_attention``).
    """
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", None) and rope_type in ROPE_INIT_FUNCTIONS:
        # On the CPU even inside a meta-device build (``build``): llama3's reads values.
        ambient = torch.empty(0).device
        kw = {} if layer_type is None else {"layer_type": layer_type}
        with torch.device("cpu"):
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kw)
        return inv_freq.float().to(ambient), float(scaling)
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    exponent = torch.arange(0, head_size, 2, dtype=torch.float) / head_size
    inv_freq = 1.0 / (theta**exponent)
    factors = getattr(config, "rope_freq_factors", None)  # a Llama 3.x GGUF's (loader)
    if factors is not None:
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float)
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """Non-interleaved (``rotate_half``) RoPE tables: ``cos``, ``sin`` ``[max_positions, D]``
    float32, read by every layer through the step's ``RopeStep`` (``gpu/layer_ops.py``)."""

    def __init__(self, config: PretrainedConfig, head_size: int, max_positions: int,
                 layer_type: str | None = None):
        super().__init__()
        self.config, self.head_size, self.max_positions = config, head_size, max_positions
        self.layer_type = layer_type  # of per-layer-type rope_parameters (rope_inv_freq)
        cos, sin = self._tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, scaling = rope_inv_freq(self.config, self.head_size, self.layer_type)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        # rotate_half's minus sign folded into the first half of sin: bit-identical results,
        # one negation fewer per q and k per layer (``apply_rope``).
        sin = emb.sin() * scaling
        sin[:, : self.head_size // 2] *= -1
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


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 as transformers does.

    ``forward(x)`` → normed ``x``; ``forward(x, residual)`` → ``(norm(x + residual), x +
    residual)``: the residual add fused in, as vLLM's layers pass it.
    """

    def __init__(self, dim: int, eps: float, ops: LayerOps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.variance_epsilon)
        return self.ops.add_rms_norm(x, residual, self.weight, self.variance_epsilon)


class LlamaAttention(nn.Module):
    """With tensor parallelism ``config`` is the rank's share (``parallel.layout.
    local_config``: its heads), and ``parallel`` sums ``o_proj``'s partial outputs."""

    def __init__(self, config: PretrainedConfig, backend: AttentionBackend, ops: LayerOps,
                 parallel: ParallelContext | None = None, layer_idx: int = 0):
        super().__init__()
        self.parallel, self.layer_idx = parallel, layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_size = attention_head_size(config)
        self.scale = self.head_size**-0.5
        # Qwen2 has q/k/v biases without saying so in attention_bias.
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        h, d = config.hidden_size, self.head_size
        # q, k and v in one matmul: HF's q_proj/k_proj/v_proj are concatenated at load time.
        self.qkv_proj = nn.Linear(h, (self.num_heads + 2 * self.num_kv_heads) * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.backend, self.ops = backend, ops
        # Set per layer by LlamaModel (gpu/models/sliding_window.py); None: full attention.
        self.sliding_window: int | None = None
        # Attention-logit soft-cap (Gemma 2's ``attn_logit_softcapping``); None: none.
        self.logits_soft_cap: float | None = None

    def project_qkv(self, x: torch.Tensor, rope: RopeStep):
        """q ``[T, H, D]``, k and v ``[T, Hkv, D]`` of ``x`` ``[T, hidden]``, q and k rotated:
        what a family changes before attention (``qwen3.Qwen3Attention`` norms q and k)."""
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D]
        return self.ops.rotary_qkv(qkv, rope, self.num_heads, self.num_kv_heads,
                                   self.head_size)

    def forward(self, x: torch.Tensor, rope: RopeStep, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.project_qkv(x, rope)
        self.backend.write_kv(k, v, kv_cache, meta)
        out = self.backend.forward(q, kv_cache, meta, self.scale,
                                   sliding_window=self.sliding_window,
                                   logits_soft_cap=self.logits_soft_cap)
        out = self.o_proj(out.reshape(t, self.num_heads * self.head_size))
        return out if self.parallel is None else self.parallel.all_reduce(out)


def act_and_mul(config: PretrainedConfig, ops: LayerOps):
    """The gated MLP's ``[N, 2I]`` → ``[N, I]`` op for the config's activation (``hidden_act``,
    Gemma's ``hidden_activation``): SwiGLU for ``silu``, GeGLU for ``gelu_pytorch_tanh``.

    Raises:
        ValueError: another activation.
    """
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    ops_by_act = {"silu": ops.silu_and_mul, "gelu_pytorch_tanh": ops.gelu_tanh_and_mul}
    if act not in ops_by_act:
        raise ValueError(f"MLP activation '{act}' is not supported (supported: "
                         f"{', '.join(ops_by_act)})")
    return ops_by_act[act]


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, ops: LayerOps,
                 parallel: ParallelContext | None = None):
        super().__init__()
        self.parallel = parallel
        h, i = config.hidden_size, config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        # gate and up in one matmul (HF's gate_proj/up_proj concatenated at load time).
        self.gate_up_proj = nn.Linear(h, 2 * i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.act_and_mul = act_and_mul(config, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.act_and_mul(self.gate_up_proj(x)))  # [T, 2I] → [T, H]
        return out if self.parallel is None else self.parallel.all_reduce(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, backend: AttentionBackend, ops: LayerOps,
                 parallel: ParallelContext | None = None, attention=LlamaAttention,
                 layer_idx: int = 0):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = attention(config, backend, ops, parallel, layer_idx)
        self.mlp = LlamaMLP(config, ops, parallel)
        self.input_layernorm = RMSNorm(h, eps, ops)
        self.post_attention_layernorm = RMSNorm(h, eps, ops)

    def forward(self, x, residual, rope: RopeStep, kv_cache: KVCache, meta: AttentionMetadata):
        """Returns ``(mlp_out, residual)``: the next layer's norm adds them (vLLM's layout)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    """``config``: the full model's; ``local``: this rank's share (``local_config``), the
    same object without parallelism. A pipeline stage builds only its layers (the others are
    ``PPMissingLayer``s, so the layer indices stay global), the first stage the embedding, the
    last the final norm. ``family``: the causal LM class whose parts these are (its
    ``attention_cls``, ``decoder_layer_cls``, ``norm_cls``, ``rotary_cls``)."""

    def __init__(self, config: PretrainedConfig, backend: AttentionBackend, max_positions: int,
                 ops: LayerOps, parallel: ParallelContext | None = None,
                 local: PretrainedConfig | None = None, family=None):
        super().__init__()
        local, family = local or config, family or LlamaForCausalLM
        lay = parallel.layout if parallel is not None else None
        first, last = (lay.layers if lay else (0, config.num_hidden_layers))
        if lay is None:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        elif lay.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(
                lay.vocab_per_rank, config.hidden_size, lay.vocab[0], parallel)
        else:
            self.embed_tokens = PPMissingLayer()
        self.layers = nn.ModuleList(
            family.decoder_layer_cls(local, backend, ops, parallel, family.attention_cls, i)
            if first <= i < last else PPMissingLayer() for i in range(config.num_hidden_layers)
        )
        for i, window in enumerate(layer_sliding_windows(config)):
            if first <= i < last:
                self.layers[i].self_attn.sliding_window = window
        self.norm = (family.norm_cls(config.hidden_size, config.rms_norm_eps, ops)
                     if lay is None or lay.is_last_stage else PPMissingLayer())
        self.rotary_emb = family.rotary_cls(config, attention_head_size(config), max_positions)
        self.first_layer, self.end_layer = first, last


class LlamaForCausalLM(nn.Module):
    """Causal LM over the flattened paged batch.

    Args:
        config: a transformers Llama/Mistral/Qwen2 config.
        backend: attention backend (``gpu.attention.get_attention_backend``).
        max_positions: size of the RoPE table (``max_model_len``).
        ops: the elementwise ops (``gpu.layer_ops.get_layer_ops``); torch's by default.
    """

    # Our fused parameters and the HF checkpoint names they are concatenated from (dim 0, in
    # order), as vLLM's ``stacked_params_mapping``.
    stacked_params = (("qkv_proj", ("q_proj", "k_proj", "v_proj")),
                      ("gate_up_proj", ("gate_proj", "up_proj")))
    # What a family built on this one changes (``qwen3.Qwen3ForCausalLM``,
    # ``gemma2.Gemma2ForCausalLM``): the parts ``LlamaModel`` builds.
    attention_cls = LlamaAttention
    decoder_layer_cls = LlamaDecoderLayer
    norm_cls = RMSNorm
    rotary_cls = RotaryEmbedding
    # Each layer's attention applies its config window (registry.unhonoured_sliding_window).
    honours_sliding_window = True

    def __init__(self, config: PretrainedConfig, backend: AttentionBackend, max_positions: int,
                 ops: LayerOps | None = None, parallel: ParallelContext | None = None):
        super().__init__()
        self.config = config
        self.ops = ops or TorchLayerOps()
        self.parallel = parallel
        # What this rank's KV cache holds (its KV heads, its stage's layers).
        self.kv_config = config if parallel is None else local_config(config, parallel.layout)
        self.model = LlamaModel(config, backend, max_positions, self.ops, parallel,
                                self.kv_config, type(self))
        if parallel is None or parallel.layout.is_last_stage:
            self.lm_head = nn.Linear(config.hidden_size, self.kv_config.vocab_size, bias=False)
        else:
            self.lm_head = PPMissingLayer()
        self.tie_weights()

    @classmethod
    def build(cls, config: PretrainedConfig, backend: AttentionBackend, max_positions: int,
              ops: LayerOps, device: torch.device, dtype: torch.dtype,
              parallel: ParallelContext | None = None) -> LlamaForCausalLM:
        """The model on ``device`` in ``dtype``, its parameters allocated but not initialised
        (the weights are loaded next: no time spent on random init), its buffers computed."""
        with torch.device("meta"):
            model = cls(config, backend, max_positions, ops, parallel)
        model = model.to_empty(device=device).to(dtype)
        model.init_buffers(device)
        return model

    def init_buffers(self, device: torch.device) -> None:
        """After ``to_empty``/``to(dtype)``: the RoPE tables computed in float32, and
        ``lm_head`` tied to the embeddings again (``to_empty`` gives each its own tensor)."""
        self.model.rotary_emb.init_tables(device)
        self.tie_weights()

    def tie_weights(self) -> None:
        both = not isinstance(self.lm_head, PPMissingLayer) and not isinstance(
            self.model.embed_tokens, PPMissingLayer)  # not on different pipeline stages
        if getattr(self.config, "tie_word_embeddings", False) and both:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, inputs: StepInputs, kv_caches: list[KVCache]) -> torch.Tensor | None:
        """float32 logits ``[len(inputs.logits_indices), vocab]`` of the step's sampled rows.

        ``kv_caches``: one per layer this rank runs. Under parallelism, only the rank that
        samples (``RankLayout.is_driver``) gets the logits; the others return ``None``. A
        non-first stage receives its input from the previous stage, a non-last stage sends its
        output on (around ``stage_forward``, which is what a CUDA graph captures).
        """
        pp = self.parallel
        received = None
        if pp is not None and not pp.layout.is_first_stage:
            received = pp.recv_packed(torch.empty(
                (2, inputs.input_ids.shape[0], self.config.hidden_size), dtype=self.hidden_dtype,
                device=inputs.input_ids.device))
        out = self.stage_forward(inputs, kv_caches, received)
        if pp is not None and not pp.layout.is_last_stage:
            pp.send_packed(out)
            return None
        return out

    @property
    def hidden_dtype(self) -> torch.dtype:
        """The dtype of the hidden states and residuals passed between stages."""
        m = self.model
        return m.layers[m.first_layer].input_layernorm.weight.dtype

    def stage_forward(self, inputs: StepInputs, kv_caches: list[KVCache],
                      received: torch.Tensor | None = None) -> torch.Tensor | None:
        """This rank's share of the step between the stage's receive and its send: no
        point-to-point transfer, only the stage's tensor-parallel collectives.

        ``received``: ``[2, T, hidden]`` (hidden, residual) from the previous stage, on a
        non-first stage (``None`` on the first: it embeds ``inputs.input_ids``). Returns, on
        the last stage, the logits as ``forward`` does (``None`` on a rank that does not
        sample), else the ``[2, T, hidden]`` to send to the next stage.
        """
        if received is None:
            x, residual = self.embed(inputs.input_ids), None
        else:
            x, residual = received[0], received[1]
        x, residual = self.run_layers(x, residual, inputs, kv_caches)
        if self.parallel is not None and not self.parallel.layout.is_last_stage:
            return torch.stack((x, residual))
        return self.compute_logits(x, residual, inputs.logits_indices)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` token ids → ``[T, hidden]`` (the first stage's; vocab-parallel under tp)."""
        return self.model.embed_tokens(input_ids)

    def run_layers(self, x: torch.Tensor, residual: torch.Tensor | None, inputs: StepInputs,
                   kv_caches: list[KVCache]) -> tuple[torch.Tensor, torch.Tensor]:
        """The stage's decoder layers over ``x`` ``[T, hidden]``: ``(mlp_out, residual)``."""
        m = self.model
        rope = m.rotary_emb.step(inputs.positions)
        for layer, kv_cache in zip(m.layers[m.first_layer:m.end_layer], kv_caches):
            x, residual = layer(x, residual, rope, kv_cache, inputs.attn)
        return x, residual

    def compute_logits(self, x: torch.Tensor, residual: torch.Tensor,
                       rows: torch.Tensor) -> torch.Tensor | None:
        """The last stage's end: the final norm and ``lm_head`` over the sampled ``rows``
        only, gathered over the tensor-parallel ranks; float32 ``[len(rows), vocab]``, or
        ``None`` on a rank that does not sample."""
        x, _ = self.model.norm(x[rows], residual[rows])
        if getattr(self.lm_head, "float32_out_free", False):
            x = x.float()  # float32 out: bfloat16 rounding of the logits never picks a token
        logits = self.lm_head(x)  # gathered before the cast: half the bytes in bfloat16
        if self.parallel is not None:
            logits = self.parallel.gather_logits(logits, self.config.vocab_size)
        return None if logits is None else logits.float()
