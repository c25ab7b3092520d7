"""Data parallelism through the real server (issue 14), with two commands on loopback as on two
machines: an API server with ``-dp 2`` and one local engine, and a ``--headless`` node with
rank 1. Greedy float32 answers equal one in-process engine's; every KV block of both engines
is free after a run with random disconnects; the headless node SIGKILLed mid-stream fails only
its engine's request, the server serves on with the other, and SIGTERM stops it with no
process left (``tests/process_leaks.py`` checks the session too)."""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pagedserve.server.launch import free_port, start_server_process
from tests.conftest import chat, serve, until_stats

PROMPTS = [f"Tell me about the number {i} and its friends" for i in range(6)]
ARGS = ["--dtype", "float32", "--max-model-len", "512", "--num-gpu-blocks-override", "256",
        "--max-num-seqs", "64", "--max-num-batched-tokens", "512"]


def engine_pids(parent: int) -> dict[int, int]:
    """``{rank: pid}`` of the live engine-core processes ``parent`` started."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        rank = re.search(r"engine_core_proc\x00--engine-index=(\d+)", cmd)
        if rank and int(fields[1]) == parent and fields[0] != "Z":
            out[int(rank.group(1))] = int(entry.name)
    return out


async def until_logged(path: Path, pattern: str, timeout: float = 60.0) -> None:
    """Until the log at ``path`` has a line matching ``pattern`` (``timeout`` catches a hang)."""
    deadline = time.monotonic() + timeout
    while not re.search(pattern, path.read_text()):
        assert time.monotonic() < deadline, f"never logged {pattern!r}"
        await asyncio.sleep(0.05)


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def loopback_dp2(tiny_model_dir, tmp_path_factory):
    """Two commands on loopback, as on two machines: an API server with ``-dp 2`` and one
    local engine (rank 0), and a ``--headless`` node with rank 1. Yields both processes, the
    URL and the logs' folder; stops them (SIGTERM) at the end."""
    logs = tmp_path_factory.mktemp("dp2")
    dp = ["-dp", "2", "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
          "--data-parallel-rpc-port", str(free_port())]
    exe = str(Path(sys.executable).parent / "pagedserve")
    with (logs / "headless.log").open("w") as hl, (logs / "front.log").open("w") as fl:
        headless = subprocess.Popen([exe, "serve", str(tiny_model_dir), *ARGS, *dp, "--headless",
                                     "--data-parallel-start-rank", "1"],
                                    stdout=hl, stderr=subprocess.STDOUT)
        try:
            front, url = start_server_process([str(tiny_model_dir), *ARGS, *dp],
                                              stdout=fl, stderr=subprocess.STDOUT)
        except BaseException:
            stop(headless)
            raise
    try:
        yield front, headless, url, logs
    finally:
        if headless.poll() is None:
            stop(headless)
        if front.poll() is None:
            assert stop(front) == 0
        assert engine_pids(front.pid) == {} and engine_pids(headless.pid) == {}


async def test_dp2_greedy_equals_dp1(loopback_dp2, tiny_model_dir):
    *_, url, logs = loopback_dp2
    assert "waiting_for_engines" in (front := (logs / "front.log").read_text())
    assert "all_engines_registered" in front
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        stats = (await client.get("/admin/stats")).json()
        assert stats["kv_cache"]["num_blocks"] == 512  # two engines' pools, 256 blocks each
        dp2 = await asyncio.gather(*(chat(client, p, max_tokens=24) for p in PROMPTS))
    async with serve(tiny_model_dir, max_model_len=512, num_blocks=256) as client:
        dp1 = await asyncio.gather(*(chat(client, p, max_tokens=24) for p in PROMPTS))
    metrics = httpx.get(f"{url}/metrics", timeout=30).text  # the cores' stats, forwarded
    generated = re.search(r"^pagedserve:generation_tokens_total\{[^}]*\} (\S+)$", metrics, re.M)
    assert generated and float(generated.group(1)) >= sum(
        r["usage"]["completion_tokens"] for r in dp2), metrics[:2000]
    for one, two in zip(dp1, dp2):
        assert two["choices"][0]["token_ids"] == one["choices"][0]["token_ids"]
        assert two["choices"][0]["message"] == one["choices"][0]["message"]
        assert len(two["choices"][0]["token_ids"]) == two["usage"]["completion_tokens"] > 0


