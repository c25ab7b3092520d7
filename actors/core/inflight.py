"""Batches in flight: the scheduler builds step k+1 while the executor still runs step k.

Two uses of one mechanism (vLLM V1's async scheduling, ``vllm/v1/core/sched/async_scheduler.py``
and the engine core's batch queue for pipeline parallelism; read to learn only):

- ``--async-scheduling`` (one rank, ``depth`` 2): a request that samples in step k and can be
  scheduled ahead gets its next decode in step k+1 at once, with ``PREV_SAMPLED`` in place of
  the token step k will sample (one mid-prefill gets its next chunk); the runner puts the
  token in on its own thread (``gpu/prev_sampled.py``), so the executor's thread goes from
  step k to k+1 without waiting for the event loop. A request that ends at step k has its
  step-k+1 token dropped (the scheduler skips a finished request's output) and its blocks
  freed once k+1 is done.
- pipeline parallelism (``-pp N`` with ``--async-scheduling``, ``depth`` N): stage 1 computes
  batch k+1 while stage 2 computes batch k. A request is never in two batches in flight:
  each batch holds requests no other batch in flight holds ("lanes": about ``1/N`` of the
  requests each), so nothing is scheduled ahead of a token nobody has yet.

What cannot be scheduled ahead exactly waits for its step's output, then goes on as in the
synchronous loop: guided requests (the next bitmask needs the token), beams, prompt logprobs,
a request whose in-flight token surely ends it (``max_tokens``, ``max_model_len``). Speculative
decoding (drafts need the last token) and beam search in flight are not combined with it:
``--async-scheduling`` refuses speculative decoding at start, and a beam search running makes
the loop synchronous while it runs. Off by default, for both uses: on the shared development
machine neither was faster (``loadtest/RESULTS.md``).

The planner (``actors/core/step_planner.py``) plans around the requests in flight: it sees the
running list without them, so it never preempts one (the executor still writes its blocks),
and with their seats and tokens taken off its limits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from pagedserve.actors.actor import Actor
from pagedserve.actors.core.config import SchedulerConfig
from pagedserve.actors.core.request import Request, RequestStatus
from pagedserve.actors.core.request_queue import RunningRequests
from pagedserve.actors.core.step_planner import StepPlanner
from pagedserve.actors.errors import EngineDeadError
from pagedserve.actors.kv.kv_cache_manager import KVCacheManager
from pagedserve.actors.messages import ExecuteModel, ExecutorMessage
from pagedserve.gpu.batch import PREV_SAMPLED, ModelRunnerOutput, ScheduledRequest, SchedulerOutput

log = structlog.get_logger(__name__)

ASYNC_DEPTH = 2  # one step ahead: the step being built while the executor runs the other


@dataclass(slots=True)
class InFlightStep:
    """A step sent to the executor: its batch, the reply to come, when scheduling began
    (once landed: when the executor could begin it, after the step before it landed)."""

    scheduler_output: SchedulerOutput
    reply: asyncio.Future[ModelRunnerOutput]
    start: float


def in_flight_depth(config: SchedulerConfig, executor: object) -> tuple[int, bool]:
    """``(depth, schedule_ahead)`` under ``--async-scheduling``: the executor's
    ``pipeline_depth`` in lanes when it has stages (``-pp``), 2 with decodes ahead on an
    executor that fills ``PREV_SAMPLED`` (one rank); without the flag ``(1, False)``, the
    synchronous loop.

    Raises:
        ValueError: ``--async-scheduling`` with speculative decoding, or with ranks that are
            not pipeline stages (``-tp`` alone, or the ray backend).
    """
    if not config.async_scheduling:
        return 1, False
    if config.speculative is not None:
        raise ValueError("--async-scheduling does not combine with --speculative-config "
                         "(drafts need the last sampled token): drop one of them")
    depth = getattr(executor, "pipeline_depth", 1)
    if depth > 1:
        return depth, False
    if not getattr(executor, "fills_prev_sampled", False):
        raise ValueError("--async-scheduling runs on one rank, or with --pipeline-parallel-size"
                         " > 1 and the mp backend: drop the flag")
    return ASYNC_DEPTH, True


class InFlight:
    """The steps the executor has and has not answered, oldest first, and which requests they
    hold. The scheduler owns it and calls it from its own task only.

    Args:
        depth: steps in flight at most (1: the synchronous loop, untouched).
        schedule_ahead: put a request that samples in flight in the next step too.
        requests: the scheduler's live requests by id.
        executor: the executor actor (``ExecuteModel`` messages, answered in order).
        sync_only: when true, no step is built while another is in flight (beam search).
        is_beam: whether a request is a beam (``BeamScheduler.is_beam``): never run ahead.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, planner: StepPlanner,
                 requests: dict[str, Request], executor: Actor[ExecutorMessage], depth: int,
                 schedule_ahead: bool, max_model_len: int, sync_only: Callable[[], bool],
                 is_beam: Callable[[str], bool]):
        self.config = config
        self.executor = executor
        self.kv = kv
        self.planner = planner
        self.requests = requests
        self.depth = depth
        self.schedule_ahead = schedule_ahead
        self.max_model_len = max_model_len
        self.sync_only = sync_only
        self.is_beam = is_beam
        self.steps: deque[InFlightStep] = deque()
        self.busy: dict[str, int] = {}  # request id → steps in flight that hold it
        self.ahead: dict[str, int] = {}  # request id → its tokens in flight (not yet computed)
        self.deferred: dict[str, Request] = {}  # ended while in flight: free when it lands
        # /admin/stats: most steps sent and not answered at once; requests put in a step while
        # already in one (async scheduling's decodes ahead; always 0 under pp).
        self.max_batches_in_flight = 0
        self.last_landed = 0.0  # time.monotonic() of the last step's output
        self.num_scheduled_ahead_total = 0

    def __len__(self) -> int:
        return len(self.steps)

    def has_room(self) -> bool:
        """Whether a step may be built now."""
        if not self.steps:
            return True
        return len(self.steps) < self.depth and not self.sync_only()

    # -- planning ---------------------------------------------------------------------------

    def plan(self) -> list[ScheduledRequest]:
        """The next step's requests: the planner's own plan when nothing is in flight (and no
        lanes are kept), else the decodes ahead and a plan around the requests in flight."""
        if self.depth == 1 or (self.schedule_ahead and not self.steps) or self.sync_only():
            return self.planner.plan()
        budget = self.config.max_num_batched_tokens
        ahead = self._decodes_ahead(budget) if self.schedule_ahead and self.steps else []
        hidden = {self.requests[r] for r in self.busy if r in self.requests}
        seats = self.config.max_num_seqs - len(hidden)
        if not self.schedule_ahead:  # pipeline lanes: about 1/depth of the requests each
            total = len(self.planner.running) + len(self.planner.waiting)
            lane = math.ceil(total / self.depth)
            visible = [r for r in self.planner.running if r not in hidden][:lane]
            hidden |= {r for r in self.planner.running if r not in visible}
            seats = min(seats, lane)
        budget -= sum(scheduled_request.num_step_tokens for scheduled_request in ahead)
        if budget <= 0 or seats <= 0:
            return ahead
        return ahead + self._plan_around(hidden, budget, seats)

    def _decodes_ahead(self, budget: int) -> list[ScheduledRequest]:
        """What each request of the newest step in flight computes next, if it may be
        scheduled ahead (``_can_go_ahead``): after a sampled token, one decode with
        ``PREV_SAMPLED`` as its input; after a prefill chunk, the next chunk. One whose blocks
        are short waits for the output instead (nobody is preempted for it)."""
        out: list[ScheduledRequest] = []
        for scheduled_request in self.steps[-1].scheduler_output.scheduled:
            request = self.requests.get(scheduled_request.req_id)
            if budget <= 0:
                break
            if request is None or not self._can_go_ahead(request, scheduled_request):
                continue
            ahead = self.ahead.get(scheduled_request.req_id, 0)
            start = request.num_computed_tokens + ahead
            n = 1 if scheduled_request.sample else min(request.num_tokens - start, budget)
            if self.kv.allocate_slots(request, ahead + n) is None:
                continue
            out.append(ScheduledRequest(
                req_id=scheduled_request.req_id, num_computed_tokens=start,
                token_ids=([PREV_SAMPLED] if scheduled_request.sample
                           else request.all_token_ids[start:start + n]),
                block_ids=self.kv.get_block_ids(scheduled_request.req_id),
                sampling_params=request.sampling_params,
                sample=scheduled_request.sample or start + n == request.num_tokens,
                num_prompt_tokens=request.num_prompt_tokens,
                lora_request=request.lora_request,
            ))
            budget -= n
        return out

    def _can_go_ahead(self, request: Request, scheduled_request: ScheduledRequest) -> bool:
        """Whether ``request``'s next input is known without ``sr``'s output (the rest of its
        prompt, or only the token ``scheduled_request`` samples), and that token may not end it for
        sure
        (else its next decode would be wasted)."""
        params = request.sampling_params
        if (scheduled_request.spec_token_ids or request.status != RequestStatus.RUNNING
                or self.busy.get(scheduled_request.req_id, 0) != 1):
            return False
        if (request.structured_output is not None or self.is_beam(request.request_id)
                or params.prompt_logprobs is not None):
            return False
        if not scheduled_request.sample:
            return True
        num_output = len(request.output_token_ids) + 1  # with the token in flight
        if params.max_tokens is not None and num_output >= params.max_tokens:
            return False
        return request.num_tokens + 1 < self.max_model_len

    def _plan_around(self, hidden: set[Request], budget: int, seats: int,
                     ) -> list[ScheduledRequest]:
        """``StepPlanner.plan`` over the running requests not in ``hidden``, with ``budget``
        tokens and ``seats`` seats; its admissions and preemptions applied to the real list
        (hidden requests keep their places)."""
        planner = self.planner
        full, config = planner.running, planner.config
        view = RunningRequests()
        for request in full:
            if request not in hidden:
                view.append(request)
        planner.running = view
        planner.config = dataclasses.replace(config, max_num_batched_tokens=budget,
                                             max_num_seqs=seats)
        try:
            scheduled = planner.plan()
        finally:
            planner.running, planner.config = full, config
        for request in list(full):
            if request not in hidden and request not in view:
                full.remove(request)  # preempted
        for request in view:
            if request not in full:
                full.append(request)  # admitted
        return scheduled

    # -- sent and answered ------------------------------------------------------------------

    def execute(self, scheduled: list[ScheduledRequest], blocks_to_copy: list[tuple[int, int]],
                kv_connector_metadata: Any = None) -> asyncio.Future[ModelRunnerOutput]:
        """Send a step outside the flight (a rerun after a failure, a KV transfer's empty
        step); await the reply."""
        reply: asyncio.Future[ModelRunnerOutput] = asyncio.get_running_loop().create_future()
        scheduler_output = SchedulerOutput(scheduled, blocks_to_copy=blocks_to_copy,
                                           kv_connector_metadata=kv_connector_metadata)
        self.executor.send(ExecuteModel(scheduler_output, reply))
        return reply

    async def execute_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step outside the flight (a KV transfer's empty step); its reply."""
        return await self.execute(scheduler_output.scheduled, scheduler_output.blocks_to_copy,
                                  scheduler_output.kv_connector_metadata)

    async def _rerun_alone(self, scheduler_output: SchedulerOutput,
                           fail: Callable[[str, Exception], None]) -> ModelRunnerOutput:
        """After a failed step, rerun each request alone: only the one that fails by itself is
        failed (K/V writes are idempotent, so rerunning a request's slice is safe)."""
        merged = ModelRunnerOutput({}, {})
        for scheduled_request in scheduler_output.scheduled:
            try:  # copies are idempotent: each rerun may repeat them
                runner_output = await self.execute([scheduled_request],
                                                   scheduler_output.blocks_to_copy)
            except EngineDeadError:
                raise  # the executor is gone: no request can run, the engine is dead
            except Exception as e:
                log.exception("request_failed", request_id=scheduled_request.req_id)
                fail(scheduled_request.req_id, e)
                continue
            merged.sampled_token_ids.update(runner_output.sampled_token_ids)
            merged.logprobs.update(runner_output.logprobs)
            merged.prompt_logprobs.update(runner_output.prompt_logprobs)
            merged.pooler_output.update(runner_output.pooler_output)
            merged.add_transfers(runner_output)
        return merged

    def send(self, scheduler_output: SchedulerOutput, start: float) -> None:
        """Send ``scheduler_output`` to the executor: its requests are in flight until it is
        answered.

        Raises:
            RuntimeError: under pipeline parallelism, a request already in flight (a bug).
        """
        for scheduled_request in scheduler_output.scheduled:
            req_id = scheduled_request.req_id
            if req_id in self.busy:
                if not self.schedule_ahead:
                    raise RuntimeError(f"request {req_id!r} in two batches in flight")
                self.num_scheduled_ahead_total += 1
            self.busy[req_id] = self.busy.get(req_id, 0) + 1
            self.ahead[req_id] = self.ahead.get(req_id, 0) + len(scheduled_request.token_ids)
        reply: asyncio.Future[ModelRunnerOutput] = asyncio.get_running_loop().create_future()
        self.executor.send(ExecuteModel(scheduler_output, reply))
        self.steps.append(InFlightStep(scheduler_output, reply, start))
        self.max_batches_in_flight = max(self.max_batches_in_flight, len(self.steps))

    async def land(self, fail: Callable[[str, Exception], None],
                   ) -> tuple[InFlightStep, ModelRunnerOutput]:
        """Await the oldest step and take it out of flight. If it failed, the newer ones are
        waited for and their outputs dropped, then each of its requests reruns alone
        (``_rerun_alone``): one that fails by itself is failed with ``fail`` (the scheduler's)."""
        step = self.steps[0]
        try:
            runner_output = await step.reply
            # Its time is the executor's on it: from the step before it, if that ended later.
            step.start, self.last_landed = max(step.start, self.last_landed), time.monotonic()
        except Exception:
            log.exception("step_failed", num_reqs=len(step.scheduler_output.scheduled))
            await self._give_up_newer(step)
            self.landed(step)
            return step, await self._rerun_alone(step.scheduler_output, fail)
        self.landed(step)
        return step, runner_output

    def landed(self, step: InFlightStep) -> None:
        """``step`` is answered (or given up): its requests leave flight; those that ended
        meanwhile give their blocks back now. Call before applying its output, which counts
        its tokens as computed."""
        self.steps.remove(step)
        for scheduled_request in step.scheduler_output.scheduled:
            left = self.busy[scheduled_request.req_id] - 1
            if left:
                self.busy[scheduled_request.req_id] = left
                self.ahead[scheduled_request.req_id] -= len(scheduled_request.token_ids)
                continue
            del self.busy[scheduled_request.req_id], self.ahead[scheduled_request.req_id]
            request = self.deferred.pop(scheduled_request.req_id, None)
            if request is not None:
                self.kv.free(request)

    def free(self, request: Request) -> None:
        """Free ``request``'s blocks now, or once no step in flight writes them."""
        if request.request_id in self.busy:
            self.deferred[request.request_id] = request
        else:
            self.kv.free(request)

    async def _give_up_newer(self, step: InFlightStep) -> None:
        """After ``step`` failed: wait for every newer step and drop its output (the requests
        it advanced recompute from their last known state)."""
        for newer in [s for s in self.steps if s is not step]:
            try:
                await newer.reply
            except Exception:  # noqa: BLE001 - dropped either way
                pass
            self.landed(newer)
