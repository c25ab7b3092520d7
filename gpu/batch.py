"""What the scheduler hands the model runner each step, and what comes back.

vLLM V1's unified step (``vllm/v1/core/sched/output.py``): every scheduled request contributes
the tokens it computes this step, whether they are a prefill chunk or one decode token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.gpu.sampler import TokenLogprobs
from pagedserve.gpu.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


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

    @property
    def num_step_tokens(self) -> int:
        """Tokens whose K/V this step writes: ``token_ids`` and the drafts."""
        return len(self.token_ids) + len(self.spec_token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """A step's batch: the scheduled requests and the ids that ended since the last step.

    Guided decoding: ``grammar_bitmask`` (int32 ``[G, ceil(vocab / 32)]``, a set bit = allowed)
    holds one row per request that is guided and samples this step, and
    ``structured_output_request_ids`` maps each such request id to its row. ``None`` / empty
    when no guided request samples this step (unguided batches pay nothing).
    """

    scheduled: list[ScheduledRequest]
    finished_req_ids: set[str] = field(default_factory=set)
    grammar_bitmask: torch.Tensor | None = None
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(r.num_step_tokens for r in self.scheduled)


@dataclass(slots=True)
class ModelRunnerOutput:
    """Sampled token ids per request id (one each, or with drafts the accepted ones plus one),
    and their logprobs for requests that asked."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
