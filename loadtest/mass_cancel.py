"""Mass cancellation (issue 16, item 10; vLLM's ``test_request_cancellation``): 200 chat
requests with ``max_tokens`` = ``min_tokens`` = 10,000 whose clients give up after 0.5 s, then
one request with ``max_tokens`` 10. What counts is how long that last one takes to be answered
(the issue's bound: 5 s); also reported: how long the server takes, from the moment the 200
clients have given up, to hold no running or waiting request, and whether its blocks all came
back. Machine-independent: the tokens computed for the 200 (every one of them gone), and
the steps run in all.

Runs ``pagedserve serve`` on the default model (SmolLM2-135M-Instruct) with a context long
enough for the 10,000 tokens, unless ``--url`` names a running server.

Usage: ``.venv/bin/python loadtest/mass_cancel.py [--num-requests 200] [--url URL]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import time

import httpx
import openai

from pagedserve.server.launch import start_server_process

MODEL = "mass-cancel"
SERVE_ARGS = ["--max-model-len", "10240", "--max-num-seqs", "256", "--served-model-name", MODEL]


async def give_up(url: str, n: int, timeout: float) -> list[str]:
    """``n`` impatient requests from one ``openai`` client, as vLLM's test sends them (its
    default retries included: each gives up after ``timeout`` s, up to three times); how each
    ended (``timeout`` expected)."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=timeout)

    async def one(i: int) -> str:
        try:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Write a long story"}],
                max_tokens=10_000, extra_body={"min_tokens": 10_000})
            return "answered"
        except openai.APITimeoutError:
            return "timeout"
        except openai.APIError as e:
            return type(e).__name__

    try:
        return list(await asyncio.gather(*(one(i) for i in range(n))))
    finally:
        await client.close()


async def idle_after(client: httpx.AsyncClient, start: float) -> tuple[float, dict]:
    """Seconds from ``start`` until the scheduler holds nothing; the stats then."""
    while True:
        s = (await client.get("/admin/stats")).json()
        if s["scheduler"]["num_running"] == 0 and s["scheduler"]["num_waiting"] == 0:
            return time.perf_counter() - start, s
        await asyncio.sleep(0.02)


async def run(url: str, n: int, client_timeout: float) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start_stats = (await client.get("/admin/stats")).json()
        before = start_stats["kv_cache"]["num_free_blocks"]
        start = time.perf_counter()
        ends = await give_up(url, n, client_timeout)
        gave_up = time.perf_counter()
        idle = asyncio.create_task(idle_after(client, gave_up))
        r = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Write a long story"}], "max_tokens": 10})
        last_s = time.perf_counter() - gave_up
        idle_s, s = await idle
        r.raise_for_status()
        usage = r.json()["usage"]
        # What the server computed for clients that were all gone: everything since the start
        # but the last request (counted whole; its prompt may have been a prefix-cache hit).
        last_work = usage["prompt_tokens"] + usage["completion_tokens"] - 1
        return {
            "num_requests": n, "client_timeout_s": client_timeout,
            "client_ends": {e: ends.count(e) for e in sorted(set(ends))},
            "clients_gave_up_after_s": round(gave_up - start, 3),
            "last_request_answered_s": round(last_s, 3),
            "last_request_tokens": r.json()["usage"]["completion_tokens"],
            "scheduler_idle_after_s": round(idle_s, 3),
            "tokens_computed_for_gone_clients": _computed(s) - _computed(start_stats) - last_work,
            "steps_in_all": _steps(s) - _steps(start_stats),
            "free_blocks_before": before,
            "free_blocks_after": s["kv_cache"]["num_free_blocks"],
        }


def _computed(stats: dict) -> int:
    return stats["scheduler"]["num_computed_tokens_total"]


def _steps(stats: dict) -> int:
    return stats["scheduler"]["num_steps_total"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--client-timeout", type=float, default=0.5)
    parser.add_argument("--url", help="a running server (else one is started)")
    parser.add_argument("--server-log", help="where the started server's log goes")
    args = parser.parse_args()
    proc = None
    url = args.url
    if url is None:
        log = open(args.server_log, "w") if args.server_log else subprocess.DEVNULL
        proc, url = start_server_process(SERVE_ARGS, timeout=600, stdout=log,
                                         stderr=subprocess.STDOUT)
    try:
        print(json.dumps(asyncio.run(run(url, args.num_requests, args.client_timeout)),
                         indent=2))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    main()
