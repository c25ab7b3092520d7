"""What a pooling request asks for, and how the model pools (vLLM's ``vllm/pooling_params.py``
and ``vllm/config/pooler.py``, trimmed to sequence pooling).

A pooling request runs its prompt's prefill only (no decode, no sampling): the runner returns
one vector per request, the final hidden states pooled over the prompt (``LAST``, ``MEAN`` or
``CLS``, ``gpu/pooling/pooler.py``), then an embedding head (Matryoshka truncation, L2 norm) or a
classifier (a cross-encoder's logits and their sigmoid / softmax).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass


class PoolingType(str, enum.Enum):
    """Which hidden states of a prompt make its one vector (a ``str``: settings dump as
    JSON)."""

    LAST = "LAST"  # the last token's: a causal model has seen the whole prompt there
    MEAN = "MEAN"  # the average over every prompt token
    CLS = "CLS"  # the first token's (BERT's [CLS])

    @property
    def needs_whole_prompt(self) -> bool:
        """Pooled over tokens a prefix-cache hit would skip (MEAN: all; CLS: the first), so
        a request of this type reads no cached block: the hidden states are recomputed
        (vLLM skips reading the prefix cache for such requests the same way)."""
        return self is not PoolingType.LAST


@dataclass(slots=True)
class PoolerConfig:
    """``--pooler-config`` (vLLM's keys): ``pooling_type`` (``LAST``, ``MEAN``, ``CLS``),
    ``normalize`` (L2-normalise embeddings; vLLM's newer ``use_activation`` is the same switch
    for embeddings) and ``dimensions`` (a default Matryoshka size). ``None``: the model's own
    default (sentence-transformers' ``1_Pooling/config.json``, else the architecture's)."""

    pooling_type: PoolingType | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    use_activation: bool | None = None


_POOLER_KEYS = ("pooling_type", "normalize", "dimensions", "use_activation")


def parse_pooler_config(text: str) -> PoolerConfig:
    """``--pooler-config``'s JSON, e.g. ``'{"pooling_type": "MEAN", "normalize": false}'``.

    Raises:
        ValueError: not a JSON object, an unknown key, or an unknown pooling type.
    """
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--pooler-config is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError("--pooler-config must be a JSON object")
    unknown = sorted(set(raw) - set(_POOLER_KEYS))
    if unknown:
        raise ValueError(f"--pooler-config: unknown key(s) {', '.join(unknown)}; "
                         f"known: {', '.join(_POOLER_KEYS)}")
    kind = raw.get("pooling_type")
    if kind is not None:
        try:
            kind = PoolingType(str(kind).upper())
        except ValueError:
            raise ValueError(f"--pooler-config: pooling_type {kind!r} is not one of "
                             f"{', '.join(t.value for t in PoolingType)}") from None
    dims = raw.get("dimensions")
    if dims is not None and (not isinstance(dims, int) or dims < 1):
        raise ValueError("--pooler-config: dimensions must be a positive integer")
    return PoolerConfig(kind, raw.get("normalize"), dims, raw.get("use_activation"))


@dataclass(slots=True)
class PoolingParams:
    """One pooling request's parameters.

    Attributes:
        task: ``embed`` (a vector per prompt) or ``classify`` (a cross-encoder's class
            scores; ``/score`` and ``/rerank`` on a ``*ForSequenceClassification`` model).
        normalize: L2-normalise the embedding (after ``dimensions``).
        dimensions: keep the first ``dimensions`` values (Matryoshka models).
        use_activation: a classifier's sigmoid (one label) or softmax (several).
        token_type_ids: ``[num_prompt_tokens]`` segment ids of a sentence pair (BERT's
            ``token_type_ids``); ``None``: all zero.
        skip_reading_prefix_cache: the pooling type needs every prompt token's hidden state
            (``PoolingType.needs_whole_prompt``); set by the engine.
    """

    task: str = "embed"
    normalize: bool = True
    dimensions: int | None = None
    use_activation: bool = True
    token_type_ids: list[int] | None = None
    skip_reading_prefix_cache: bool = False
