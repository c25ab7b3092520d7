"""The scheduler's stats: each step's record for the stat loggers, and the ``GetStats`` reply.

Apart from ``actors/core/scheduler.py`` so the loop reads in one file; both functions are the
scheduler's methods (``Scheduler._record_step``, ``Scheduler.stats``) and run in its task.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING

from pagedserve.actors.stats import (
    KVCacheStats,
    RequestStats,
    SchedulerStats,
    StatsSnapshot,
    StepStats,
)
from pagedserve.gpu.batch import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from pagedserve.actors.core.scheduler import Scheduler


def record_step(self: Scheduler, so: SchedulerOutput, out: ModelRunnerOutput, start: float) -> None:
    """Keep the step for the admin view and hand it to the stat loggers. Runs before
    ``update_from_output``, while every scheduled request is still known."""
    now = time.monotonic()
    prefill = decode = 0
    queue_times: list[float] = []
    for sr in so.scheduled:
        request = self.requests.get(sr.req_id)
        n = len(sr.token_ids)
        prompt_len = request.num_prompt_tokens if request is not None else 0
        if n == 1 and sr.num_computed_tokens >= prompt_len > 0:  # fed back a sampled token
            decode += 1
        else:
            prefill += n
        if request is not None and request.scheduled_time is None:
            request.scheduled_time = start
            queue_times.append(start - request.arrival_time)
    generated = sum(len(t) for t in out.sampled_token_ids.values())
    step = StepStats(now, len(so.scheduled), prefill, decode, generated, now - start,
                     queue_times)
    self.step_history.append(step)
    for logger in self.stat_loggers:
        logger.record_step(step)

def snapshot(self: Scheduler) -> StatsSnapshot:
    """The ``GetStats`` reply, built in the actor's own task from plain values."""
    now = time.monotonic()
    rows = [RequestStats.of(r, self.kv.num_resident_blocks(r.request_id), now)
            for r in (*self.running, *self.waiting)]
    sched = SchedulerStats(
        num_running=len(self.running), num_waiting=len(self.waiting),
        num_waiting_for_grammar=len(self.waiting_for_grammar),
        num_preemptions_total=self.num_preemptions,
        num_draft_tokens=self.num_draft_tokens,
        num_accepted_tokens=self.num_accepted_tokens,
        num_steps_total=self.num_steps,
        num_computed_tokens_total=self.num_computed_tokens_total,
        policy=self.config.policy, requests=rows,
        num_beam_forks_total=self.beams.num_forks_total,
        spec_decode=self.spec_decode.copy(
            self.planner.spec.seconds if self.planner.spec is not None else 0.0),
        max_batches_in_flight=self.inflight.max_batches_in_flight,
        num_scheduled_ahead_total=self.inflight.num_scheduled_ahead_total,
        kv_transfer=self.transfer.snapshot() if self.transfer is not None else None,
        running_lora_adapters=_adapters(self.running),
        waiting_lora_adapters=_adapters(self.waiting),
        max_lora=self.config.max_loras,
        num_pooling_running=sum(r.pooling_params is not None for r in self.running),
        num_pooling_waiting=sum(r.pooling_params is not None for r in self.waiting),
        num_pooling_finished_total=self.num_pooling_finished_total,
    )
    pool = self.kv.block_pool
    kv = KVCacheStats(
        block_size=self.kv.block_size, num_blocks=pool.num_blocks,
        num_free_blocks=pool.get_num_free_blocks(),
        num_cached_blocks=self.kv.num_cached_blocks, usage=pool.get_usage(),
        num_shared_blocks=self.kv.num_shared_blocks,
        num_copied_blocks_total=self.kv.num_copied_blocks_total,
        sliding_window=self.kv.window.sliding_window if self.kv.window else None,
        num_released_blocks_total=self.kv.window.num_released_total if self.kv.window else 0,
        max_blocks_in_use=pool.max_blocks_in_use,
        prefix_cache_queries=self.kv.prefix_cache_queries,
        prefix_cache_hits=self.kv.prefix_cache_hits,
    )
    return StatsSnapshot(sched, kv, list(self.step_history.recent),
                         self.step_history.throughput(now))


def _adapters(requests) -> dict[str, int]:
    """Requests per LoRA adapter name among ``requests``."""
    return dict(Counter(r.lora_request.lora_name for r in requests
                        if r.lora_request is not None))
