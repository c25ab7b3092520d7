"""BERT encoder (``BertModel``, ``BertForSequenceClassification``) for pooling models.

Post-LayerNorm transformer encoder: word + absolute position + token type embeddings and a
LayerNorm; per layer, bidirectional self-attention, a residual LayerNorm, a GELU MLP and
another residual LayerNorm (Devlin et al., "BERT", 2019; layout after transformers'
``modeling_bert.py`` and vLLM's ``vllm/model_executor/models/bert.py``). Module and parameter
names are transformers', so its state dicts load unchanged.

Why the attention is not paged: an encoder has no decode, so no K/V is ever read again after
the one forward pass that computes it, and its attention is bidirectional, so a token's output
depends on tokens after it: a prompt can be neither split into chunks nor served from another
prompt's cached prefix. The engine therefore runs these prompts whole (no chunked prefill, no
prefix caching) and allocates no KV tensors; each sequence of the flattened step attends to
all of its own tokens (``scaled_dot_product_attention`` without a mask, sequence by sequence:
``query_start_loc`` bounds them).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from pagedserve.gpu.parallel.comm import ParallelContext
from pagedserve.gpu.pooling.pooling_params import PoolingType
from pagedserve.gpu.step_inputs import StepInputs


class BertEmbeddings(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        h = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, h)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, h)
        self.LayerNorm = nn.LayerNorm(h, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` ids, positions and segment ids → ``[T, hidden]``."""
        x = (self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
             + self.position_embeddings(positions))
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_size = h // self.num_heads
        self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)

    def forward(self, x: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
        """``x`` ``[T, hidden]``; ``bounds``: each sequence's ``[start, end)`` rows."""
        t = x.shape[0]
        shape = (t, self.num_heads, self.head_size)
        q, k, v = (p(x).view(shape).transpose(0, 1) for p in (self.query, self.key, self.value))
        out = torch.empty_like(q)  # [H, T, D]
        for s, e in bounds:  # bidirectional: every token sees its whole sequence
            out[:, s:e] = F.scaled_dot_product_attention(q[:, s:e], k[:, s:e], v[:, s:e])
        return out.transpose(0, 1).reshape(t, -1)


class BertSelfOutput(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, x: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
        return self.output(self.self(x, bounds), x)


class BertIntermediate(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertOutput(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertLayer(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, x: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
        x = self.attention(x, bounds)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class BertPooler(nn.Module):
    """The [CLS] row through a dense layer and tanh: a classifier's input (an embedding
    model's CLS pooling takes the raw row, as sentence-transformers does)."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, cls_rows: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(cls_rows))


def _bounds(inputs: StepInputs) -> list[tuple[int, int]]:
    qsl = inputs.attn.query_start_loc.tolist()  # once per step, not per layer
    return list(zip(qsl[:-1], qsl[1:], strict=True))


class BertModel(nn.Module):
    """A BERT encoder as an embedding model (``CLS`` pooling unless the checkpoint's
    sentence-transformers config or ``--pooler-config`` says otherwise).

    Args: as ``LlamaForCausalLM``'s (``backend``, ``max_positions``, ``ops`` are unused: the
    attention is not paged, the position table is the checkpoint's).
    """

    stacked_params = ()
    needs_kv_cache = False  # the engine allocates no K/V tensors and takes no cache hits
    default_pooling_type = PoolingType.CLS
    prefix = ""  # where the encoder's weights sit in a checkpoint of this class

    def __init__(self, config: PretrainedConfig, backend=None, max_positions: int = 0,
                 ops=None, parallel: ParallelContext | None = None):
        super().__init__()
        if parallel is not None:
            raise ValueError("BERT models run on one rank: drop -tp / -pp")
        self.config = config
        self.kv_config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)

    @classmethod
    def build(cls, config: PretrainedConfig, backend, max_positions: int, ops,
              device: torch.device, dtype: torch.dtype, parallel: ParallelContext | None = None):
        """Parameters allocated on ``device`` in ``dtype``, not initialised (loaded next)."""
        with torch.device("meta"):
            model = cls(config, backend, max_positions, ops, parallel)
        return model.to_empty(device=device).to(dtype)

    @classmethod
    def remap_state(cls, state: dict[str, torch.Tensor]) -> None:
        """Checkpoints save the encoder with or without ``bert.`` (a ``BertForMaskedLM``'s or
        a bare ``BertModel``'s): the names this class expects, in place."""
        want = cls.prefix
        have = "bert." if any(k.startswith("bert.embeddings.") for k in state) else ""
        if want == have:
            return
        for key in [k for k in state if k.startswith(have + "embeddings.")
                    or k.startswith(have + "encoder.") or k.startswith(have + "pooler.")]:
            state[want + key[len(have):]] = state.pop(key)

    def hidden_states(self, inputs: StepInputs, kv_caches: list,
                      token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``[T, hidden]`` final hidden states of every scheduled token (``kv_caches``
        unused). ``token_type_ids``: ``[T]`` int64, zeros when ``None``."""
        ids = inputs.input_ids
        types = token_type_ids if token_type_ids is not None else torch.zeros_like(ids)
        x = self.embeddings(ids, inputs.positions, types)
        bounds = _bounds(inputs)
        for layer in self.encoder.layer:
            x = layer(x, bounds)
        return x


class BertForSequenceClassification(nn.Module):
    """A BERT cross-encoder: the [CLS] row through ``bert.pooler`` and ``classifier`` gives
    ``num_labels`` logits (``classify``); ``/score`` and ``/rerank`` serve it."""

    stacked_params = ()
    needs_kv_cache = False
    default_pooling_type = PoolingType.CLS

    def __init__(self, config: PretrainedConfig, backend=None, max_positions: int = 0,
                 ops=None, parallel: ParallelContext | None = None):
        super().__init__()
        self.config = config
        self.kv_config = config
        self.bert = _PrefixedBert(config, backend, max_positions, ops, parallel)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    build = classmethod(BertModel.build.__func__)  # type: ignore[attr-defined]

    @classmethod
    def remap_state(cls, state: dict[str, torch.Tensor]) -> None:
        _PrefixedBert.remap_state(state)

    def hidden_states(self, inputs: StepInputs, kv_caches: list,
                      token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.bert.hidden_states(inputs, kv_caches, token_type_ids)

    def classify(self, cls_rows: torch.Tensor) -> torch.Tensor:
        """``[B, hidden]`` [CLS] rows → ``[B, num_labels]`` logits."""
        return self.classifier(self.bert.pooler(cls_rows.to(self.classifier.weight.dtype)))


class _PrefixedBert(BertModel):
    """The encoder inside a classifier: under ``bert.``, with the pooler it needs."""

    prefix = "bert."

    def __init__(self, config, backend=None, max_positions=0, ops=None, parallel=None):
        super().__init__(config, backend, max_positions, ops, parallel)
        self.pooler = BertPooler(config)
