"""Request state as the scheduler sees it (vLLM V1's ``vllm/v1/request.py``, trimmed).

A leaf of the engine: it imports the device side's parameter types and one feature's state
type (``StructuredOutputRequest``) and the block-hash type, both leaves: nothing that imports
it back. Which beam
search a request is a beam of is the beam package's to know (``BeamScheduler.group_of``)."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedserve.gpu.lora.request import LoRARequest
from pagedserve.gpu.pooling.pooling_params import PoolingParams
from pagedserve.gpu.sample.prompt_logprobs import PromptLogprobsChunk, PromptLogprobsWanted
from pagedserve.gpu.sample.sampler import TokenLogprobs
from pagedserve.gpu.sample.sampling_params import SamplingParams

if TYPE_CHECKING:  # a leaf of the feature's package: it imports nothing of ours
    from pagedserve.actors.kv.hashing import BlockHash
    from pagedserve.actors.structured_output.request import StructuredOutputRequest


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # guided; its grammar is still compiling
    WAITING_FOR_BEAMS = "waiting_for_beams"  # a beam that sampled; its siblings have not yet
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # a KV connector loads its prompt blocks
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


FINISH_REASONS: dict[RequestStatus | None, str] = {  # .get(None): None, still running
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True)
class RequestOutput:
    """What the scheduler pushes to a request's queue after a step.

    Attributes:
        new_token_ids: tokens sampled for the request in this step.
        finish_reason: ``stop``, ``length``, ``abort``, ``error`` or ``None`` while running.
        error: message when ``finish_reason == "error"``.
        logprobs: one per new token, when asked for.
        prompt_logprobs: on the first output of a request that asked: one per prompt token
            after the first (``Request.prompt_logprobs``).
        num_cached_tokens: on the first output, the prompt tokens the prefix cache held.
        pooled: a pooling request's one output: its embedding or class scores.
    """

    new_token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    pooled: list[float] | None = None


@dataclass(slots=True, eq=False)
class Request:
    """One generation request.

    The unified scheduling model: ``num_computed_tokens`` catches up with ``num_tokens``
    (prompt + output so far); a prefill chunk and a decode are the same operation.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    output_queue: asyncio.Queue[RequestOutput]
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0  # lower runs earlier (vLLM's convention), under --scheduling-policy priority
    cache_salt: str | None = None  # enters the first block's hash: tenants never share blocks
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    first_token_time: float | None = None
    block_hashes: list[BlockHash] = field(default_factory=list)  # one per full block, chained
    scheduled_time: float | None = None  # first time it was in a step (for queue time)
    structured_output: StructuredOutputRequest | None = None  # guided decoding state
    # With sampling_params.prompt_logprobs: prompt tokens 1.. as the prefill computed them.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # vLLM's disaggregated prefill/decode fields (``do_remote_decode``, ``remote_block_ids``...):
    # the client's at arrival; at the end, what the KV connector returns for the response.
    kv_transfer_params: dict[str, Any] | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs with; None: the base model

    @property
    def lora_int_id(self) -> int | None:
        return None if self.lora_request is None else self.lora_request.lora_int_id
    # A pooling request (``--runner pooling``): prefill only, then one pooled output.
    pooling_params: PoolingParams | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Prompt logprobs come from the prefill's logits, so a request that wants them
        computes its whole prompt: it takes no prefix-cache hit (its blocks are still cached
        for others). vLLM V1 does the same. So does a pooling request whose pooling reads
        every prompt token's hidden state (MEAN, CLS: ``PoolingType.needs_whole_prompt``)."""
        pooling = self.pooling_params
        return (self.sampling_params.prompt_logprobs is not None
                or (pooling is not None and pooling.skip_reading_prefix_cache))

    def prompt_logprobs_wanted(self, start: int, n: int) -> PromptLogprobsWanted | None:
        """What the runner needs to compute prompt logprobs for the chunk of ``n`` tokens at
        ``start``; ``None`` when it needs none (not asked, past the prompt, or all known:
        the recompute after a preemption)."""
        k = self.sampling_params.prompt_logprobs
        last = self.num_prompt_tokens - 1  # the logits there predict the first output token
        if k is None or start >= last or len(self.prompt_logprobs) >= last:
            return None
        end = start + n
        return PromptLogprobsWanted(k, self.prompt_token_ids[end] if end <= last else None)

    def add_prompt_logprobs(self, chunk: PromptLogprobsChunk) -> None:
        """Append a chunk's entries, skipping those already known (recomputed after a
        preemption mid-prefill)."""
        skip = len(self.prompt_logprobs) - (chunk.start - 1)
        if skip >= 0:
            self.prompt_logprobs.extend(chunk.entries[skip:])
