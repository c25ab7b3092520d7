"""The pooler: one vector per pooling request out of a step's final hidden states.

After vLLM's ``vllm/model_executor/layers/pooler.py`` (sequence pooling, then the task's head)
and ``vllm/v1/pool/metadata.py``. A prompt may arrive in several prefill chunks (chunked
prefill), so the pooler keeps what each unfinished request has accumulated:

- ``LAST``: nothing; the last chunk's last row is the answer (a causal model has attended to
  the whole prompt there, through the KV cache, prefix-cache hits included);
- ``MEAN``: the float32 sum of the rows so far and their count, divided at the last chunk;
- ``CLS``: the first chunk's first row.

A chunk at position 0 (a first chunk, or the recompute after a preemption) starts afresh. The
scheduler marks the chunk that reaches the prompt's end with ``sample``: then the request's
vector goes through the head (``PoolingParams``: Matryoshka ``dimensions``, L2 ``normalize``;
or a classifier's logits with sigmoid / softmax) and comes back as a list of floats.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.gpu.batch import ScheduledRequest
from pagedserve.gpu.pooling.pooling_params import PoolingParams, PoolingType

Classifier = Callable[[torch.Tensor], torch.Tensor]  # pooled [B, H] -> logits [B, L]


@dataclass(slots=True)
class _Partial:
    """A request's pooled state between its prefill chunks."""

    total: torch.Tensor | None = None  # MEAN: float32 [H] sum of the rows so far
    count: int = 0
    first: torch.Tensor | None = None  # CLS: the first row, float32 [H]


class Pooler:
    """Args:
    pooling_type: how rows are pooled (the model's, or ``--pooler-config``'s).
    classifier: a cross-encoder's head (``BertForSequenceClassification.classify``) for
        ``classify`` requests; ``None`` for an embedding model.
    """

    def __init__(self, pooling_type: PoolingType, classifier: Classifier | None = None):
        self.pooling_type = pooling_type
        self.classifier = classifier
        self.partial: dict[str, _Partial] = {}

    def forget(self, req_id: str) -> None:
        """The request ended (finished or aborted) before its last chunk: drop its state."""
        self.partial.pop(req_id, None)

    def pool(self, hidden: torch.Tensor, reqs: list[ScheduledRequest]) -> dict[str, list[float]]:
        """``hidden``: ``[T, H]`` final hidden states of the step, ``reqs`` in batch order
        (their ``token_ids`` are the rows, in turn). Returns the finished requests' outputs:
        an embedding ``[H]`` (or ``[dimensions]``) or class scores ``[num_labels]``."""
        done: list[ScheduledRequest] = []
        rows: list[torch.Tensor] = []
        start = 0
        for r in reqs:
            chunk = hidden[start:start + len(r.token_ids)]
            start += len(r.token_ids)
            row = self._accumulate(r, chunk)
            if r.sample:
                done.append(r)
                rows.append(row)
        if not done:
            return {}
        return self._head(torch.stack(rows).float(), done)

    def _accumulate(self, r: ScheduledRequest, chunk: torch.Tensor) -> torch.Tensor | None:
        """Fold ``chunk`` ``[n, H]`` into ``r``'s state; on its last chunk, the pooled
        ``[H]`` (the state dropped)."""
        if self.pooling_type is PoolingType.LAST:
            return chunk[-1] if r.sample else None
        if r.num_computed_tokens == 0:
            self.partial.pop(r.req_id, None)  # a recompute starts over
        state = self.partial.setdefault(r.req_id, _Partial())
        if self.pooling_type is PoolingType.CLS:
            if r.num_computed_tokens == 0:
                state.first = chunk[0].float()
        else:
            part = chunk.float().sum(dim=0)
            state.total = part if state.total is None else state.total + part
            state.count += chunk.shape[0]
        if not r.sample:
            return None
        del self.partial[r.req_id]
        if self.pooling_type is PoolingType.CLS:
            if state.first is None:
                raise RuntimeError(f"request {r.req_id!r}: CLS pooling without position 0")
            return state.first
        return state.total / state.count

    def _head(self, pooled: torch.Tensor, reqs: list[ScheduledRequest]) -> dict[str, list[float]]:
        """The task's head over ``pooled`` ``[B, H]`` float32, row by row's parameters."""
        out: dict[str, list[float]] = {}
        params = [r.pooling_params or PoolingParams() for r in reqs]
        classify = [i for i, p in enumerate(params) if p.task == "classify"]
        if classify:
            if self.classifier is None:
                raise ValueError("this model has no classifier head (classify requests)")
            logits = self.classifier(pooled[classify]).float()  # [C, L]
            for j, i in enumerate(classify):
                scores = logits[j]
                if params[i].use_activation:
                    scores = scores.sigmoid() if scores.numel() == 1 else scores.softmax(-1)
                out[reqs[i].req_id] = scores.cpu().tolist()
        for i, p in enumerate(params):
            if p.task == "classify":
                continue
            vec = pooled[i] if p.dimensions is None else pooled[i, : p.dimensions]
            if p.normalize:
                vec = F.normalize(vec, p=2.0, dim=-1)
            out[reqs[i].req_id] = vec.cpu().tolist()
        return out
