"""The scheduler's stats: its counters, each step's record for the stat loggers, and the
``GetStats`` reply.

One object the scheduler owns (``Scheduler.recorder``), given at its start the parts whose
state the snapshot reads, so the scheduler's loop reads in one file without its bookkeeping.
It runs in the scheduler's task, like everything the scheduler holds.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable

from pagedserve.actors.beam.group import BeamScheduler
from pagedserve.actors.core.config import SchedulerConfig
from pagedserve.actors.core.inflight import InFlight
from pagedserve.actors.core.request import Request
from pagedserve.actors.core.request_queue import RequestQueue, RunningRequests
from pagedserve.actors.core.step_planner import StepPlanner
from pagedserve.actors.kv.kv_cache_manager import KVCacheManager
from pagedserve.actors.kv.transfer import KVTransfer
from pagedserve.actors.stats import (
    KVCacheStats,
    RequestStats,
    SchedulerStats,
    SpecDecodeStats,
    StatLogger,
    StatsSnapshot,
    StepHistory,
    StepStats,
)
from pagedserve.gpu.batch import ModelRunnerOutput, SchedulerOutput


class SchedulerStatsRecorder:
    """Counts what the scheduler does and answers ``GetStats``.

    Args:
        stat_loggers: observers of each step (the server's metrics); the engine owns the list.
        The others: the scheduler's own parts, read (never changed) for the snapshot.
    """

    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, waiting: RequestQueue,
        running: RunningRequests, waiting_for_grammar: dict[str, Request],
        requests: dict[str, Request], planner: StepPlanner, inflight: InFlight,
        beams: BeamScheduler, transfer: KVTransfer | None, stat_loggers: list[StatLogger],
    ):
        self.config = config
        self.kv = kv
        self.waiting = waiting
        self.running = running
        self.waiting_for_grammar = waiting_for_grammar
        self.requests = requests
        self.planner = planner
        self.inflight = inflight
        self.beams = beams
        self.transfer = transfer
        self.stat_loggers = stat_loggers
        self.step_history = StepHistory()
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_computed_tokens_total = 0  # tokens run through the model (prefill + decode)
        self.num_pooling_finished_total = 0  # pooling requests ended with their vector
        self.spec_decode = SpecDecodeStats()  # speculative decoding's totals

    def record_step(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
                    start: float) -> None:
        """Keep the step for the admin view and hand it to the stat loggers. Runs before
        ``update_from_output``, while every scheduled request is still known."""
        now = time.monotonic()
        prefill = decode = 0
        queue_times: list[float] = []
        for scheduled in scheduler_output.scheduled:
            request = self.requests.get(scheduled.req_id)
            n = len(scheduled.token_ids)
            prompt_len = request.num_prompt_tokens if request is not None else 0
            if n == 1 and scheduled.num_computed_tokens >= prompt_len > 0:  # a sampled token
                decode += 1
            else:
                prefill += n
            if request is not None and request.scheduled_time is None:
                request.scheduled_time = start
                queue_times.append(start - request.arrival_time)
        generated = sum(len(t) for t in runner_output.sampled_token_ids.values())
        step = StepStats(now, len(scheduler_output.scheduled), prefill, decode, generated,
                         now - start, queue_times)
        self.step_history.append(step)
        for logger in self.stat_loggers:
            logger.record_step(step)

    def record_update(self, scheduler_output: SchedulerOutput,
                      runner_output: ModelRunnerOutput) -> None:
        """A step's output is being applied: count the step, its tokens and its draft times."""
        self.num_steps += 1
        self.spec_decode.draft_seconds += runner_output.draft_seconds
        self.spec_decode.verify_seconds += runner_output.verify_seconds
        self.num_computed_tokens_total += scheduler_output.total_num_scheduled_tokens

    def snapshot(self) -> StatsSnapshot:
        """The ``GetStats`` reply, built in the actor's own task from plain values."""
        now = time.monotonic()
        return StatsSnapshot(self._scheduler_stats(now), self._kv_cache_stats(),
                             list(self.step_history.recent), self.step_history.throughput(now))

    def _scheduler_stats(self, now: float) -> SchedulerStats:
        running, waiting = self.running, self.waiting
        rows = [RequestStats.of(r, self.kv.num_resident_blocks(r.request_id), now)
                for r in (*running, *waiting)]
        spec = self.planner.spec
        return SchedulerStats(
            num_running=len(running), num_waiting=len(waiting),
            num_waiting_for_grammar=len(self.waiting_for_grammar),
            num_preemptions_total=self.num_preemptions,
            num_draft_tokens=self.spec_decode.num_draft_tokens,
            num_accepted_tokens=self.spec_decode.num_accepted_tokens,
            num_steps_total=self.num_steps,
            num_computed_tokens_total=self.num_computed_tokens_total,
            policy=self.config.policy, requests=rows,
            num_beam_forks_total=self.beams.num_forks_total,
            spec_decode=self.spec_decode.copy(spec.seconds if spec is not None else 0.0),
            max_batches_in_flight=self.inflight.max_batches_in_flight,
            num_scheduled_ahead_total=self.inflight.num_scheduled_ahead_total,
            kv_transfer=self.transfer.snapshot() if self.transfer is not None else None,
            running_lora_adapters=_adapters(running),
            waiting_lora_adapters=_adapters(waiting),
            max_lora=self.config.max_loras,
            num_pooling_running=sum(r.pooling_params is not None for r in running),
            num_pooling_waiting=sum(r.pooling_params is not None for r in waiting),
            num_pooling_finished_total=self.num_pooling_finished_total,
        )

    def _kv_cache_stats(self) -> KVCacheStats:
        kv, pool = self.kv, self.kv.block_pool
        return KVCacheStats(
            block_size=kv.block_size, num_blocks=pool.num_blocks,
            num_free_blocks=pool.get_num_free_blocks(),
            num_cached_blocks=kv.num_cached_blocks, usage=pool.get_usage(),
            num_shared_blocks=kv.num_shared_blocks,
            num_copied_blocks_total=kv.num_copied_blocks_total,
            sliding_window=kv.window.sliding_window if kv.window else None,
            num_released_blocks_total=kv.window.num_released_total if kv.window else 0,
            max_blocks_in_use=pool.max_blocks_in_use,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
        )


def _adapters(requests: Iterable[Request]) -> dict[str, int]:
    """Requests per LoRA adapter name among ``requests``."""
    return dict(Counter(r.lora_request.lora_name for r in requests
                        if r.lora_request is not None))
