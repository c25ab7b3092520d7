"""Pooling requests on the engine side (``--runner pooling``): one prefill, one vector.

A pooling request is a ``Request`` with ``pooling_params``: it queues, is admitted, chunked
and preempted exactly as a generation request is, through the same scheduler and KV blocks;
the scheduler ends it once its last prompt chunk has run (``Scheduler._update_pooling``) with
the pooled vector the runner returned (vLLM V1's pooling path: no decode, no sampling).

Prefix caching: a decoder's LAST pooling takes cache hits (the last token is always computed
and attends to the cached K/V); MEAN and CLS pooling need the hidden states of the tokens a
hit would skip, so those requests read no cached block (their blocks are still cached for
others). An encoder keeps no KV cache at all: its prompts run whole (no chunked prefill) and
uncached (``pooling_scheduler_config``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace

from pagedserve.actors.actor import Actor
from pagedserve.actors.core.config import SchedulerConfig
from pagedserve.actors.core.request import Request, RequestOutput
from pagedserve.actors.errors import EngineError, EngineShuttingDown
from pagedserve.actors.messages import AbortRequest, AddRequest, SchedulerMessage
from pagedserve.actors.stats import RequestUpdate, StatLogger
from pagedserve.gpu.model_info import ModelInfo
from pagedserve.gpu.pooling.pooling_params import PoolingParams, PoolingType
from pagedserve.gpu.sample.sampling_params import SamplingParams


@dataclass(slots=True)
class PoolingOutput:
    """One pooling request's answer.

    Attributes:
        data: the embedding (``[hidden]`` or ``[dimensions]``) or the class scores.
        num_prompt_tokens: the prompt's length (usage).
        num_cached_tokens: prompt tokens the prefix cache held.
    """

    request_id: str
    data: list[float]
    num_prompt_tokens: int
    num_cached_tokens: int = 0


def pooling_scheduler_config(config: SchedulerConfig, info: ModelInfo,
                             enable_prefix_caching: bool) -> tuple[SchedulerConfig, bool]:
    """The scheduler settings and prefix caching for the loaded model: as given for a
    generation model or a decoder; for an encoder, whole prompts (the token budget at least
    ``max_model_len``) and no prefix cache.

    Raises:
        ValueError: a pooling model with ``--async-scheduling`` or ``--speculative-config``
            (both assume decodes, which pooling has none of).
    """
    if info.pooling is None:
        return config, enable_prefix_caching
    if config.async_scheduling or config.speculative is not None:
        raise ValueError("--async-scheduling and --speculative-config assume decode steps: "
                         "a pooling model (--runner pooling) has none; drop them")
    if info.pooling.needs_kv_cache:
        return config, enable_prefix_caching
    budget = max(config.max_num_batched_tokens, info.max_model_len)
    return replace(config, enable_chunked_prefill=False, max_num_batched_tokens=budget), False


def _engine_params(params: PoolingParams, info: ModelInfo) -> PoolingParams:
    """``params`` with what the model decides: whether the pooling reads the prefix cache."""
    kind = PoolingType(info.pooling.pooling_type)  # type: ignore[union-attr]
    return replace(params, skip_reading_prefix_cache=kind.needs_whole_prompt)


async def run_pooling(
    scheduler: Actor[SchedulerMessage], info: ModelInfo, stat_loggers: list[StatLogger],
    request_id: str,
    prompt_token_ids: list[int], params: PoolingParams, priority: int = 0,
    cache_salt: str | None = None,
) -> PoolingOutput:
    """Queue one pooling request with ``scheduler`` and await its vector; a cancelled caller
    aborts it (its blocks freed before the next step). Errors as ``AsyncEngine.encode``."""
    if info.pooling is None:
        raise ValueError("the model is served for generation: start it with --runner pooling")
    queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
    request = Request(request_id, prompt_token_ids, SamplingParams(temperature=0.0, max_tokens=1),
                      queue, priority=priority, cache_salt=cache_salt,
                      pooling_params=_engine_params(params, info))
    accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    scheduler.send(AddRequest(request, accepted))
    try:
        await accepted  # EngineOverloaded, DuplicateRequestId: never queued, not counted
        request_output = await queue.get()
    except asyncio.CancelledError:
        scheduler.send(AbortRequest(request_id))  # a no-op once the scheduler has ended it
        if accepted.done() and not accepted.cancelled() and accepted.exception() is None:
            _report(stat_loggers, request, "abort")
        raise
    _report(stat_loggers, request, request_output.finish_reason or "abort")
    if request_output.finish_reason == "abort":
        raise EngineShuttingDown(request_output.error or "request aborted by the server")
    if request_output.pooled is None:
        raise EngineError(request_output.error or "request failed")
    return PoolingOutput(request_id, request_output.pooled, len(prompt_token_ids),
                         request_output.num_cached_tokens)


def _report(loggers: list[StatLogger], request: Request, finish: str) -> None:
    """The request's one update for the stat loggers, marked as pooling (counted apart from
    generation: no tokens generated, no TTFT)."""
    if not loggers:
        return
    update = RequestUpdate(num_prompt_tokens=request.num_prompt_tokens, finish_reason=finish,
                           e2e_s=time.monotonic() - request.arrival_time, pooling=True)
    for logger in loggers:
        logger.record_request(update)
