"""Which requests compute how many tokens in one step: the scheduling decision itself.

vLLM V1's unified step (``vllm/v1/core/sched/scheduler.py``'s ``schedule``): no prefill phase
and decode phase, each request's ``num_computed_tokens`` catches up with its ``num_tokens``
under one token budget (``max_num_batched_tokens``) and a cap on running requests
(``max_num_seqs``). A step is two passes:

1. **Running requests**, in order: each gets its next prefill chunk or its decode, a decode
   also n-gram drafts when speculating (``actors/spec_decode/proposer.py``). When the blocks run
   out, the last running request (the latest admitted; under ``priority``, the worst) is preempted
   by recompute: its blocks go, its tokens stay, and it returns to the front of the waiting
   queue.
2. **Waiting requests**, in queue order, unless pass 1 preempted (then the blocks are short):
   each admitted after a prefix-cache lookup, the last one taking what budget is left
   (chunked prefill). The first that does not fit ends the pass: nobody overtakes the head.
   With LoRA, one whose adapter would be the ``max_loras + 1``-th among the running requests
   does not fit either: it waits (vLLM's ``max_loras`` bound on a step).

Under ``priority``, before both, a waiting request of strictly better priority takes the
place of the worst running one when the seats are full or the blocks are short.

The planner owns no request: it works on the scheduler's ``waiting`` queue and ``running``
list, and preempts through the scheduler's ``preempt`` (the one place a request's K/V goes).
"""

from __future__ import annotations

from collections.abc import Callable

from pagedserve.actors.core.config import SchedulerConfig
from pagedserve.actors.core.request import Request, RequestStatus
from pagedserve.actors.core.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    RunningRequests,
)
from pagedserve.actors.kv.kv_cache_manager import KVCacheManager
from pagedserve.actors.kv.transfer import KVTransfer, Lookup
from pagedserve.actors.spec_decode.proposer import make_proposer
from pagedserve.gpu.batch import ScheduledRequest


