"""Beam search inside the scheduler: beams are sibling requests that share KV blocks.

The PagedAttention paper's showcase (Kwon et al., 2023, section 4.4), on vLLM V1's unified
scheduling: a beam search starts as one request (the root). Each round every live beam
samples once, in an ordinary step, with its top logprobs; the beam that sampled parks
(``WAITING_FOR_BEAMS``) until its siblings have too (they may be in another step: a chunked
recompute after preemption). Then ``BeamSearch.step`` (``actors/beam/search.py``) picks the next
``beam_width`` beams, and here:

- a parent with one child goes on as that child (its request appends the token);
- a parent with more children **forks** a request per extra child: the child's block table is
  the parent's, shared by reference count (``KVCacheManager.fork``); only the last partial
  block, which both are about to write, is copied, by whichever writes first (copy-on-write in
  ``allocate_slots``; the runner copies the K/V in ``gpu/kv_cache.copy_blocks``);
- a parent with no child is retired: its blocks' ref counts drop, and only the blocks no other
  beam shares go back to the pool.

Beams share the prompt's blocks and every common full block for their whole lives, and the
stats' ``num_shared_blocks`` shows it. When the search ends, every beam is finished and the root
request's queue gets one ``BeamSearchOutput``.

Out of blocks: a running beam is preempted like any request (recompute; it samples again when
it is back). When nothing at all can be scheduled, the parked beams' blocks are what the head
of the queue is waiting for: ``release_parked`` frees them (their results are kept), and a beam
without K/V goes on through the waiting queue, its full blocks usually still prefix-cached. So
a pool that holds one sequence of ``max_model_len`` always finishes a search, slowly if it
cannot hold all its beams at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedserve.actors.actor import Actor
from pagedserve.actors.beam.search import Beam, BeamSearch, BeamSearchOutput
from pagedserve.actors.core.request import Request, RequestOutput, RequestStatus
from pagedserve.actors.core.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    RunningRequests,
)
from pagedserve.actors.engine.request_stream import RequestMetrics
from pagedserve.actors.errors import EngineError, EngineShuttingDown
from pagedserve.actors.kv.kv_cache_manager import KVCacheManager
from pagedserve.actors.messages import AbortRequest, SchedulerMessage
from pagedserve.gpu.batch import ScheduledRequest
from pagedserve.gpu.sample.sampler import TokenLogprobs


@dataclass(slots=True)
class BeamGroup:
    """One beam search in flight: its live beams' requests, in the order the last round ranked
    them, and what each reported this round."""

    request_id: str  # the root's, which the client knows (aborts name it)
    search: BeamSearch
    output_queue: asyncio.Queue[Any]
    beams: dict[str, Beam] = field(default_factory=dict)
    requests: dict[str, Request] = field(default_factory=dict)
    pending: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    num_forks: int = 0


class BeamScheduler:
    """The scheduler's beam-search part. It owns nothing the scheduler does not: it adds beams
    to the scheduler's ``running`` list and ``requests`` map and ends them with its ``finish``.

    Args:
        finish: the scheduler's ``_finish`` (frees a request's blocks, forgets it).
    """

    def __init__(self, kv: KVCacheManager, waiting: FCFSRequestQueue | PriorityRequestQueue,
                 running: RunningRequests, requests: dict[str, Request],
                 finish: Callable[[Request, RequestStatus], None]):
        self.kv = kv
        self.waiting = waiting
        self.running = running
        self.requests = requests
        self.finish = finish
        self.groups: dict[str, BeamGroup] = {}  # by the root's request id
        self.group_of: dict[str, BeamGroup] = {}  # every live beam's request id → its search
        self.unseen_prefix: set[str] = set()  # forked beams the runner has not met yet
        self.num_forks_total = 0
        self.num_released_total = 0  # parked beams whose blocks were freed (release_parked)

    def is_beam(self, request_id: str) -> bool:
        """Whether the request is a beam of a live search (it then samples by the search's
        rules: one token per round, never speculated, never scheduled ahead)."""
        return request_id in self.group_of

    def add(self, root: Request, search: BeamSearch) -> None:
        """Register the root request of a new beam search (the scheduler queues it)."""
        group = BeamGroup(root.request_id, search, root.output_queue)
        group.beams[root.request_id] = Beam(root.request_id, root.output_token_ids, 0.0)
        group.requests[root.request_id] = root
        self.group_of[root.request_id] = group
        self.groups[root.request_id] = group

    def on_sampled(self, request: Request, logprobs: TokenLogprobs) -> None:
        """A beam sampled: park it with its top logprobs; the last of a round advances it."""
        group = self.group_of[request.request_id]
        self.running.remove(request)
        request.status = RequestStatus.WAITING_FOR_BEAMS
        group.pending[request.request_id] = list(zip(logprobs.top_ids, logprobs.top_logprobs))
        if len(group.pending) == len(group.beams):
            self._advance(group)

    def _advance(self, group: BeamGroup) -> None:
        conts = group.search.step(list(group.beams.values()), group.pending)
        group.pending = {}
        if not conts:
            self._complete(group)
            return
        # Which request carries each continuation: a parent's first child is the parent
        # itself, the others are forked now, before the parent appends its own token.
        carriers: list[str] = []
        continuing: set[str] = set()
        for c in conts:
            if c.parent in continuing:
                carriers.append(self._fork(group, group.requests[c.parent], c.token_id))
            else:
                continuing.add(c.parent)
                carriers.append(c.parent)
        for rid in [r for r in group.requests if r not in continuing and r not in carriers]:
            self._retire(group, group.requests[rid], RequestStatus.FINISHED_STOPPED)
        for c, rid in zip(conts, carriers):
            if rid == c.parent:
                parent = group.requests[rid]
                parent.output_token_ids.append(c.token_id)
                self.kv.update_block_hashes(parent)
                self._resume(parent)
        # The next round's beams, in the search's ranking (it breaks ties by that order).
        group.beams = {rid: Beam(rid, group.requests[rid].output_token_ids, c.cum_logprob)
                       for c, rid in zip(conts, carriers)}

    def _fork(self, group: BeamGroup, parent: Request, token: int) -> str:
        """A new beam: ``parent``'s tokens plus ``token``, on ``parent``'s blocks (shared)."""
        group.num_forks += 1
        self.num_forks_total += 1
        child = Request(
            f"{group.request_id}-beam{group.num_forks}", parent.prompt_token_ids,
            parent.sampling_params, parent.output_queue, eos_token_ids=parent.eos_token_ids,
            priority=parent.priority, cache_salt=parent.cache_salt,
            arrival_time=parent.arrival_time,
            output_token_ids=[*parent.output_token_ids, token],
            num_computed_tokens=parent.num_computed_tokens, status=RequestStatus.RUNNING,
            num_cached_tokens=parent.num_cached_tokens, first_token_time=parent.first_token_time,
            block_hashes=list(parent.block_hashes), scheduled_time=parent.scheduled_time,
        )
        self.group_of[child.request_id] = group
        self.kv.fork(parent, child)
        self.kv.update_block_hashes(child)
        self.requests[child.request_id] = child
        group.requests[child.request_id] = child
        self.unseen_prefix.add(child.request_id)
        self._resume(child)
        return child.request_id

    def _resume(self, request: Request) -> None:
        """Back to ``running`` with its new token to decode, or, without its K/V (released),
        to the front of the waiting queue to be recomputed."""
        if request.num_computed_tokens == request.num_tokens - 1:
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        else:
            request.status = RequestStatus.PREEMPTED
            self.waiting.prepend(request)

    def release_parked(self) -> bool:
        """Free the blocks of every parked beam (its sampled result stays pending); for a step
        that could schedule nothing. ``True`` if any block was freed."""
        released = False
        for group in self.groups.values():
            for rid in group.pending:
                request = group.requests[rid]
                if request.num_computed_tokens:
                    self.kv.free(request)
                    request.num_computed_tokens = 0
                    request.num_preemptions += 1
                    self.num_released_total += 1
                    released = True
        return released

    def _retire(self, group: BeamGroup, request: Request, status: RequestStatus) -> None:
        del group.requests[request.request_id]
        del self.group_of[request.request_id]
        self.unseen_prefix.discard(request.request_id)
        self.finish(request, status)

    def _end(self, group: BeamGroup, status: RequestStatus) -> None:
        for request in list(group.requests.values()):
            self._retire(group, request, status)
        del self.groups[group.request_id]

    def _complete(self, group: BeamGroup) -> None:
        self._end(group, RequestStatus.FINISHED_STOPPED)
        hyps = group.search.results()
        group.output_queue.put_nowait(
            BeamSearchOutput(hyps, [group.search.finish_reason(h) for h in hyps]))

    def prepare(self, scheduled: list[ScheduledRequest]) -> None:
        """Tell the runner the tokens of forked beams it meets for the first time."""
        if not self.unseen_prefix:
            return
        for scheduled_request in scheduled:
            req_id, computed = scheduled_request.req_id, scheduled_request.num_computed_tokens
            if req_id in self.unseen_prefix:
                self.unseen_prefix.discard(req_id)
                if scheduled_request.prefix_token_ids is None and computed:
                    tokens = self.requests[req_id].all_token_ids
                    scheduled_request.prefix_token_ids = tokens[:computed]

    # -- ends that are not the search's own -----------------------------------------------

    def abort(self, request_id: str) -> bool:
        """The client went away: end every beam. ``False`` if ``request_id`` is no search."""
        group = self.groups.get(request_id)
        if group is None:
            return False
        self._end(group, RequestStatus.FINISHED_ABORTED)
        return True

    def fail(self, request: Request, status: RequestStatus, message: str | None) -> None:
        """A beam failed (``FINISHED_ERROR``) or the server ends it (``FINISHED_ABORTED``):
        end its whole search and tell the client."""
        group = self.group_of.get(request.request_id)
        if group is None or group.request_id not in self.groups:
            return
        self._end(group, status)
        reason = "error" if status == RequestStatus.FINISHED_ERROR else "abort"
        group.output_queue.put_nowait(RequestOutput([], reason, message))

    def abort_all(self, reason: str) -> None:
        for group in list(self.groups.values()):
            self.fail(next(iter(group.requests.values())), RequestStatus.FINISHED_ABORTED,
                      reason)


class BeamSearchStream:
    """The request task's side of a beam search: ``await result()`` once; ``close()`` before
    the end aborts the search (its beams' blocks are freed before the next step)."""

    __slots__ = ("request_id", "_scheduler", "_request", "_metrics", "_done")

    def __init__(self, scheduler: Actor[SchedulerMessage], request: Request,
                 metrics: RequestMetrics):
        self.request_id = request.request_id
        self._scheduler = scheduler
        self._request = request
        self._metrics = metrics  # the search reports as one request, once it ends
        self._done = False

    async def result(self) -> BeamSearchOutput:
        """The best hypotheses. Raises ``EngineShuttingDown`` / ``EngineError``."""
        try:
            request_output = await self._request.output_queue.get()
        except BaseException:
            self.close()
            raise
        self._done = True
        if isinstance(request_output, RequestOutput):
            self._metrics.finished(self._request, request_output.finish_reason)
            if request_output.finish_reason == "abort":
                raise EngineShuttingDown(request_output.error or "request aborted by the server")
            raise EngineError(request_output.error or "request failed")
        num_tokens = sum(len(h.token_ids) for h in request_output.hypotheses)
        self._metrics.tokens(self._request, num_tokens)
        self._metrics.finished(self._request, request_output.finish_reasons[0])
        return request_output

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._scheduler.send(AbortRequest(self.request_id))
            self._metrics.finished(self._request, None)

    def __del__(self) -> None:
        self.close()
