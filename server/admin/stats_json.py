"""The JSON of ``/admin/stats`` and ``/admin/events``: the engine's typed stats, turned into
the dict the dashboard (``static/admin.js``) and operators' scripts read.

This is the only place that knows the JSON keys, and the only place that rounds: the actors
hand over raw values (seconds, fractions) in ``actors/stats.py``'s dataclasses.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from pagedserve.actors.dp.stats import DataParallelStats, EngineRouting
from pagedserve.actors.stats import (
    EngineStats,
    KVCacheStats,
    RequestStats,
    SchedulerStats,
    SpecDecodeStats,
    StepStats,
    Throughput,
)


def stats_json(stats: EngineStats, model_name: str,
               serving: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole snapshot; ``model_name`` is what answers report as ``model``; ``serving``:
    the HTTP layer's settings (served names, tool-call parser), as given. A data-parallel
    group's (``DataParallelStats``) has the totals at the top, as one engine's, and adds
    ``data_parallel`` (size, routing policy) and ``engines``, one entry per engine."""
    out = _engine_json(stats, model_name)
    out["serving"] = serving or {}
    if isinstance(stats, DataParallelStats):
        out["data_parallel"] = {"size": len(stats.engines), "routing": stats.policy}
        out["engines"] = [engine_part_json(s, r)
                          for s, r in zip(stats.engines, stats.routing)]
    return out


def engine_part_json(stats: EngineStats | None, routing: EngineRouting) -> dict[str, Any]:
    """One engine of a group: its queues, KV cache and rates (``None`` once it failed), and
    what the router knows of it (requests sent, cached hashes, load, failure)."""
    return {
        "index": routing.index,
        "failed": routing.failed,
        "num_routed": routing.num_routed,
        "num_cached_hashes": routing.num_cached_hashes,
        "load": routing.load,
        "scheduler": None if stats is None else scheduler_json(stats.scheduler),
        "kv_cache": None if stats is None else kv_cache_json(stats.kv_cache),
        "throughput": None if stats is None else throughput_json(stats.throughput),
    }


def _engine_json(stats: EngineStats, model_name: str) -> dict[str, Any]:
    m = stats.model
    return {
        "scheduler": scheduler_json(stats.scheduler),
        "kv_cache": kv_cache_json(stats.kv_cache),
        "steps": [step_json(s) for s in stats.steps],
        "throughput": throughput_json(stats.throughput),
        "model": {"name": model_name, "path": m.path, "dtype": m.dtype, "device": m.device,
                  "quantization": m.quantization, "max_model_len": m.max_model_len,
                  "parallel": m.parallel_layout},  # per rank: layers, heads, vocab, pid
        "config": stats.config,
        "time": stats.time,
    }


def scheduler_json(s: SchedulerStats) -> dict[str, Any]:
    return {
        "num_waiting": s.num_waiting,
        "num_waiting_for_grammar": s.num_waiting_for_grammar,
        "num_running": s.num_running,
        "num_preempted_total": s.num_preemptions_total,
        "spec_decode_num_draft_tokens": s.num_draft_tokens,
        "spec_decode_num_accepted_tokens": s.num_accepted_tokens,
        "spec_decode": spec_decode_json(s.spec_decode),
        "num_steps_total": s.num_steps_total,
        "num_computed_tokens_total": s.num_computed_tokens_total,
        "policy": s.policy,
        "max_batches_in_flight": s.max_batches_in_flight,
        "num_scheduled_ahead_total": s.num_scheduled_ahead_total,
        "num_beam_forks_total": s.num_beam_forks_total,
        # Pooling requests (--runner pooling), counted apart (and within num_running/waiting).
        "num_pooling_running": s.num_pooling_running,
        "num_pooling_waiting": s.num_pooling_waiting,
        "num_pooling_finished_total": s.num_pooling_finished_total,
        # KV connector: prompt tokens loaded vs computed, parked and held (None without one).
        "kv_transfer": asdict(s.kv_transfer) if s.kv_transfer is not None else None,
        "requests": [request_json(r) for r in s.requests],
    }


def spec_decode_json(sd: SpecDecodeStats) -> dict[str, Any]:
    """Speculative decoding: counts, acceptance per draft position, mean tokens per verify,
    and the time spent drafting vs verifying."""
    return {
        "num_drafts": sd.num_drafts,
        "num_draft_tokens": sd.num_draft_tokens,
        "num_accepted_tokens": sd.num_accepted_tokens,
        "num_accepted_tokens_per_pos": list(sd.accepted_per_pos),
        "acceptance_rate_per_pos": [round(r, 6) for r in sd.acceptance_rate_per_pos],
        "mean_acceptance_length": round(sd.mean_acceptance_length, 6),
        "draft_time_s": round(sd.draft_seconds, 6),
        "verify_time_s": round(sd.verify_seconds, 6),
    }


def request_json(r: RequestStats) -> dict[str, Any]:
    return {
        "id": r.request_id,
        "state": r.state,
        "priority": r.priority,
        "prompt_tokens": r.num_prompt_tokens,
        "output_tokens": r.num_output_tokens,
        "num_computed_tokens": r.num_computed_tokens,
        "num_blocks": r.num_blocks,
        "cached_tokens": r.num_cached_tokens,
        "num_preemptions": r.num_preemptions,
        "age_s": round(r.age_s, 3),
        "ttft_s": None if r.ttft_s is None else round(r.ttft_s, 4),
        "kind": r.kind,
    }


def kv_cache_json(kv: KVCacheStats) -> dict[str, Any]:
    return {
        "block_size": kv.block_size,
        "num_blocks": kv.num_blocks,
        "num_free_blocks": kv.num_free_blocks,
        "num_cached_blocks": kv.num_cached_blocks,
        "usage": round(kv.usage, 6),
        "prefix_cache_queries": kv.prefix_cache_queries,
        "prefix_cache_hits": kv.prefix_cache_hits,
        "prefix_cache_hit_rate": round(kv.prefix_cache_hit_rate, 6),
        "num_shared_blocks": kv.num_shared_blocks,
        "num_copied_blocks_total": kv.num_copied_blocks_total,
        "sliding_window": kv.sliding_window,
        "num_released_blocks_total": kv.num_released_blocks_total,
        "max_blocks_in_use": kv.max_blocks_in_use,
    }


def step_json(s: StepStats) -> dict[str, Any]:
    return {"batch_size": s.batch_size, "prefill_tokens": s.num_prefill_tokens,
            "decode_tokens": s.num_decode_tokens, "duration_ms": round(s.duration_s * 1000, 3)}


def throughput_json(t: Throughput) -> dict[str, float]:
    return {"window_s": t.window_s,
            "prompt_tokens_per_s": round(t.prompt_tokens_per_s, 3),
            "generation_tokens_per_s": round(t.generation_tokens_per_s, 3)}
