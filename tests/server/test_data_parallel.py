"""Data parallelism through the real server (issue 14), every engine an engine-core process
behind ``DataParallelEngine`` (``actors/dp/launch.py``, ``actors/dp/engine.py``).

Two servers, started together and shared by the tests of this module:

- ``loopback``: two commands on loopback, as on two machines: an API server with ``-dp 2`` and
  one local engine (rank 0), and a ``--headless`` node with rank 1; ``prefix`` routing.
- ``rr``: one command, ``-dp 2 --data-parallel-routing round-robin``, both engines local with
  one thread each.

Greedy float32 answers equal one in-process engine's (n = 2 choices on one engine, a routed
log line per request); a multi-turn workload keeps its prefix-cache hit rate under ``prefix``
and loses much of it under ``round-robin``; every block of every engine is free after random
disconnects; ``/metrics`` has each engine; a SIGKILLed engine fails only its own stream and
leaves the group degraded; a headless node killed mid-stream likewise; SIGTERM stops each
server with no process left (``tests/process_leaks.py`` checks the session too)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.server.launch import free_port
from tests.conftest import chat, serve, stats, until_stats
from tests.server.dp_servers import (ARGS, dp_server, engine_pids, spawn, stop, until_logged,
                                     wait_healthy)

PROMPTS = [f"Tell me about the number {i} and its friends" for i in range(6)]


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory):
    """Both servers of this module, started at once (their engines load side by side).
    Yields ``{"loopback": (front, headless, url, logs), "rr": (proc, url, logs)}``."""
    logs = tmp_path_factory.mktemp("dp")
    rr_logs = tmp_path_factory.mktemp("dp_rr")
    dp = ["-dp", "2", "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
          "--data-parallel-rpc-port", str(free_port())]
    headless = spawn([str(tiny_model_dir), *ARGS, *dp, "--headless",
                      "--data-parallel-start-rank", "1"], logs / "headless.log")
    port = free_port()
    front = spawn([str(tiny_model_dir), *ARGS, *dp, "--port", str(port)], logs / "front.log")
    url = f"http://127.0.0.1:{port}"
    try:
        with dp_server(tiny_model_dir, "--data-parallel-routing", "round-robin",
                       logs=rr_logs) as (rr, rr_url):
            wait_healthy(front, url)
            yield {"loopback": (front, headless, url, logs), "rr": (rr, rr_url, rr_logs)}
    finally:
        if headless.poll() is None:
            stop(headless)
        if front.poll() is None:
            assert stop(front) == 0
        assert engine_pids(front.pid) == {} and engine_pids(headless.pid) == {}


async def _greedy_run(client: httpx.AsyncClient) -> list[list[int]]:
    outs = await asyncio.gather(*(chat(client, p, max_tokens=24) for p in PROMPTS))
    r = await client.post("/v1/completions", json={  # n = 2: both choices on one engine
        "prompt": PROMPTS[0], "max_tokens": 8, "n": 2, "temperature": 0,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    return [o["choices"][0]["token_ids"] for o in outs] + [
        c["token_ids"] for c in r.json()["choices"]]


async def test_dp2_greedy_equals_dp1_routed_by_prefix(servers, tiny_model_dir):
    *_, url, logs = servers["loopback"]
    front_log = (logs / "front.log").read_text()
    assert "waiting_for_engines" in front_log and "all_engines_registered" in front_log
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        s = await stats(client)
        assert s["kv_cache"]["num_blocks"] == 512  # two engines' pools, 256 blocks each
        assert s["data_parallel"] == {"size": 2, "routing": "prefix"}
        got = await _greedy_run(client)
        s = await stats(client)
    async with serve(tiny_model_dir, max_model_len=512, num_blocks=256) as client:
        want = await _greedy_run(client)
    assert got == want and all(got)
    assert all(e["num_routed"] > 0 for e in s["engines"])  # the batch was spread
    await until_logged(logs / "front.log", r"route_reason=.?choice of n")
    routed = [line for line in (logs / "front.log").read_text().splitlines()
              if re.search(r"\brouted\b", line)]
    assert len(routed) == len(PROMPTS) + 2, routed  # one line per engine request
    assert "routing=prefix" in routed[0] and "matched_blocks=" in routed[0]
    engines = [re.search(r"engine=(\d)", line).group(1) for line in routed[-2:]]
    assert engines[0] == engines[1]  # the n choices on one engine


def conversations(seed: int = 7, turns: int = 5) -> list[list[list[int]]]:
    """8 conversations of ``turns`` prompts (token ids), each turn its predecessor plus a new
    user turn: a growing prefix. Random ids, so no two conversations share a block."""
    rng = random.Random(seed)
    convs = []
    for _ in range(8):
        ids = [rng.randrange(100, 40000) for _ in range(40)]
        turns_ids = []
        for _ in range(turns):
            turns_ids.append(list(ids))
            ids += [rng.randrange(100, 40000) for _ in range(20)]
        convs.append(turns_ids)
    return convs


async def hit_rate(url: str, seed: int = 7) -> tuple[float, dict]:
    """Send every turn, one at a time, in a random order across conversations (each
    conversation's turns in their order); the hit rate of these requests alone, from the
    ``/admin/stats`` counters before and after (the server may have served others before)."""
    convs = conversations(seed)
    order = [c for c in range(8) for _ in convs[c]]
    random.Random(seed).shuffle(order)
    next_turn = [0] * 8
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        before = (await stats(client))["kv_cache"]
        for c in order:
            prompt = convs[c][next_turn[c]]
            next_turn[c] += 1
            r = await client.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
        s = await stats(client)
    after = s["kv_cache"]
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    return (after["prefix_cache_hits"] - before["prefix_cache_hits"]) / queries, s


async def test_prefix_routing_keeps_the_hit_rate_round_robin_loses_it(servers, tiny_model_dir):
    async with serve(tiny_model_dir, max_model_len=512, num_blocks=256) as dp1:
        one, _ = await hit_rate(str(dp1.base_url))
    routed_before = [e["num_routed"] for e in (await _stats(servers["loopback"][2]))["engines"]]
    prefix, s = await hit_rate(servers["loopback"][2])
    routed = [e["num_routed"] - b for e, b in zip(s["engines"], routed_before)]
    assert all(routed) and sum(routed) == 40, routed  # both engines served
    rr, _ = await hit_rate(servers["rr"][1])
    assert one > 0.5, one
    assert abs(prefix - one) <= 0.1 * one, (prefix, one)
    assert rr < one - 0.15, (rr, one)  # a turn lands away from its prefix half the time


async def test_a_burst_sharing_only_a_short_prefix_is_split_between_engines(servers):
    """Eight prompts at once that share one 16-token block (a system prompt's worth) of 64
    tokens: the engine holding that block must not draw them all (it saves a block each, and
    queues eight); the router's own count splits them."""
    url = servers["loopback"][2]
    rng = random.Random(3)
    head = [rng.randrange(100, 40000) for _ in range(16)]
    prompts = [head + [rng.randrange(100, 40000) for _ in range(48)] for _ in range(9)]
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def one(prompt: list[int]) -> None:
            r = await client.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text

        await one(prompts[0])  # now one engine holds the shared block
        before = [e["num_routed"] for e in (await stats(client))["engines"]]
        await asyncio.gather(*(one(p) for p in prompts[1:]))
        after = [e["num_routed"] for e in (await stats(client))["engines"]]
    routed = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(routed) == 8 and min(routed) >= 3, routed


async def _stats(url: str) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return await stats(client)


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


def _all_idle(s: dict) -> bool:
    return all(e["scheduler"]["num_running"] == 0 and e["scheduler"]["num_waiting"] == 0
               and e["kv_cache"]["num_free_blocks"] == e["kv_cache"]["num_blocks"]
               for e in s["engines"])


async def test_every_block_of_every_engine_is_free_after_random_disconnects(servers):
    *_, url, _ = servers["loopback"]
    rng = random.Random(14)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        jobs = [_stream(client, f"story {i}: " + "once upon a time " * rng.randint(1, 20),
                        rng.randint(8, 64), rng.choice([None, 1, 3, 6]))
                for i in range(16)]
        assert all(n > 0 for n in await asyncio.gather(*jobs))
        s = await until_stats(client, _all_idle, "idle with every block free on every engine")
        assert s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"] == 512
        assert [e["load"] for e in s["engines"]] == [0, 0]  # the router's counts follow


async def test_metrics_per_engine_and_their_sum(servers):
    *_, url, _ = servers["loopback"]
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        r = await client.post("/v1/completions", json={"prompt": "Once upon", "max_tokens": 3})
        assert r.status_code == 200
        text = (await client.get("/metrics")).text
        s = await stats(client)
    by_engine: dict[str, float] = {}
    up: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pagedserve:generation_tokens_total":
                by_engine[sample.labels["engine"]] = sample.value
            elif sample.name == "pagedserve:data_parallel_engine_up":
                up[sample.labels["engine"]] = sample.value
    assert set(by_engine) == {"0", "1"} and up == {"0": 1.0, "1": 1.0}
    assert sum(by_engine.values()) >= 3  # the cores' stats, forwarded to the front
    queries = sum(e["kv_cache"]["prefix_cache_queries"] for e in s["engines"])
    assert s["kv_cache"]["prefix_cache_queries"] == queries


async def _held_streams(client: httpx.AsyncClient, kill) -> list[list[dict]]:
    """Two long greedy streams, the second sent once the first runs (so ``prefix`` and
    ``least-load`` put it on the other, lighter engine, as ``round-robin`` does; random
    prompts: no cached prefix draws them together); once both have begun, ``await kill()``;
    then read both to their end. Returns each stream's events."""
    started = [asyncio.Event(), asyncio.Event()]
    killed = asyncio.Event()
    results: list = [None, None]
    rng = random.Random(5)

    async def run(i: int) -> None:
        body = {"prompt": [rng.randrange(100, 40000) for _ in range(24)], "stream": True,
                "max_tokens": 400, "ignore_eos": True, "temperature": 0}
        events = []
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    if len(events) == 2:
                        started[i].set()
                        await killed.wait()  # hold the stream open until the kill
        results[i] = events

    tasks = [asyncio.create_task(run(0))]
    await asyncio.wait_for(started[0].wait(), 120)
    tasks.append(asyncio.create_task(run(1)))
    await asyncio.wait_for(started[1].wait(), 120)
    await kill()
    killed.set()
    await asyncio.gather(*tasks)
    return results


def _one_failed(results: list[list[dict]], engine: int) -> None:
    errors = [r[-1]["error"] for r in results if "error" in r[-1]]
    finished = [r for r in results if "error" not in r[-1]]
    assert len(errors) == 1 and len(finished) == 1, [r[-1] for r in results]
    assert f"data-parallel engine {engine} failed" in errors[0]["message"], errors[0]
    assert finished[0][-1]["choices"][0]["finish_reason"] == "length"


async def test_sigkill_of_one_engine_mid_stream_fails_only_its_requests(servers):
    """Round-robin puts one stream on each engine; SIGKILL of engine 1's process fails its
    stream only; /health says degraded naming it; new requests all go to engine 0. Then
    SIGKILL of engine 0: none is left, the server exits 1 with no process behind."""
    proc, url, logs = servers["rr"]
    assert (logs / "server.log").read_text().count("threads=1") >= 2
    pids = engine_pids(proc.pid)

    async def kill() -> None:
        os.kill(pids[1], signal.SIGKILL)
        await until_logged(logs / "server.log", r"data_parallel_engine_failed .*engine=1")

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        _one_failed(await _held_streams(client, kill), 1)
        r = await client.get("/health")
        assert r.status_code == 200 and r.json()["status"] == "degraded", r.text
        assert list(r.json()["failed_engines"]) == ["1"]
        before = (await stats(client))["engines"][0]["num_routed"]
        await asyncio.gather(*(chat(client, f"still there {i}?", max_tokens=4)
                               for i in range(3)))
        s = await stats(client)
        assert s["engines"][1]["failed"] and s["engines"][1]["scheduler"] is None
        assert s["engines"][0]["num_routed"] == before + 3  # the router skips the dead one
    os.kill(pids[0], signal.SIGKILL)  # none left: the server stops with status 1
    assert proc.wait(timeout=120) == 1
    assert engine_pids(proc.pid) == {}
    assert "every data-parallel engine failed" in (logs / "server.log").read_text()


async def test_killed_headless_node_fails_only_its_request_and_the_server_serves_on(servers):
    """Last on the loopback pair: SIGKILL of the headless node mid-stream (its engine dies
    with it, ``PR_SET_PDEATHSIG``; the front sees the connection close) fails only the stream
    on engine 1; the other finishes, new requests go to engine 0, and SIGTERM then stops the
    server and its engine with nothing left behind."""
    front, headless, url, logs = servers["loopback"]
    [headless_engine] = engine_pids(headless.pid).values()

    async def kill() -> None:
        headless.kill()
        await until_logged(logs / "front.log", r"engine_lost .*engine=1")

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        _one_failed(await _held_streams(client, kill), 1)
        r = await client.get("/health")
        assert r.status_code == 200 and r.json()["failed_engines"].keys() == {"1"}
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
