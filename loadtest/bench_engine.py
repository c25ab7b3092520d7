"""Start-up and streaming throughput of ``pagedserve serve`` on the default model.

1. Start time to a healthy server, first start (empty conversion cache: the GGUF is converted)
   and second start (cached safetensors).
2. Output tokens/s with 1 and with 8 concurrent streaming chat requests (greedy, EOS ignored,
   ``--output-tokens`` each), measured from the client over SSE.

Usage: ``.venv/bin/python loadtest/bench_engine.py [--output-tokens 128] [--dtype auto]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from pagedserve.server.launch import start_server_process

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "What are the benefits of reading every day?",
    "Describe a walk through a forest in autumn.",
    "Give me advice for a first job interview.",
    "Why is the sky blue?",
    "Tell me about the history of bread.",
    "How do bees make honey?",
]


def start_server(cache: str, extra: list[str]) -> tuple[subprocess.Popen, str, float]:
    """Start with ``cache`` as the conversion cache; returns the process, URL and seconds."""
    start = time.perf_counter()
    proc, url = start_server_process(extra, timeout=600, env={**os.environ,
                                     "PAGEDSERVE_CACHE": cache},
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, url, time.perf_counter() - start


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)


async def stream_one(client: httpx.AsyncClient, prompt: str, n: int) -> tuple[int, float]:
    body = {"messages": [{"role": "user", "content": prompt}], "stream": True,
            "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    tokens, ttft, start = 0, 0.0, time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content") and not ttft:
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return tokens, ttft


async def throughput(url: str, concurrency: int, n: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await stream_one(client, "warm up", 4)
        start = time.perf_counter()
        results = await asyncio.gather(*(stream_one(client, PROMPTS[i % len(PROMPTS)], n)
                                         for i in range(concurrency)))
        wall = time.perf_counter() - start
    total = sum(t for t, _ in results)
    return {"concurrency": concurrency, "output_tokens": total, "wall_s": round(wall, 2),
            "output_tokens_per_s": round(total / wall, 1),
            "ttft_max_s": round(max(f for _, f in results), 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--out", default=None, help="write the JSON here too")
    args = p.parse_args()
    extra = ["--dtype", args.dtype, "--max-model-len", "2048"]
    results: dict = {}
    with tempfile.TemporaryDirectory() as cache:
        proc, _, first = start_server(cache, extra)
        stop(proc)
        proc, url, cached = start_server(cache, extra)
        results["start_s"] = {"first": round(first, 2), "cached": round(cached, 2)}
        try:
            results["throughput"] = [asyncio.run(throughput(url, c, args.output_tokens))
                                     for c in (1, 8)]
        finally:
            stop(proc)
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
