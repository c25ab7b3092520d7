"""The scheduler actor: the one owner of the waiting queue, the running list and the KV blocks.

Each iteration (vLLM V1's ``vllm/v1/core/sched/scheduler.py``, reduced to its core):

1. drain the mailbox (new requests, which ``actors/core/admission.py`` accepts or refuses;
   aborts; stats queries);
2. ``schedule()``: the batch ``StepPlanner`` decides under ``max_num_batched_tokens`` and
   ``max_num_seqs`` (running requests first, then admissions; preemption by recompute when
   the blocks run out: ``actors/core/step_planner.py``);
3. send the batch to the executor actor and await its reply; with batches in flight
   (``--async-scheduling``, pipeline parallelism: ``actors/core/inflight.py``), build the next
   one first;
4. ``update_from_output()``: advance ``num_computed_tokens`` (with n-gram drafts, by the
   accepted ones plus one: ``actors/spec_decode/proposer.py``), append sampled tokens, finish
   requests, free their blocks and push each request's new tokens to its queue. A beam of a
   beam search goes to ``BeamScheduler`` instead (``actors/beam/group.py``), which forks and
   retires beams.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import structlog

from pagedserve.actors.actor import Actor
from pagedserve.actors.beam.group import BeamScheduler
from pagedserve.actors.beam.search import BeamSearch
from pagedserve.actors.core.admission import Admission
from pagedserve.actors.core.config import SchedulerConfig
from pagedserve.actors.core.inflight import InFlight, in_flight_depth
from pagedserve.actors.core.request import FINISH_REASONS, Request, RequestOutput, RequestStatus
from pagedserve.actors.core.request_queue import RunningRequests, make_request_queue
from pagedserve.actors.core.scheduler_stats import SchedulerStatsRecorder
from pagedserve.actors.core.step_planner import StepPlanner
from pagedserve.actors.errors import EngineDeadError
from pagedserve.actors.kv.event_publisher import KVEventPublisher
from pagedserve.actors.kv.kv_cache_manager import KVCacheManager
from pagedserve.actors.kv.transfer import KVTransfer
from pagedserve.actors.messages import (
    AbortAll,
    AbortRequest,
    AddRequest,
    ExecutorMessage,
    GetStats,
    GrammarReady,
    NotifyWhenIdle,
    ResetPrefixCache,
    SchedulerMessage,
)
from pagedserve.actors.spec_decode.proposer import num_accepted
from pagedserve.actors.stats import StatLogger, StatsSnapshot
from pagedserve.actors.structured_output.step import advance, grammar_bitmask
from pagedserve.gpu.batch import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from pagedserve.gpu.kv_connector.base import KVConnectorScheduler

if sys.version_info >= (3, 11):
    from typing import assert_never
else:  # Python 3.10
    from typing_extensions import assert_never

log = structlog.get_logger(__name__)


class Scheduler(Actor[SchedulerMessage]):
    name = "scheduler"

    def __init__(
        self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
        executor: Actor[ExecutorMessage],
        max_model_len: int, stat_loggers: list[StatLogger] | None = None,
        kv_connector: KVConnectorScheduler | None = None,
    ):
        super().__init__()
        self.config = config
        self.kv = kv_cache_manager
        self.executor = executor
        self.max_model_len = max_model_len
        self.waiting = make_request_queue(config.policy)
        self.running = RunningRequests()
        self.requests: dict[str, Request] = {}
        self.finished_req_ids: set[str] = set()  # ended since the last step; told to the runner
        self.idle_waiters: list[asyncio.Future[None]] = []  # NotifyWhenIdle replies not yet sent
        self.beams = BeamScheduler(kv_cache_manager, self.waiting, self.running, self.requests,
                                   self._finish)
        self.admission = Admission(self.requests, self.waiting, self.beams, kv_cache_manager,
                                   config.max_waiting_requests,
                                   lambda request_id: self.send(GrammarReady(request_id)),
                                   self._finish)
        self.waiting_for_grammar = self.admission.waiting_for_grammar  # parked, compiling
        self.planner = StepPlanner(config, kv_cache_manager, self.waiting, self.running,
                                   self._preempt, max_model_len, self.beams.is_beam)
        self.inflight = InFlight(config, kv_cache_manager, self.planner, self.requests, executor,
                                 *in_flight_depth(config, executor), max_model_len,
                                 lambda: bool(self.beams.groups), self.beams.is_beam)
        self.transfer = None if kv_connector is None else KVTransfer(  # actors/kv/transfer.py
            kv_connector, kv_cache_manager, self.waiting, self.requests, self.inflight.execute_step,
            self._finish)
        self.planner.transfer = self.transfer
        if self.transfer is not None and self.inflight.depth > 1:
            raise ValueError("--async-scheduling does not combine with --kv-transfer-config "
                             "(a transfer's empty steps run outside the flight): drop one")
        self.kv_events = KVEventPublisher(kv_cache_manager.block_pool)  # to the dp router
        # Counters, step records and the GetStats reply (actors/core/scheduler_stats.py); the
        # stat loggers (the server's metrics) see each step; the engine owns their list.
        self.recorder = SchedulerStatsRecorder(
            config, kv_cache_manager, self.waiting, self.running, self.waiting_for_grammar,
            self.requests, self.planner, self.inflight, self.beams, self.transfer,
            stat_loggers if stat_loggers is not None else [])

    # -- the loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            self.kv_events.flush(len(self.running), len(self.waiting))  # no sink: a no-op
            if not self.has_unfinished_requests() and not self.inflight:
                self._notify_idle()
                await self._wait()
            self._drain_mailbox()
            self.kv_events.flush(len(self.running), len(self.waiting))  # the new arrivals
            if self.has_unfinished_requests() and self.inflight.has_room():
                start = time.monotonic()
                scheduler_output = self.schedule()
                if scheduler_output.scheduled:  # with room left, the next step is built at once
                    self.inflight.send(scheduler_output, start)
                    continue
                self.finished_req_ids |= scheduler_output.finished_req_ids  # not told yet
                if not self.inflight:  # nothing fits now; wait for an abort or a new request
                    # (a KV transfer's loads, in the step's connector metadata, run meanwhile)
                    meta = scheduler_output.kv_connector_metadata
                    if meta is not None or not self.beams.release_parked():  # else parked
                        await self._wait(meta)  # beams gave blocks back: schedule again
                    continue
            if self.inflight:  # the oldest step's output (a failed one rerun request by request)
                step, runner_output = await self.inflight.land(self._fail_request)
                self.recorder.record_step(step.scheduler_output, runner_output, step.start)
                self.update_from_output(step.scheduler_output, runner_output)

    def _abort_all(self, msg: AbortAll) -> None:
        """End every request with ``msg.reason`` (an ``abort`` for its client), or only the
        waiting ones that have produced nothing (a beam search keeps its grace)."""
        if msg.unstarted_only:
            ended = [r for r in [*self.waiting, *self.waiting_for_grammar.values()]
                     if not r.output_token_ids and not self.beams.is_beam(r.request_id)]
        else:
            self.beams.abort_all(msg.reason)
            ended = list(self.requests.values())
        for request in ended:
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            request.output_queue.put_nowait(RequestOutput([], "abort", msg.reason))

    def _fail_request(self, request_id: str, e: Exception) -> None:
        """End one request (its whole search, for a beam) with ``e`` as its error: a 500 for
        its client; the others carry on."""
        request = self.requests.get(request_id)
        message = f"{type(e).__name__}: {e}"
        if request is not None and self.beams.is_beam(request_id):
            self.beams.fail(request, RequestStatus.FINISHED_ERROR, message)
        elif request is not None:
            self._finish(request, RequestStatus.FINISHED_ERROR)
            request.output_queue.put_nowait(RequestOutput([], "error", message))

    def on_crash(self, error: EngineDeadError) -> None:
        """The loop died: every request still held (waiting, running, parked) gets ``error``
        at once, and whoever waits for idleness is told (the engine will never be idle)."""
        for request in list(self.requests.values()):
            request.status = RequestStatus.FINISHED_ERROR
            request.output_queue.put_nowait(RequestOutput([], "error", str(error)))
        self.requests.clear()
        for reply in self.idle_waiters:
            if not reply.done():
                reply.set_exception(error)
        self.idle_waiters.clear()

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or (self.transfer and self.transfer.parked))

    async def _wait(self, kv_connector_metadata: Any = None) -> None:
        """Handle the next message (an abort, a new request); with KV transfers in flight, or
        a step's connector metadata to run, return after those instead if no message comes."""
        msg = await (self.mailbox.get() if self.transfer is None
                     else self.transfer.receive(self.mailbox, kv_connector_metadata))
        if msg is not None:
            self._handle(msg)

    def _notify_idle(self) -> None:
        """Answer every ``NotifyWhenIdle``: nothing is running or waiting."""
        for reply in self.idle_waiters:
            if not reply.done():  # the asker may have given up (a drain's timeout)
                reply.set_result(None)
        self.idle_waiters.clear()

    def _drain_mailbox(self) -> None:
        while not self.mailbox.empty():
            self._handle(self.mailbox.get_nowait())

    def _handle(self, msg: SchedulerMessage) -> None:
        match msg:
            case AddRequest():
                self.admission.on_add(msg)
            case AbortRequest(request_id=request_id):
                self.abort_request(request_id)
            case GrammarReady(request_id=request_id):
                self.admission.grammar_ready(request_id)
            case AbortAll():
                self._abort_all(msg)
            case GetStats(reply=reply):
                if not reply.done():
                    reply.set_result(self.stats())
            case NotifyWhenIdle(reply=reply):
                self.idle_waiters.append(reply)  # answered at the top of the loop, once idle
            case ResetPrefixCache(reply=reply):
                if not reply.done():
                    reply.set_result(self.kv.reset_prefix_cache())
            case _:
                assert_never(msg)

    # -- requests in and out ----------------------------------------------------------------

    def add_request(self, request: Request, beam_search: BeamSearch | None = None) -> None:
        """Queue ``request`` (``Admission.add``: parked while its grammar compiles); with
        ``beam_search``, as the root of that search's beams."""
        self.admission.add(request, beam_search)

    def abort_request(self, request_id: str) -> None:
        if self.beams.abort(request_id):
            return
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, RequestStatus.FINISHED_ABORTED)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING_FOR_GRAMMAR:
            del self.waiting_for_grammar[request.request_id]
        elif request.status not in (RequestStatus.WAITING_FOR_BEAMS,  # parked: in no queue
                                    RequestStatus.WAITING_FOR_REMOTE_KVS):
            self.waiting.remove(request)
        if self.transfer is None or not self.transfer.finished(request):  # not held
            self.inflight.free(request)  # at once, or when no step in flight writes them
        request.status = status
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: drop the request's K/V, keep its tokens."""
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.recorder.num_preemptions += 1
        self.waiting.prepend(request)
        log.debug("preempted", request_id=request.request_id)

    # -- one step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """The step's batch (``StepPlanner.plan``), the ids that ended since the last step, and
        the grammar bitmask of the guided requests that sample in it."""
        scheduled = self.inflight.plan()
        for scheduled_request in scheduled:  # prefill chunks of requests that want prompt logprobs
            if scheduled_request.sampling_params.prompt_logprobs is not None:
                request = self.requests[scheduled_request.req_id]
                scheduled_request.prompt_logprobs = request.prompt_logprobs_wanted(
                    scheduled_request.num_computed_tokens, len(scheduled_request.token_ids))
        self.beams.prepare(scheduled)
        scheduler_output = SchedulerOutput(scheduled, self.finished_req_ids,
                                           blocks_to_copy=self.kv.take_blocks_to_copy())
        (scheduler_output.grammar_bitmask,
         scheduler_output.structured_output_request_ids) = grammar_bitmask(scheduled, self.requests)
        if self.transfer is not None:
            scheduler_output.kv_connector_metadata = self.transfer.step_metadata(scheduled)
        self.finished_req_ids = set()
        return scheduler_output

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> None:
        self.recorder.record_update(scheduler_output, runner_output)
        now = time.monotonic()
        drop = (self.transfer.update_from_output(scheduler_output, runner_output)
                if self.transfer is not None else ())
        for scheduled_request in scheduler_output.scheduled:
            req_id = scheduled_request.req_id
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING or req_id in drop:
                continue
            try:  # what one request's tokens raise fails that request, not the engine
                self._update_request(request, scheduled_request, runner_output, now)
            except Exception as e:
                log.exception("request_failed", request_id=req_id, where="update")
                self._fail_request(req_id, e)

    def _update_request(self, request: Request, scheduled_request: ScheduledRequest,
                        runner_output: ModelRunnerOutput, now: float) -> None:
        """Apply one running request's step: its computed tokens, its sampled tokens (to the
        beam search for a beam), its stop check, and its output to its queue."""
        if request.pooling_params is not None:
            self._update_pooling(request, scheduled_request, runner_output)
            return
        req_id = scheduled_request.req_id
        if req_id in runner_output.prompt_logprobs:
            request.add_prompt_logprobs(runner_output.prompt_logprobs[req_id])
        new = runner_output.sampled_token_ids.get(req_id)
        accepted = num_accepted(scheduled_request, new)  # drafts whose K/V is now valid
        request.num_computed_tokens += len(scheduled_request.token_ids) + accepted
        if scheduled_request.spec_token_ids:
            self.recorder.spec_decode.record(len(scheduled_request.spec_token_ids), accepted)
        if not new:
            return
        if request.first_token_time is None:
            request.first_token_time = now
        if self.beams.is_beam(req_id):
            self.beams.on_sampled(request, runner_output.logprobs[req_id][0])
            return
        status = None
        first = not request.output_token_ids
        logprobs = runner_output.logprobs.get(req_id)
        for i, token in enumerate(new):  # with drafts, a stop among them ends the output
            request.output_token_ids.append(token)
            status = advance(request, [token]) or self._check_stop(request)
            if status is not None:
                new = new[: i + 1]
                logprobs = logprobs[: i + 1] if logprobs is not None else None
                break
        self.kv.update_block_hashes(request)
        if status is not None:
            self._finish(request, status)
        output = RequestOutput(new, FINISH_REASONS.get(status), logprobs=logprobs)
        if first:
            output.num_cached_tokens = request.num_cached_tokens
            if request.sampling_params.prompt_logprobs is not None:
                output.prompt_logprobs = request.prompt_logprobs
        request.output_queue.put_nowait(output)

    def _update_pooling(self, request: Request, scheduled_request: ScheduledRequest,
                        runner_output: ModelRunnerOutput) -> None:
        """A pooling request's chunk: its tokens computed; after the last one (the runner
        pooled it), it ends with its vector: no decode follows (vLLM V1's pooling path)."""
        request.num_computed_tokens += len(scheduled_request.token_ids)
        pooled = runner_output.pooler_output.get(scheduled_request.req_id)
        if pooled is None:
            if scheduled_request.sample:  # the last chunk ran, yet no vector: it was not pooled
                self._fail_request(scheduled_request.req_id,
                                   RuntimeError("the model returned no pooled output"))
            return
        request.first_token_time = time.monotonic()
        self.recorder.num_pooling_finished_total += 1
        self._finish(request, RequestStatus.FINISHED_STOPPED)
        request.output_queue.put_nowait(RequestOutput(
            [], "stop", num_cached_tokens=request.num_cached_tokens, pooled=pooled))

    def _check_stop(self, request: Request) -> RequestStatus | None:
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if len(request.output_token_ids) >= params.min_tokens and (
            (not params.ignore_eos and last in request.eos_token_ids)
            or last in params.stop_token_ids
        ):
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and len(request.output_token_ids) >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # -- stats (the recorder's: actors/core/scheduler_stats.py) ------------------------------

    def stats(self) -> StatsSnapshot:
        """The ``GetStats`` reply."""
        return self.recorder.snapshot()

    @property
    def num_steps(self) -> int:
        return self.recorder.num_steps

    @property
    def num_preemptions(self) -> int:
        return self.recorder.num_preemptions

    @property
    def num_draft_tokens(self) -> int:
        return self.recorder.spec_decode.num_draft_tokens

    @property
    def num_accepted_tokens(self) -> int:
        return self.recorder.spec_decode.num_accepted_tokens
