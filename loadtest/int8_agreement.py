"""What ``--cpu-linear-mode int8`` costs in output agreement: greedy chat completions on the
default model (the embedded SmolLM2 GGUF) in the exact float32 mode and in the int8 mode,
token for token. One server per mode, the same prompts (16 chat prompts, 64 tokens each, EOS
ignored), all requests at once (batched as the server batches them).

Prints one JSON line: per prompt the first position where int8's tokens leave exact's (64 =
never), the mean of those, and the token agreement = tokens equal up to the first divergence
over all tokens (after a divergence the two continue different texts, so later equality
means little). The figure is in docs/cpu-performance.md next to the mode's description.

    .venv/bin/python loadtest/int8_agreement.py [--tokens 64] [--extra "--dtype bfloat16"]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import signal
import subprocess

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
    "What is the capital of France, and what is it known for?",
    "List three tips for learning a new language.",
    "How does a refrigerator keep food cold?",
    "Write a haiku about the sea.",
    "What should I pack for a weekend camping trip?",
    "Explain photosynthesis to a ten-year-old.",
    "Why do cats purr?",
    "Suggest a simple recipe for dinner tonight.",
]


async def _greedy(url: str, tokens: int) -> list[list[int]]:
    async with httpx.AsyncClient(base_url=url, timeout=1800) as client:
        async def one(prompt: str) -> list[int]:
            r = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True})
            r.raise_for_status()
            return r.json()["choices"][0]["token_ids"]
        return await asyncio.gather(*(one(p) for p in PROMPTS))


def greedy_run(serve_args: list[str], tokens: int) -> list[list[int]]:
    """The prompts' greedy tokens from a server started with ``serve_args`` (then stopped)."""
    proc, url = start_server_process(serve_args, timeout=900, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
    try:
        return asyncio.run(_greedy(url, tokens))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def run_mode(mode: str, tokens: int, extra: list[str]) -> list[list[int]]:
    return greedy_run(["--dtype", "float32", *extra, "--cpu-linear-mode", mode], tokens)


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def agreement(ref: list[list[int]], got: list[list[int]], tokens: int) -> dict:
    """Per prompt the first position where ``got`` leaves ``ref`` (``tokens`` = never), their
    mean, the prompts identical throughout, and the tokens equal up to the first divergence
    over all tokens."""
    firsts = [first_divergence(a, b) for a, b in zip(ref, got, strict=True)]
    return {
        "prompts": len(ref), "tokens": tokens, "first_divergence": firsts,
        "mean_first_divergence": round(sum(firsts) / len(firsts), 2),
        "identical_prompts": sum(f == tokens for f in firsts),
        "token_agreement": round(sum(firsts) / sum(len(a) for a in ref), 4),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--extra", default="", help="more serve flags for both servers")
    args = p.parse_args()
    extra = shlex.split(args.extra)
    exact = run_mode("exact", args.tokens, extra)
    int8 = run_mode("int8", args.tokens, extra)
    print(json.dumps({**agreement(exact, int8, args.tokens), "extra": args.extra}))


if __name__ == "__main__":
    main()
