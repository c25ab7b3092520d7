"""What the scheduler hands the model runner each step, and what comes back.

vLLM V1's unified step (``vllm/v1/core/sched/output.py``): every scheduled request contributes
the tokens it computes this step, whether they are a prefill chunk or one decode token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING

from pagedserve.gpu.lora.request import LoRARequest
from pagedserve.gpu.pooling.pooling_params import PoolingParams
from pagedserve.gpu.sample.prompt_logprobs import PromptLogprobsChunk, PromptLogprobsWanted
from pagedserve.gpu.sample.sampler import TokenLogprobs
from pagedserve.gpu.sample.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from pagedserve.gpu.kv_connector.base import KVConnectorMetadata


# A decode's input token when the scheduler built the step before the previous one's output
# came (``--async-scheduling``): the token this runner sampled for the request last
# (``gpu/prev_sampled.py`` puts it in). Never a vocabulary id.
PREV_SAMPLED = -1


class Segment(IntEnum):
    """The three kinds of request in a step, in the order the flattened batch holds them
    (vLLM V1's backends split a batch the same way): decode attention takes a run of decodes
    in one call, variable-length attention the prefill chunks in another."""

    DECODE = 0  # one query token: a sampled token fed back (or a one-token chunk)
    SPEC_DECODE = 1  # a sampled token and its drafts: a few causal queries
    PREFILL = 2  # a prompt chunk, or tokens recomputed after preemption


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step.

    Attributes:
        req_id: request id.
        token_ids: tokens computed this step (prompt chunk, recomputed output, or the last
            sampled token); ``token_ids[0]`` sits at position ``num_computed_tokens``.
        num_computed_tokens: tokens whose K/V are already in the cache before this step.
        block_ids: the request's whole block table, in order.
        sampling_params: how to sample the request's next token.
        sample: whether this step reaches the end of the known tokens, so a token is sampled.
        num_prompt_tokens: prompt length (tokens past it are output, for penalties).
        prefix_token_ids: the tokens before ``num_computed_tokens`` when the runner has not
            seen them (a prefix-cache hit at admission); else ``None``.
        spec_token_ids: draft tokens (speculative decoding) computed after ``token_ids`` in
            the same step; the runner returns the accepted ones plus one (greedy requests).
        prompt_logprobs: set on a prefill chunk whose request wants prompt logprobs (its
            logits rows are computed too: ``gpu/sample/prompt_logprobs.py``); else ``None``.
        lora_request: the adapter the request runs with (``gpu/lora/``); ``None``: the base.
        pooling_params: a pooling request's (``--runner pooling``): its chunks are pooled
            (``gpu/pooling/pooler.py``) and nothing is sampled; ``sample`` marks its last chunk.
    """

    req_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    sampling_params: SamplingParams
    sample: bool
    num_prompt_tokens: int = 0
    prefix_token_ids: list[int] | None = None
    spec_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: PromptLogprobsWanted | None = None
    lora_request: LoRARequest | None = None
    pooling_params: PoolingParams | None = None

    @property
    def num_step_tokens(self) -> int:
        """Tokens whose K/V this step writes: ``token_ids`` and the drafts."""
        return len(self.token_ids) + len(self.spec_token_ids)

    @property
    def is_decode(self) -> bool:
        """One query token this step: what decode attention (and a CUDA graph) takes."""
        return self.num_step_tokens == 1

    @property
    def segment(self) -> Segment:
        if self.is_decode:
            return Segment.DECODE
        return Segment.SPEC_DECODE if self.spec_token_ids else Segment.PREFILL


def order_batch(reqs: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """The requests in batch order (``Segment``'s), each segment in scheduling order."""
    return sorted(reqs, key=lambda r: r.segment)


@dataclass(slots=True, frozen=True)
class BatchLayout:
    """How many requests and tokens each segment of a step's batch holds, in batch order:
    decodes (one token each), decodes with drafts, prefill chunks.

    The attention metadata carries it; ``decode_split`` is the one place that says which
    leading part of the batch goes to decode attention.
    """

    num_decodes: int
    num_spec_decodes: int = 0
    num_spec_decode_tokens: int = 0
    num_prefills: int = 0
    num_prefill_tokens: int = 0

    @classmethod
    def of(cls, reqs: list[ScheduledRequest]) -> BatchLayout:
        """The layout of ``reqs``. Raises ``ValueError`` if they are not in batch order."""
        counts = [0, 0, 0]
        tokens = [0, 0, 0]
        last = Segment.DECODE
        for r in reqs:
            seg = r.segment
            if seg < last:
                raise ValueError(f"request {r.req_id!r} ({seg.name}) after a {last.name}: "
                                 "the batch must be ordered (order_batch)")
            last = seg
            counts[seg] += 1
            tokens[seg] += r.num_step_tokens
        return cls(counts[0], counts[1], tokens[1], counts[2], tokens[2])

    @property
    def num_reqs(self) -> int:
        return self.num_decodes + self.num_spec_decodes + self.num_prefills

    def decode_split(self, multi_query_decode: bool) -> tuple[int, int]:
        """``(requests, tokens)`` at the head of the batch for decode attention: the decodes,
        and with a kernel that takes several queries per sequence (``multi_query_decode``) the
        decodes with drafts too. The rest are prefill chunks, which drafts also are."""
        if multi_query_decode:
            return (self.num_decodes + self.num_spec_decodes,
                    self.num_decodes + self.num_spec_decode_tokens)
        return self.num_decodes, self.num_decodes


@dataclass(slots=True)
class SchedulerOutput:
    """A step's batch: the scheduled requests and the ids that ended since the last step.

    Guided decoding: ``grammar_bitmask`` (int32 ``[G, ceil(vocab / 32)]``, a set bit = allowed)
    holds one row per request that is guided and samples this step, and
    ``structured_output_request_ids`` maps each such request id to its row. ``None`` / empty
    when no guided request samples this step (unguided batches pay nothing).

    ``blocks_to_copy``: ``(src, dst)`` KV block ids to copy before the forward pass (beam
    search's copy-on-write of a shared partial block; ``gpu/kv_cache.copy_blocks``).

    ``kv_connector_metadata``: the KV connector's loads and saves for this step (its scheduler
    half's ``build_connector_meta``); ``None`` without a connector or with nothing to move.
    """

    scheduled: list[ScheduledRequest]
    finished_req_ids: set[str] = field(default_factory=set)
    grammar_bitmask: torch.Tensor | None = None
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    kv_connector_metadata: KVConnectorMetadata | None = None

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(r.num_step_tokens for r in self.scheduled)


@dataclass(slots=True)
class ModelRunnerOutput:
    """Sampled token ids per request id (one each, or with drafts the accepted ones plus one),
    and their logprobs for requests that asked; prompt logprobs of the prefill chunks that
    asked."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    # Speculative decoding: seconds the draft model took, and the verify (target forward and
    # rejection sampling), in a step that verified drafts; else 0.
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    # KV connector (``gpu/kv_connector/``): requests whose blocks finished going out / coming
    # in since the last step, and those whose load failed (recomputed or failed by policy).
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    # Pooling (``--runner pooling``): each request whose prefill ended this step, its vector
    # (an embedding, or a classifier's scores).
    pooler_output: dict[str, list[float]] = field(default_factory=dict)

    def add_transfers(self, other: ModelRunnerOutput) -> None:
        """Take ``other``'s KV connector reports too (the scheduler's per-request reruns)."""
        self.finished_sending |= other.finished_sending
        self.finished_recving |= other.finished_recving
        self.failed_recving |= other.failed_recving