class StepPlanner:
    """Args:
    waiting, running: the scheduler's queue and list, shared (the planner admits into
        ``running`` and preempts out of it).
    preempt: the scheduler's recompute preemption of one request already out of ``running``.
    """

    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager,
        waiting: FCFSRequestQueue | PriorityRequestQueue, running: RunningRequests,
        preempt: Callable[[Request], None], max_model_len: int,
        is_beam: Callable[[str], bool],
    ):
        self.config = config
        self.kv = kv
        self.waiting = waiting
        self.running = running
        self.preempt = preempt
        spec = config.speculative
        self.spec = make_proposer(spec, max_model_len, is_beam) if spec is not None else None
        self.transfer: KVTransfer | None = None  # the scheduler's, with a KV connector

    def plan(self) -> list[ScheduledRequest]:
        """The step's batch: running requests first, then admissions with the budget left."""
        budget = self.config.max_num_batched_tokens
        if self.config.policy == "priority":
            self._apply_priority(budget)
        scheduled, preempted = self._schedule_running(budget)
        if not preempted:  # a step that had to preempt is short of blocks: admit nobody
            budget -= sum(scheduled_request.num_step_tokens for scheduled_request in scheduled)
            scheduled += self._schedule_waiting(budget)
        return scheduled

    def _schedule_running(self, budget: int) -> tuple[list[ScheduledRequest], list[Request]]:
        """Each running request in order gets its next prefill chunk or its decode (with
        drafts when speculating), preempting from the tail of ``running`` when blocks run out.
        Returns the scheduled requests and the ones preempted for them."""
        spec = self.spec if self.spec is not None and self.spec.enabled(len(self.running)) else None
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        for request in list(self.running):
            if budget <= 0 or request.status != RequestStatus.RUNNING:
                break  # out of budget, or preempted for the ones before it (and so the rest)
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            drafts = spec.propose(request, budget - n) if spec is not None and n == 1 else []
            if drafts and self.kv.allocate_slots(request, n + len(drafts)) is None:
                drafts = []  # no blocks for guesses: never preempt anyone for them
            if not drafts and not self._allocate_or_preempt(request, n, preempted):
                break  # it preempted itself: nothing after it is left running
            scheduled_request = self._scheduled(request, n)
            scheduled_request.spec_token_ids = drafts
            scheduled.append(scheduled_request)
            budget -= scheduled_request.num_step_tokens
        return scheduled, preempted

    def _allocate_or_preempt(self, request: Request, n: int, preempted: list[Request]) -> bool:
        """Take blocks for ``n`` more tokens of a running request, preempting the last running
        request (the latest admitted; under priority, the worst) until they fit. Victims are
        appended to ``preempted``; ``False`` when ``request`` itself had to go."""
        while self.kv.allocate_slots(request, n) is None:
            victim = self.running.pop()
            self.preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _schedule_waiting(self, budget: int) -> list[ScheduledRequest]:
        """Admit waiting requests in queue order while seats, budget and blocks last, the last
        one taking a partial chunk (chunked prefill). The first that does not fit stops the
        admissions: nobody overtakes the head of the queue."""
        scheduled: list[ScheduledRequest] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if not self._adapter_fits(request):
                break  # --max-loras adapters run: it waits for one of them to finish
            # Local prefix-cache hits, then (with a KV connector) the tokens it loads after them.
            look = (Lookup(*self.kv.get_computed_blocks(request)) if self.transfer is None
                    else self.transfer.lookup(request))
            n = 0 if look.load_async else min(request.num_tokens - look.num_computed, budget)
            whole = request.num_tokens - look.num_computed
            if not self.config.enable_chunked_prefill and n < whole:
                break  # the prompt runs whole or waits for a step with room for it
            if self.kv.allocate_slots(request, look.num_external + n, look.hits,
                                      delay_cache=look.num_external > 0) is None:
                break
            self.kv.record_lookup(request.num_tokens, look.num_local)
            self.waiting.pop()
            if self.transfer is not None and self.transfer.admitted(request, look):
                continue  # parked until its blocks are loaded (WAITING_FOR_REMOTE_KVS)
            request.num_computed_tokens = look.num_computed
            request.num_cached_tokens = look.num_local
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled_request = self._scheduled(request, n)
            if look.num_computed:  # the runner never saw the cached / loaded prefix's tokens
                scheduled_request.prefix_token_ids = request.all_token_ids[:look.num_computed]
            scheduled.append(scheduled_request)
            budget -= n
        return scheduled

    def _adapter_fits(self, request: Request) -> bool:
        """Whether admitting ``request`` keeps the running requests within ``max_loras``
        distinct adapters (every running request is in most steps: the step's bound too)."""
        lora = request.lora_int_id
        if lora is None:
            return True
        running = {r.lora_int_id for r in self.running if r.lora_int_id is not None}
        return lora in running or len(running) < self.config.max_loras

    def _apply_priority(self, budget: int) -> None:
        """Order ``running`` best first, so the victim of a preemption is always the last one;
        then a waiting request of strictly higher priority (lower value) than the worst running
        one takes its place when the batch is full or the blocks are short."""
        self.running.sort(key=lambda r: (r.priority, r.arrival_time))
        if not self.waiting:
            return
        head = self.waiting.peek()
        need = self.kv.num_blocks_needed(min(head.num_tokens, budget))
        while self.running and head.priority < self.running[-1].priority:
            seats_full = len(self.running) >= self.config.max_num_seqs
            blocks_short = need > self.kv.block_pool.get_num_free_blocks()
            if not (seats_full or blocks_short):
                return
            self.preempt(self.running.pop())

    def _scheduled(self, request: Request, n: int) -> ScheduledRequest:
        """``request``'s share of the step: ``n`` tokens from ``num_computed_tokens`` on."""
        start = request.num_computed_tokens
        if n == 1 and start == request.num_tokens - 1 and request.output_token_ids:
            token_ids = request.output_token_ids[-1:]  # a decode: skip building all_token_ids
        else:
            token_ids = request.all_token_ids[start : start + n]
        return ScheduledRequest(
            req_id=request.request_id,
            token_ids=token_ids,
            num_computed_tokens=start,
            block_ids=self.kv.get_block_ids(request.request_id),
            sampling_params=request.sampling_params,
            sample=start + n == request.num_tokens,
            num_prompt_tokens=request.num_prompt_tokens,
            lora_request=request.lora_request,
            pooling_params=request.pooling_params,
        )