async def _stream(client: httpx.AsyncClient, content: str, max_tokens: int,
                  leave_after: int | None) -> int:
    """A streamed chat; the client leaves after ``leave_after`` events (None: reads all)."""
    body = {"messages": [{"role": "user", "content": content}], "stream": True,
            "max_tokens": max_tokens, "ignore_eos": True}
    events = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                events += 1
                if leave_after is not None and events >= leave_after:
                    return events  # closing the response disconnects
    return events


async def test_every_block_of_every_engine_is_free_after_random_disconnects(loopback_dp2):
    *_, url, _ = loopback_dp2
    rng = random.Random(14)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        jobs = [_stream(client, f"story {i}: " + "once upon a time " * rng.randint(1, 20),
                        rng.randint(8, 64), rng.choice([None, 1, 3, 6]))
                for i in range(16)]
        assert all(n > 0 for n in await asyncio.gather(*jobs))
        s = await until_stats(client, lambda s: s["scheduler"]["num_running"] == 0
                              and s["scheduler"]["num_waiting"] == 0
                              and s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"],
                              "idle with every block free")
        assert s["kv_cache"]["num_blocks"] == 512


async def test_killed_node_fails_only_its_request_and_the_server_serves_on(loopback_dp2):
    """Last here: SIGKILL of the headless node mid-stream (its engine dies with it,
    ``PR_SET_PDEATHSIG``; the front sees the connection close) fails only the stream on
    engine 1; the other finishes, new requests go to engine 0, and SIGTERM then stops the
    server and its engine with nothing left behind."""
    front, headless, url, logs = loopback_dp2
    [headless_engine] = engine_pids(headless.pid).values()
    started = [asyncio.Event(), asyncio.Event()]
    killed = asyncio.Event()
    results: list = [None, None]

    async def run(i: int, client: httpx.AsyncClient) -> None:
        body = {"messages": [{"role": "user", "content": f"count {i}"}], "stream": True,
                "max_tokens": 400, "ignore_eos": True, "temperature": 0}
        events = []
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    if len(events) == 2:
                        started[i].set()
                        await killed.wait()  # hold the stream open until the kill
        results[i] = events

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        tasks = [asyncio.create_task(run(0, client)), asyncio.create_task(run(1, client))]
        await asyncio.wait_for(asyncio.gather(started[0].wait(), started[1].wait()), 120)
        headless.kill()
        await until_logged(logs / "front.log", r"engine_lost .*engine=1")
        killed.set()
        await asyncio.gather(*tasks)
        errors = [r[-1]["error"] for r in results if "error" in r[-1]]
        finished = [r for r in results if "error" not in r[-1]]
        assert len(errors) == 1 and len(finished) == 1, [r[-1] for r in results]
        assert "data-parallel engine 1 failed" in errors[0]["message"], errors[0]
        assert finished[0][-1]["choices"][0]["finish_reason"] == "length"
        assert (await client.get("/health")).status_code == 200  # one engine serves on
        await asyncio.gather(*(chat(client, f"still there {i}?", max_tokens=4)
                               for i in range(3)))
    assert headless.wait(timeout=60) == -signal.SIGKILL
    until = time.monotonic() + 60
    while Path(f"/proc/{headless_engine}").exists() and "Z" not in Path(
            f"/proc/{headless_engine}/stat").read_text().rsplit(")", 1)[1][:3]:
        assert time.monotonic() < until, "the headless node's engine outlived it"
        time.sleep(0.05)
    assert stop(front) == 0
    assert engine_pids(front.pid) == {}
