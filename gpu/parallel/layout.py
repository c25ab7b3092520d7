"""Which part of the model one rank holds: the arithmetic of tensor × pipeline parallelism.

Ranks are numbered stage-major: ``rank = pp_rank * tp_size + tp_rank`` (vLLM's order), so a
stage's tensor-parallel ranks are consecutive and the sampled tokens come from rank
``(pp_size - 1) * tp_size``, the last stage's first rank.

Tensor parallelism splits attention by heads (Megatron-LM, Shoeybi et al. 2019): rank ``r``
holds query heads ``[r H/tp, (r+1) H/tp)`` and their KV heads; when ``tp > Hkv`` each KV head
is replicated on ``tp / Hkv`` ranks (vLLM's ``QKVParallelLinear``). The MLP splits the
intermediate size; the vocabulary is split in equal ranges, the last padded with zero rows.
Pipeline parallelism gives each stage a contiguous range of layers, as even as possible
(vLLM's ``get_pp_indices``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

from transformers import PretrainedConfig


def _heads(config: PretrainedConfig) -> tuple[int, int, int]:
    """``(num_heads, num_kv_heads, head_size)`` of the full model."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_size = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, kv_heads, head_size


def tp_problem(config: PretrainedConfig, tp: int) -> str | None:
    """Why ``tp`` ranks cannot split this model's heads and MLP (one clause), or ``None``."""
    heads, kv_heads, _ = _heads(config)
    if heads % tp:
        return f"does not divide the model's {heads} attention heads"
    if (tp <= kv_heads and kv_heads % tp) or (tp > kv_heads and tp % kv_heads):
        return f"can neither split nor replicate the model's {kv_heads} KV heads evenly"
    if config.intermediate_size % tp:
        return f"does not divide the MLP's intermediate size {config.intermediate_size}"
    moe = getattr(config, "moe_intermediate_size", None)
    if getattr(config, "num_experts", 0) and moe and moe % tp:
        return f"does not divide the experts' intermediate size {moe}"
    return None


TpCheck = Callable[[PretrainedConfig, int], "str | None"]


def working_tp_sizes(config: PretrainedConfig, extra: TpCheck | None = None) -> list[int]:
    """Every tensor-parallel size this model splits into (at most its head count, the most
    ranks that each hold a head), also passing ``extra`` (the GGUF block rule) when given."""
    heads, _, _ = _heads(config)
    return [tp for tp in range(1, heads + 1)
            if tp_problem(config, tp) is None and (extra is None or extra(config, tp) is None)]


def check_layout(config: PretrainedConfig, tp: int, pp: int,
                 extra: TpCheck | None = None) -> None:
    """Refuse, in one line naming the sizes that work, a layout that cannot split this model;
    ``extra``: a further rule of the weights' format (``gguf_shard.gguf_split_problem``).

    Raises:
        ValueError: ``tp`` does not divide the heads (or the MLP), the KV heads cannot be
            split or replicated evenly, ``extra`` refuses it, or there are more stages than
            layers.
    """
    if tp < 1 or pp < 1:
        raise ValueError(f"--tensor-parallel-size {tp} and --pipeline-parallel-size {pp} must "
                         "be at least 1")
    problem = tp_problem(config, tp) or (extra and extra(config, tp))
    if problem:
        sizes = ", ".join(map(str, working_tp_sizes(config, extra)))
        raise ValueError(f"--tensor-parallel-size {tp} {problem}; sizes that work for this "
                         f"model: {sizes}")
    if pp > config.num_hidden_layers:
        raise ValueError(f"--pipeline-parallel-size {pp} is more than the model's "
                         f"{config.num_hidden_layers} layers (1 to {config.num_hidden_layers} "
                         "work)")


