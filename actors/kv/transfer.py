"""The scheduler's side of a KV connector: where a request's prompt blocks come from, which
requests wait for them, and which finished requests' blocks are kept for a consumer.

vLLM V1 spreads this through ``vllm/v1/core/sched/scheduler.py`` (``_update_waiting_for_remote_kv``,
``_connector_finished``, ``finished_recving_kv_req_ids``); here one object owns it, and the
scheduler and the step planner call it at a few points only when a connector is configured
(none: ``Scheduler.transfer is None`` and nothing here runs):

- **admission** (``lookup`` then ``admitted``): after the local prefix-cache hits, the
  connector says how many more prompt tokens it can load; the blocks for them are allocated
  with the step's (not indexed in the prefix cache until the load succeeded). A synchronous
  load (the shared-storage connector) happens in the same step before the forward pass, and
  the step computes only the rest of the prompt. An asynchronous one parks the request in
  ``WAITING_FOR_REMOTE_KVS`` until the worker half names it in ``finished_recving``.
- **each step** (``step_metadata``): the connector's loads and saves for the worker half.
- **each step's output** (``update_from_output``): parked requests whose loads landed go back
  to the head of the queue; a failed load is recomputed (``kv_load_failure_policy``
  ``recompute``: the request's computed tokens go back to its local hits and what it sampled
  in that step is dropped) or ends the request with an error (``fail``).
- **the end** (``finished``): the connector may keep a finished request's blocks for a
  consumer; they are freed when ``finished_sending`` names the request or after
  ``kv_hold_timeout_s`` (vLLM leaked them here when a consumer never came). A request aborted
  while its load is in flight keeps its blocks until the load lands (or the timeout), so no
  late write reaches a block someone else holds.

While blocks are held or loads are in flight and nothing else runs, ``receive`` polls the
connector every ``POLL_INTERVAL_S`` with an empty step, so the worker half can report.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog

from pagedserve.actors.core.request import Request, RequestOutput, RequestStatus
from pagedserve.actors.core.request_queue import FCFSRequestQueue, PriorityRequestQueue
from pagedserve.actors.kv.block_pool import KVCacheBlock
from pagedserve.actors.kv.kv_cache_manager import KVCacheManager
from pagedserve.actors.stats import KVTransferStats
from pagedserve.gpu.batch import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from pagedserve.gpu.kv_connector.base import (
    KVConnectorMetadata,
    KVConnectorScheduler,
    LoadFailurePolicy,
)

log = structlog.get_logger(__name__)

POLL_INTERVAL_S = 0.01  # an idle scheduler's empty steps while transfers are in flight


@dataclass(slots=True)
class Lookup:
    """Where a request about to be admitted finds its first tokens' K/V.

    Attributes:
        hits: local prefix-cache blocks (``KVCacheManager.get_computed_blocks``).
        num_local: tokens those hits hold.
        num_external: tokens after them that the connector loads.
        load_async: the load ends in a later step (the request is parked meanwhile).
        reloaded: back from a parked load; its blocks and computed tokens are already set.
    """

    hits: list[KVCacheBlock]
    num_local: int
    num_external: int = 0
    load_async: bool = False
    reloaded: bool = False

    @property
    def num_computed(self) -> int:
        return self.num_local + self.num_external


@dataclass(slots=True)
class HeldBlocks:
    """A finished request's blocks, kept for a consumer (or for a load still in flight)."""

    request: Request
    blocks: list[KVCacheBlock]
    deadline: float  # time.monotonic() past which they are freed anyway
    recving: bool  # kept because a load into them has not landed (aborted while parked)


