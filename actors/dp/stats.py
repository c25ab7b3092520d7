"""The stats of a data-parallel group: each engine's ``EngineStats`` and their totals, typed as
one engine's are (``actors/stats.py``), so every consumer of one engine's stats reads the
totals unchanged and the per-engine part is an addition.

Totals: counts and token totals add up; ``usage`` is held blocks over all blocks of all
engines; the prefix-cache hit rate follows from the summed queries and hits (a hit on engine
1 of a prefix that engine 0 holds is a miss, which is the point of routing by prefix); the
recent steps are all engines' merged by time; rates add up.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from pagedserve.actors.stats import (
    EngineStats,
    KVCacheStats,
    SchedulerStats,
    SpecDecodeStats,
    StepStats,
    Throughput,
)

MAX_STEPS = 100  # recent steps kept in the totals, as one engine's ``StepHistory`` keeps


@dataclass(slots=True)
class EngineRouting:
    """One engine as the router sees it (``DPRouter.engines``), for the operators."""

    index: int
    num_routed: int
    num_cached_hashes: int
    load: int
    failed: str | None


@dataclass(slots=True)
class DataParallelStats(EngineStats):
    """``DataParallelEngine.get_stats``: the totals in the inherited fields, and per engine.

    Attributes:
        engines: each engine's stats by index; ``None`` for a failed engine.
        routing: each engine as the router sees it.
        policy: the routing policy.
    """

    engines: list[EngineStats | None] = field(default_factory=list)
    routing: list[EngineRouting] = field(default_factory=list)
    policy: str = "prefix"


def total_stats(engines: list[EngineStats | None], routing: list[EngineRouting],
                policy: str, time_now: float) -> DataParallelStats:
    """The group's stats from its live engines' (at least one)."""
    live = [s for s in engines if s is not None]
    if not live:
        raise ValueError("no live engine to take stats from")
    first = live[0]
    config = dict(first.config)
    config["data_parallel"] = {"size": len(engines), "routing": policy}
    return DataParallelStats(
        _scheduler([s.scheduler for s in live]), _kv_cache([s.kv_cache for s in live]),
        _recent_steps([s.steps for s in live]),
        Throughput(first.throughput.window_s,
                   sum(s.throughput.prompt_tokens_per_s for s in live),
                   sum(s.throughput.generation_tokens_per_s for s in live)),
        first.model, config, time_now, engines=engines, routing=routing, policy=policy)


def _step_time(step: StepStats) -> float:
    return step.time


def _recent_steps(per_engine: list[list[StepStats]]) -> list[StepStats]:
    return list(heapq.merge(*per_engine, key=_step_time))[-MAX_STEPS:]


def _scheduler(parts: list[SchedulerStats]) -> SchedulerStats:
    spec = SpecDecodeStats()
    for p in parts:
        sd = p.spec_decode
        spec.num_drafts += sd.num_drafts
        spec.num_draft_tokens += sd.num_draft_tokens
        spec.num_accepted_tokens += sd.num_accepted_tokens
        spec.draft_seconds += sd.draft_seconds
        spec.verify_seconds += sd.verify_seconds
        for name in ("drafted_per_pos", "accepted_per_pos"):
            mine, theirs = getattr(spec, name), getattr(sd, name)
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, n in enumerate(theirs):
                mine[i] += n
    return SchedulerStats(
        num_running=sum(p.num_running for p in parts),
        num_waiting=sum(p.num_waiting for p in parts),
        num_waiting_for_grammar=sum(p.num_waiting_for_grammar for p in parts),
        num_preemptions_total=sum(p.num_preemptions_total for p in parts),
        num_draft_tokens=sum(p.num_draft_tokens for p in parts),
        num_accepted_tokens=sum(p.num_accepted_tokens for p in parts),
        num_steps_total=sum(p.num_steps_total for p in parts),
        num_computed_tokens_total=sum(p.num_computed_tokens_total for p in parts),
        policy=parts[0].policy,
        requests=[r for p in parts for r in p.requests],
        num_beam_forks_total=sum(p.num_beam_forks_total for p in parts),
        spec_decode=spec,
    )


def _kv_cache(parts: list[KVCacheStats]) -> KVCacheStats:
    num_blocks = sum(p.num_blocks for p in parts)
    num_free = sum(p.num_free_blocks for p in parts)
    return KVCacheStats(
        block_size=parts[0].block_size, num_blocks=num_blocks, num_free_blocks=num_free,
        num_cached_blocks=sum(p.num_cached_blocks for p in parts),
        usage=1.0 - num_free / num_blocks if num_blocks else 0.0,
        prefix_cache_queries=sum(p.prefix_cache_queries for p in parts),
        prefix_cache_hits=sum(p.prefix_cache_hits for p in parts),
        num_shared_blocks=sum(p.num_shared_blocks for p in parts),
        num_copied_blocks_total=sum(p.num_copied_blocks_total for p in parts),
        sliding_window=parts[0].sliding_window,
        num_released_blocks_total=sum(p.num_released_blocks_total for p in parts),
        max_blocks_in_use=sum(p.max_blocks_in_use for p in parts),
    )