@dataclass(slots=True, frozen=True)
class RankLayout:
    """The part of the model rank ``tp_rank`` of stage ``pp_rank`` holds.

    Attributes:
        layers: ``(start, end)``: the global indices of the decoder layers this stage runs.
        q_heads: ``(start, end)`` of the query heads; ``kv_heads`` likewise (one replicated
            head when ``tp > Hkv``).
        vocab: ``(start, end)`` of the vocabulary rows held, ``vocab_per_rank`` rows in all
            (the last rank's tail is zero padding).
        moe_intermediate: ``(start, end)`` of every expert's intermediate rows (a model with
            experts: ``moe_intermediate_size`` split as the dense MLP's is; else ``(0, 0)``).
    """

    tp_size: int
    pp_size: int
    tp_rank: int
    pp_rank: int
    layers: tuple[int, int]
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    vocab_per_rank: int
    moe_intermediate: tuple[int, int] = (0, 0)

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        """The rank that samples: the last stage's first tensor-parallel rank."""
        return self.is_last_stage and self.tp_rank == 0

    def describe(self) -> dict:
        """What the start-up log and ``/admin/stats`` show for this rank."""
        return {"rank": self.rank, "tp_rank": self.tp_rank, "pp_rank": self.pp_rank,
                "layers": list(self.layers), "q_heads": list(self.q_heads),
                "kv_heads": list(self.kv_heads), "vocab": list(self.vocab)}


def stage_layers(num_layers: int, pp: int, pp_rank: int) -> tuple[int, int]:
    """Layers ``[start, end)`` of stage ``pp_rank``: ``num_layers // pp`` each, the first
    ``num_layers % pp`` stages one more."""
    base, extra = divmod(num_layers, pp)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (pp_rank < extra)


def rank_layout(config: PretrainedConfig, tp: int, pp: int, rank: int) -> RankLayout:
    """The layout of global ``rank`` (``check_layout`` first)."""
    check_layout(config, tp, pp)
    pp_rank, tp_rank = divmod(rank, tp)
    heads, kv_heads, _ = _heads(config)
    hq = heads // tp
    if tp <= kv_heads:
        hkv = kv_heads // tp
        kv = (tp_rank * hkv, (tp_rank + 1) * hkv)
    else:
        kv_index = tp_rank // (tp // kv_heads)
        kv = (kv_index, kv_index + 1)
    inter = config.intermediate_size // tp
    per_rank = -(-config.vocab_size // tp)
    vocab = (min(tp_rank * per_rank, config.vocab_size),
             min((tp_rank + 1) * per_rank, config.vocab_size))
    moe = (getattr(config, "moe_intermediate_size", None) or 0) // tp
    return RankLayout(tp, pp, tp_rank, pp_rank,
                      stage_layers(config.num_hidden_layers, pp, pp_rank),
                      (tp_rank * hq, (tp_rank + 1) * hq), kv,
                      (tp_rank * inter, (tp_rank + 1) * inter), vocab, per_rank,
                      (tp_rank * moe, (tp_rank + 1) * moe))


def local_config(config: PretrainedConfig, layout: RankLayout) -> PretrainedConfig:
    """A copy of ``config`` sized as this rank's share: its heads, intermediate size and
    vocabulary rows, and ``num_hidden_layers`` = the stage's layers (what its KV cache holds).
    ``head_dim`` is set explicitly: ``hidden_size // heads`` no longer gives it."""
    _, _, head_size = _heads(config)
    local = copy.deepcopy(config)
    local.head_dim = head_size
    local.num_attention_heads = layout.q_heads[1] - layout.q_heads[0]
    local.num_key_value_heads = layout.kv_heads[1] - layout.kv_heads[0]
    local.intermediate_size = layout.intermediate[1] - layout.intermediate[0]
    if getattr(config, "moe_intermediate_size", None):
        local.moe_intermediate_size = layout.moe_intermediate[1] - layout.moe_intermediate[0]
    local.vocab_size = layout.vocab_per_rank
    local.num_hidden_layers = layout.layers[1] - layout.layers[0]
    return local