class KVTransfer:
    """Args:
    connector: the scheduler half (``gpu/kv_connector/registry.make_scheduler_connector``).
    kv, waiting, requests: the scheduler's block manager, queue and live requests.
    execute: the scheduler's way to run a step (for the empty polling steps).
    finish: the scheduler's ``_finish`` (for a failed load under policy ``fail``).
    """

    def __init__(
        self, connector: KVConnectorScheduler, kv: KVCacheManager,
        waiting: FCFSRequestQueue | PriorityRequestQueue, requests: dict[str, Request],
        execute: Callable[[SchedulerOutput], Awaitable[ModelRunnerOutput]],
        finish: Callable[[Request, RequestStatus], None],
    ):
        self.connector = connector
        self.config = connector.config
        self.kv = kv
        self.waiting = waiting
        self.requests = requests
        self.execute = execute
        self.finish = finish
        self.parked: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KVS
        self.reloaded: dict[str, int] = {}  # back from a parked load: its loaded tokens
        self.no_external: set[str] = set()  # a load failed: recomputed, never asked again
        self.loading: dict[str, int] = {}  # tokens loaded at admission, until confirmed
        self.held: dict[str, HeldBlocks] = {}
        self.stats = KVTransferStats(self.config.kv_connector, self.config.kv_role.value)

    # -- admission ---------------------------------------------------------------------------

    def lookup(self, request: Request) -> Lookup:
        """Local hits, then the connector's tokens after them (whole blocks, at least one
        prompt token left to compute: its logits give the first sampled token)."""
        rid = request.request_id
        if rid in self.reloaded:  # it holds its blocks already: only the rest is allocated
            return Lookup([], request.num_cached_tokens, self.reloaded[rid], reloaded=True)
        hits, num_local = self.kv.get_computed_blocks(request)
        if request.skip_reading_prefix_cache or rid in self.no_external:
            return Lookup(hits, num_local)
        n, load_async = self.connector.get_num_new_matched_tokens(request, num_local)
        bs = self.kv.block_size
        limit = (request.num_tokens - 1) // bs * bs - num_local
        n = max(0, min(n, limit)) // bs * bs
        return Lookup(hits, num_local, n, load_async and n > 0)

    def admitted(self, request: Request, lookup: Lookup) -> bool:
        """The request's blocks are allocated: tell the connector. Returns ``True`` when the
        request is parked (its load is asynchronous) instead of running this step."""
        rid = request.request_id
        if lookup.reloaded:
            del self.reloaded[rid]
            return False
        self.connector.update_state_after_alloc(request, self.kv.get_block_ids(rid),
                                                lookup.num_external)
        if not lookup.num_external:
            return False
        self.loading[rid] = lookup.num_external
        if not lookup.load_async:
            return False
        request.num_cached_tokens = lookup.num_local
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.parked[rid] = request
        return True

    # -- each step ---------------------------------------------------------------------------

    def step_metadata(self, scheduled: list[ScheduledRequest]) -> KVConnectorMetadata | None:
        """Free expired holds, show the connector the batch, and take its metadata."""
        self.expire(time.monotonic())
        self.connector.on_step_scheduled(scheduled)
        return self.connector.build_connector_meta()

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> set[str]:
        """Apply the worker half's reports. Returns the ids whose step output must be dropped
        (their load failed: what they computed and sampled rests on K/V that is not there)."""
        for scheduled_request in scheduler_output.scheduled:
            start = scheduled_request.num_computed_tokens
            end = start + len(scheduled_request.token_ids)
            self.stats.num_computed_prompt_tokens_total += max(
                0, min(end, scheduled_request.num_prompt_tokens) - start)
        drop: set[str] = set()
        for rid in runner_output.failed_recving:
            if self._load_failed(rid):
                drop.add(rid)
        for rid in runner_output.finished_recving:
            self._load_landed(rid)
        for rid in runner_output.finished_sending:
            held = self.held.get(rid)
            if held is not None and not held.recving:
                self._release(rid)
        for scheduled_request in scheduler_output.scheduled:  # a synchronous load that did
            req_id = scheduled_request.req_id                 # not fail landed
            if req_id not in drop and req_id not in self.parked:
                self._confirm(req_id)
        return drop

    def _confirm(self, rid: str) -> None:
        n = self.loading.pop(rid, 0)
        self.stats.num_loaded_prompt_tokens_total += n

    def _load_landed(self, rid: str) -> None:
        held = self.held.get(rid)
        if held is not None and held.recving:  # aborted while parked: now the blocks can go
            self._release(rid)
            return
        request = self.parked.pop(rid, None)
        if request is None:
            return
        self.reloaded[rid] = self.loading.get(rid, 0)
        # Its blocks hold the local hits too: the reload's allocation counts from there.
        request.num_computed_tokens = request.num_cached_tokens
        self._confirm(rid)
        request.status = RequestStatus.WAITING
        self.waiting.prepend(request)

    def _load_failed(self, rid: str) -> bool:
        """A load failed: recompute the request or fail it, by the policy. Returns whether the
        request was in this step (its output is then dropped)."""
        self.stats.num_failed_loads_total += 1
        self.loading.pop(rid, None)
        request = self.requests.get(rid)
        if request is None:  # ended meanwhile
            held = self.held.get(rid)
            if held is not None and held.recving:
                self._release(rid)
            return False
        policy = self.config.kv_load_failure_policy
        log.warning("kv_load_failed", request_id=rid, policy=policy.value)
        parked = self.parked.pop(rid, None) is not None
        if policy is LoadFailurePolicy.FAIL:
            self.finish(request, RequestStatus.FINISHED_ERROR)
            request.output_queue.put_nowait(RequestOutput(
                [], "error", f"KV transfer failed: the prompt's blocks could not be loaded by "
                f"{self.config.kv_connector} (kv_load_failure_policy 'fail')"))
            return not parked
        self.no_external.add(rid)
        if parked:  # never ran: start over, with no connector this time
            self.kv.free(request)
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            self.waiting.prepend(request)
            return False
        request.num_computed_tokens = request.num_cached_tokens  # back to the local hits
        return True

    # -- the end -----------------------------------------------------------------------------

    def finished(self, request: Request) -> bool:
        """The request ended (``Scheduler._finish``, before its blocks go). Returns ``True``
        when its blocks are kept here (freed later by a report or the timeout)."""
        rid = request.request_id
        self.reloaded.pop(rid, None)
        self.no_external.discard(rid)
        self.loading.pop(rid, None)
        deadline = time.monotonic() + self.config.kv_hold_timeout_s
        if self.parked.pop(rid, None) is not None:
            self.held[rid] = HeldBlocks(request, self.kv.detach(rid), deadline, recving=True)
            return True
        hold, params = self.connector.request_finished(request, self.kv.get_block_ids(rid))
        request.kv_transfer_params = params
        if not hold:
            return False
        self.held[rid] = HeldBlocks(request, self.kv.detach(rid), deadline, recving=False)
        return True

    def _release(self, rid: str) -> None:
        self.kv.free_blocks(self.held.pop(rid).blocks)

    def expire(self, now: float) -> None:
        """Free the holds whose consumer never confirmed within ``kv_hold_timeout_s``."""
        for rid in [rid for rid, h in self.held.items() if h.deadline <= now]:
            log.warning("kv_hold_timeout", request_id=rid, num_blocks=len(self.held[rid].blocks),
                        timeout_s=self.config.kv_hold_timeout_s)
            self.stats.num_hold_timeouts_total += 1
            self._release(rid)

    # -- while idle --------------------------------------------------------------------------

    @property
    def in_flight(self) -> bool:
        """Blocks held or loads parked: the worker half still has something to report."""
        return bool(self.held or self.parked)

    async def receive(self, mailbox: asyncio.Queue[Any],
                      metadata: KVConnectorMetadata | None = None) -> Any | None:
        """The scheduler's next message. ``metadata``: a step's that scheduled no request, run
        first in an empty step. While transfers are in flight, ``None`` after at most
        ``POLL_INTERVAL_S`` (and a polling step) when no message came: the scheduler then looks
        at its queues again. At most one empty step per interval, whatever the connector does."""
        if metadata is None and not self.in_flight:
            return await mailbox.get()
        if metadata is not None:
            await self._empty_step(metadata)
        deadline = min(h.deadline for h in self.held.values()) if self.held else float("inf")
        timeout = max(0.0, min(POLL_INTERVAL_S, deadline - time.monotonic()))
        get = asyncio.ensure_future(mailbox.get())
        done, _ = await asyncio.wait({get}, timeout=timeout)
        if get in done:
            return get.result()
        get.cancel()  # no message was taken: a cancelled Queue.get leaves the queue as it was
        if metadata is None:
            await self.poll()
        return None

    async def poll(self) -> None:
        """One empty step: the connector's pending work, and the worker half's reports."""
        await self._empty_step(self.step_metadata([]))

    async def _empty_step(self, metadata: KVConnectorMetadata | None) -> None:
        scheduler_output = SchedulerOutput([], kv_connector_metadata=metadata)
        try:
            runner_output = await self.execute(scheduler_output)
        except Exception:
            log.exception("kv_transfer_poll_failed")
            return
        self.update_from_output(scheduler_output, runner_output)

    def snapshot(self) -> KVTransferStats:
        s = self.stats
        s.num_waiting_for_remote_kvs = len(self.parked)
        s.num_held_requests = len(self.held)
        s.num_held_blocks = sum(len(h.blocks) for h in self.held.values())
        return KVTransferStats(**{k: getattr(s, k) for k in KVTransferStats.__slots__})
