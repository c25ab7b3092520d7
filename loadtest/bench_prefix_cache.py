"""Prefix-caching benchmark on the default model (issue: automatic prefix caching).

1. TTFT of a chat request whose ~1,500-token system prompt is cached, against the same request
   with caching off: median of ``--runs`` runs each, both engines in this one run.
2. Hit rate and throughput of ``--num-requests`` requests sharing one long system prompt.

Usage: ``.venv/bin/python loadtest/bench_prefix_cache.py [--runs 10] [--num-requests 64]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

from pagedserve.actors.core.config import SchedulerConfig
from pagedserve.actors.engine.async_engine import AsyncEngine
from pagedserve.actors.engine.config import EngineConfig
from pagedserve.gpu.config import CacheConfig, ModelConfig
from pagedserve.server.launch import running_server
from pagedserve.server.openai.serving import ServingConfig

WORDS = ("river mountain lantern orchard copper violet harbor meadow thunder compass "
         "glacier saffron marble falcon willow ember canyon").split()


def system_prompt(n_words: int) -> str:
    return "You are a careful assistant. Reference notes: " + " ".join(
        WORDS[(i * 7) % len(WORDS)] + str(i % 13) for i in range(n_words))


async def ttft(client: httpx.AsyncClient, system: str, question: str, max_tokens: int) -> float:
    body = {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": question}],
            "stream": True, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    first = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if first is None and '"content": "' in line and '"role"' not in line:
                first = time.perf_counter() - start
    assert first is not None
    return first


async def run(args: argparse.Namespace) -> dict:
    system = system_prompt(args.system_words)
    results: dict = {}
    for caching in (False, True):
        cfg = EngineConfig(ModelConfig(dtype=args.dtype, max_model_len=4096),
                           CacheConfig(enable_prefix_caching=caching),
                           SchedulerConfig(max_num_batched_tokens=2048))
        engine = await AsyncEngine.start(cfg)
        n_sys = len(engine.tokenizer.encode(system))
        async with running_server(engine, ServingConfig("m")) as url:
            async with httpx.AsyncClient(base_url=url, timeout=600) as client:
                await ttft(client, system, "Warm up.", 2)  # fills the cache (when on)
                times = [await ttft(client, system, f"Question {i}: what is item {i}?", 2)
                         for i in range(args.runs)]
                key = "cache_on" if caching else "cache_off"
                results[key] = {"ttft_median_s": statistics.median(times), "ttft_s": times}
                if caching:
                    before = (await client.get("/admin/stats")).json()["kv_cache"]
                    start = time.perf_counter()
                    await asyncio.gather(*(ttft(client, system, f"Task {i}: summarise note {i}.",
                                                args.output_tokens)
                                           for i in range(args.num_requests)))
                    wall = time.perf_counter() - start
                    after = (await client.get("/admin/stats")).json()["kv_cache"]
                    q = after["prefix_cache_queries"] - before["prefix_cache_queries"]
                    h = after["prefix_cache_hits"] - before["prefix_cache_hits"]
                    results["shared_prompt_workload"] = {
                        "num_requests": args.num_requests, "wall_s": wall,
                        "hit_rate": h / q, "output_tokens_per_s":
                            args.num_requests * args.output_tokens / wall,
                        "requests_per_s": args.num_requests / wall}
        await engine.shutdown()
    results["system_prompt_tokens"] = n_sys
    results["speedup"] = (results["cache_off"]["ttft_median_s"]
                          / results["cache_on"]["ttft_median_s"])
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--system-words", type=int, default=620, help="~1,500 tokens")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--out", default=None, help="write the JSON here too")
    args = p.parse_args()
    results = asyncio.run(run(args))
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
