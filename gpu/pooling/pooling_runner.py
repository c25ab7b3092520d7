"""The model runner's pooling half (``--runner pooling``): a step's forward pass up to the final
hidden states, then the pooler (vLLM V1's pooling path in ``gpu_model_runner.py``: prefill
only, no logits, no sampling).

The model is a decoder seen through ``models/adapters.CausalLMForEmbedding`` (paged KV, prefix
cache) or an encoder (``models/bert.py``: no KV cache). ``PoolingInfo`` is what the rest of the
engine learns of it at load: which pooling, which head, and whether prompts may be chunked
and served from the prefix cache (only when the model keeps a KV cache).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from pagedserve.gpu.batch import ModelRunnerOutput, ScheduledRequest, order_batch
from pagedserve.gpu.pooling.pooler import Pooler
from pagedserve.gpu.pooling.pooling_params import PoolerConfig, PoolingType
from pagedserve.gpu.step_inputs import prepare_inputs

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class PoolingInfo:
    """A pooling model as the engine and the HTTP layer see it (on ``ModelInfo.pooling``).

    Attributes:
        pooling_type: ``LAST``, ``MEAN`` or ``CLS``.
        normalize: the embeddings' default L2 normalisation.
        dimensions: the default Matryoshka size (``--pooler-config``), else ``None``.
        hidden_size: the embedding's length.
        is_cross_encoder: a ``*ForSequenceClassification``: ``/score`` runs the pair through
            the classifier; else the embeddings' cosine similarity.
        num_labels: the classifier's outputs (0 without one).
        matryoshka_dimensions: the sizes the config allows (``[]``: any; ``None``: the model
            is not a Matryoshka model and ``dimensions`` is refused).
        needs_kv_cache: a decoder (chunked prefill and prefix caching apply); ``False`` for an
            encoder, whose prompts run whole and uncached.
    """

    pooling_type: str
    normalize: bool
    hidden_size: int
    dimensions: int | None = None
    is_cross_encoder: bool = False
    num_labels: int = 0
    matryoshka_dimensions: list[int] | None = None
    needs_kv_cache: bool = True


def sentence_transformers_pooling(path: Path) -> PoolingType | None:
    """The pooling mode of a sentence-transformers checkpoint (``modules.json`` names its
    ``Pooling`` module's folder, whose ``config.json`` sets ``pooling_mode_*``), as vLLM reads
    it; ``None`` when there is none."""
    try:
        modules = json.loads((path / "modules.json").read_text())
        folder = next(m["path"] for m in modules if m.get("type", "").endswith(".Pooling"))
        config = json.loads((path / folder / "config.json").read_text())
    except (OSError, ValueError, StopIteration, KeyError, TypeError):
        return None
    for key, kind in (("pooling_mode_cls_token", PoolingType.CLS),
                      ("pooling_mode_mean_tokens", PoolingType.MEAN),
                      ("pooling_mode_lasttoken", PoolingType.LAST)):
        if config.get(key):
            return kind
    return None


def matryoshka_dimensions(hf_config: Any) -> list[int] | None:
    """The config's ``matryoshka_dimensions`` (vLLM's rule), ``[]`` for ``is_matryoshka``
    without a list, ``None`` when the model is not one."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        return [int(d) for d in dims]
    return [] if getattr(hf_config, "is_matryoshka", False) else None


class PoolingRunner:
    """Runs pooling steps for ``ModelRunner`` (which owns the model and the KV tensors).

    Args:
        model: anything with ``hidden_states(inputs, kv_caches, token_type_ids) -> [T, H]``
            and ``default_pooling_type``, ``needs_kv_cache``; a ``classify`` method makes it a
            cross-encoder.
        pooler_config: ``--pooler-config`` (its fields override the model's defaults).
        path: the checkpoint folder (a sentence-transformers pooling config there).
    """

    def __init__(self, model: Any, hf_config: Any, pooler_config: PoolerConfig | None,
                 path: Path, block_size: int, device: torch.device):
        pc = pooler_config or PoolerConfig()
        kind = PoolingType(pc.pooling_type or sentence_transformers_pooling(path)
                           or model.default_pooling_type)
        classifier = getattr(model, "classify", None)
        self.model, self.block_size, self.device = model, block_size, device
        self.pooler = Pooler(kind, classifier)
        normalize = pc.normalize if pc.normalize is not None else pc.use_activation
        self.info = PoolingInfo(
            pooling_type=kind.value, normalize=True if normalize is None else bool(normalize),
            hidden_size=hf_config.hidden_size, dimensions=pc.dimensions,
            is_cross_encoder=classifier is not None,
            num_labels=getattr(hf_config, "num_labels", 0) if classifier is not None else 0,
            matryoshka_dimensions=matryoshka_dimensions(hf_config),
            needs_kv_cache=model.needs_kv_cache)
        log.info("pooling_model", pooling_type=kind.value, normalize=self.info.normalize,
                 cross_encoder=self.info.is_cross_encoder, kv_cache=model.needs_kv_cache)

    def forget(self, req_id: str) -> None:
        self.pooler.forget(req_id)

    def execute(self, scheduled: list[ScheduledRequest], kv_caches: list) -> ModelRunnerOutput:
        """One forward pass over the step's prefill chunks; the finished requests' vectors."""
        reqs = order_batch(scheduled)
        inputs = prepare_inputs(reqs, self.block_size, self.device)
        hidden = self.model.hidden_states(inputs, kv_caches, self._token_types(reqs))
        return ModelRunnerOutput({}, pooler_output=self.pooler.pool(hidden, reqs))

    def _token_types(self, reqs: list[ScheduledRequest]) -> torch.Tensor | None:
        """``[T]`` segment ids of the step's tokens (a cross-encoder's sentence pairs), or
        ``None`` when every request has none."""
        if not any(r.pooling_params and r.pooling_params.token_type_ids for r in reqs):
            return None
        ids: list[int] = []
        for r in reqs:
            n, start = len(r.token_ids), r.num_computed_tokens
            given = r.pooling_params.token_type_ids if r.pooling_params else None
            ids.extend(given[start:start + n] if given else [0] * n)
        return torch.tensor(ids, dtype=torch.int64, device=self.device)

    def num_virtual_blocks(self, max_model_len: int, max_num_batched_tokens: int,
                           max_num_seqs: int) -> int:
        """An encoder's block count: no K/V tensors back them; the scheduler's accounting only
        (a step's prompts, each whole: at most the token budget plus a partial block each)."""
        per_seq = -(-max_model_len // self.block_size)
        return max(per_seq, -(-max_num_batched_tokens // self.block_size) + max_num_seqs)
