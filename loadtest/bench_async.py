"""Synchronous steps against batches in flight, in one process, modes alternating.

``--async-scheduling`` (``actors/core/inflight.py``) builds step k+1 while step k runs; this
measures what that buys: for each model, output tok/s and the wall time per step (wall time of
the run / steps the scheduler took) with 1 and with 8 concurrent greedy requests, sync and
async engines alternating round after round (the machine is shared: report the medians).
With ``--pp``, also a pipeline-parallel engine (``-pp 2``, the tiny model) against one rank,
two batches in flight (``--async-scheduling``) and one (``pp2-sync``, the default).

Usage: ``.venv/bin/python loadtest/bench_async.py [--rounds 5] [--output-tokens 64]
[--models tiny,smollm2] [--pp]``; prints one JSON line per measurement, then the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from pagedserve.actors.core.config import SchedulerConfig
from pagedserve.actors.engine.async_engine import AsyncEngine
from pagedserve.actors.engine.config import EngineConfig
from pagedserve.gpu import loader
from pagedserve.gpu.config import CacheConfig, ModelConfig, ParallelConfig
from pagedserve.gpu.sample.sampling_params import SamplingParams

PROMPT = "Tell me a long story about a lighthouse keeper and the sea, number "


def tiny_model(out: Path) -> Path:
    """A 4-layer random Llama (hidden 256) with SmolLM2's tokenizer: Python-bound steps."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
                         max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(loader.resolve_model(None).path).save_pretrained(out)
    GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(out)
    return out


async def start(model: str | None, dtype: str, async_scheduling: bool,
                parallel: ParallelConfig | None = None) -> AsyncEngine:
    return await AsyncEngine.start(EngineConfig(
        model=ModelConfig(model=model, dtype=dtype, max_model_len=1024),
        cache=CacheConfig(num_gpu_blocks_override=1024),
        scheduler=SchedulerConfig(async_scheduling=async_scheduling),
        parallel=parallel or ParallelConfig()))


def time_steps(engine: AsyncEngine) -> list[tuple[float, float]]:
    """Record ``(start, end)`` of every step on the executor's thread (one rank only): the gap
    from one step's end to the next one's start is the idle time async scheduling removes."""
    spans: list[tuple[float, float]] = []
    runner = getattr(engine.executor, "runner", None)
    if runner is None:
        return spans
    execute = runner.execute_model

    def timed(so):
        start = time.perf_counter()
        try:
            return execute(so)
        finally:
            spans.append((start, time.perf_counter()))

    runner.execute_model = timed
    return spans


async def run(engine: AsyncEngine, streams: int, tokens: int) -> dict:
    """``streams`` greedy requests of ``tokens`` output tokens each, all at once."""
    tok = engine.tokenizer
    spans = getattr(engine, "_bench_spans", None)
    if spans is None:
        spans = engine._bench_spans = time_steps(engine)  # type: ignore[attr-defined]
    spans.clear()
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    steps_before = engine.scheduler.num_steps

    async def one(i: int) -> int:
        ids = tok.encode(PROMPT + str(i))
        n = 0
        async for delta in engine.generate(f"b{time.monotonic_ns()}-{i}", ids, params):
            n += len(delta.token_ids)
        return n

    t0 = time.perf_counter()
    n = sum(await asyncio.gather(*(one(i) for i in range(streams))))
    wall = time.perf_counter() - t0
    steps = engine.scheduler.num_steps - steps_before
    row = {"tok_s": n / wall, "step_ms": 1000 * wall / steps, "steps": steps}
    if len(spans) > 2:  # the executor thread: busy per step, idle between steps
        row["forward_ms"] = 1000 * statistics.median(e - s for s, e in spans)
        row["gap_ms"] = 1000 * statistics.median(
            b[0] - a[1] for a, b in zip(spans, spans[1:]))
    return row


async def compare(label: str, engines: dict[str, AsyncEngine], rounds: int, tokens: int,
                  results: list[dict]) -> None:
    for engine in engines.values():  # warm-up
        await run(engine, 2, 8)
    for r in range(rounds):
        for streams in (1, 8):
            for mode, engine in engines.items():
                row = {"model": label, "mode": mode, "streams": streams, "round": r,
                       **await run(engine, streams, tokens)}
                print(json.dumps(row), flush=True)
                results.append(row)


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--models", default="tiny,smollm2")
    p.add_argument("--pp", action="store_true", help="also -pp 2 against one rank (tiny)")
    p.add_argument("--only-pp", action="store_true", help="skip the sync/async comparison")
    args = p.parse_args()
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny = str(tiny_model(Path(tmp) / "tiny"))
        models = {"tiny": (tiny, "float32"), "smollm2": (None, "auto")}
        for label in [] if args.only_pp else args.models.split(","):
            path, dtype = models[label]
            engines = {"sync": await start(path, dtype, False),
                       "async": await start(path, dtype, True)}
            try:
                await compare(label, engines, args.rounds, args.output_tokens, results)
            finally:
                for engine in engines.values():
                    await engine.shutdown()
        if args.pp:
            engines = {"pp1": await start(tiny, "float32", False),
                       "pp2": await start(tiny, "float32", True, ParallelConfig(1, 2)),
                       "pp2-sync": await start(tiny, "float32", False, ParallelConfig(1, 2))}
            try:
                await compare("tiny", engines, args.rounds, args.output_tokens, results)
            finally:
                for engine in engines.values():
                    await engine.shutdown()
    keys = sorted({(r["model"], r["mode"], r["streams"]) for r in results})
    for model, mode, streams in keys:
        rows = [r for r in results if (r["model"], r["mode"], r["streams"]) == (model, mode,
                                                                                streams)]
        med = {k: round(statistics.median(r[k] for r in rows), 2)
               for k in ("tok_s", "step_ms", "forward_ms", "gap_ms") if k in rows[0]}
        print(json.dumps({"median": True, "model": model, "mode": mode, "streams": streams,
                          **med, "runs": len(rows)}))


if __name__ == "__main__":
    asyncio.run(main())
