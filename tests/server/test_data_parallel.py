"""Data parallelism through a real server on the tiny model: two in-process engines behind one
API (``actors/dp_engine.py``), routed by ``actors/dp_router.py`` from the engines' KV events.

Greedy output equals one engine's; a multi-turn workload keeps its prefix-cache hit rate under
``prefix`` routing and loses much of it under ``round-robin``; every block of every engine is
free after random disconnects; ``/metrics`` and ``/admin/stats`` show each engine; a dead
engine leaves the group degraded, not down."""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest_asyncio
import structlog
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.actors.dp_engine import DataParallelEngine
from pagedserve.actors.engine import AsyncEngine
from pagedserve.gpu.config import ParallelConfig
from pagedserve.server.launch import running_server
from pagedserve.server.serving import ServingConfig
from tests.conftest import TINY_NAME, engine_config, serve, stats, stream_chat, until_stats

PROMPTS = [f"Request {i}: a few words about {w}" for i, w in
           enumerate(["cats", "dogs", "the sea", "mountains", "rain", "paging"])]


@asynccontextmanager
async def serve_dp(model_dir, size: int = 2, policy: str = "prefix",
                   **kw) -> AsyncIterator[httpx.AsyncClient]:
    """``size`` in-process engines (one thread each) behind a real server."""
    engine = await DataParallelEngine.start(engine_config(model_dir, **kw), size, policy,
                                            threads_per_engine=1)
    try:
        async with running_server(engine, ServingConfig(TINY_NAME)) as url:
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                yield client
    finally:
        await engine.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def dp2(tiny_model_dir):
    async with serve_dp(tiny_model_dir) as c:
        yield c


async def test_greedy_dp2_equals_dp1_and_both_engines_serve(dp2, tiny_model_dir):
    async def run(client: httpx.AsyncClient) -> list[list[int]]:
        outs = await asyncio.gather(*(stream_chat(client, p, max_tokens=24, ignore_eos=True)
                                      for p in PROMPTS))
        r = await client.post("/v1/completions", json={  # n = 2: both choices on one engine
            "prompt": PROMPTS[0], "max_tokens": 8, "n": 2, "temperature": 0,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        return [t for _, t, _ in outs] + [c["token_ids"] for c in r.json()["choices"]]

    with structlog.testing.capture_logs() as events:
        got = await run(dp2)
    async with serve(tiny_model_dir) as dp1:
        want = await run(dp1)
    assert got == want
    routed = [e for e in events if e["event"] == "routed"]
    assert len(routed) == len(PROMPTS) + 2  # one line per engine request
    first = routed[0]
    assert first["routing"] == "prefix" and len(first["engine_loads"]) == 2
    assert {"matched_blocks", "route_reason", "request_id"} <= first.keys()
    n_choices = routed[-2:]
    assert n_choices[0]["engine"] == n_choices[1]["engine"]
    assert n_choices[1]["route_reason"] == "choice of n"
    s = await stats(dp2)
    assert s["data_parallel"] == {"size": 2, "routing": "prefix"}
    assert all(e["num_routed"] > 0 for e in s["engines"])  # the batch was spread


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


async def hit_rate(client: httpx.AsyncClient, seed: int = 7) -> tuple[float, dict]:
    """Send every turn, one at a time, in a random order across conversations (each
    conversation's turns in their order); the hit rate /admin/stats then shows."""
    convs = conversations(seed)
    order = [c for c in range(8) for _ in convs[c]]
    random.Random(seed).shuffle(order)
    next_turn = [0] * 8
    for c in order:
        prompt = convs[c][next_turn[c]]
        next_turn[c] += 1
        r = await client.post("/v1/completions", json={
            "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
    s = await stats(client)
    return s["kv_cache"]["prefix_cache_hit_rate"], s


async def test_prefix_routing_keeps_the_hit_rate_round_robin_loses_it(tiny_model_dir):
    async with serve(tiny_model_dir) as dp1:
        one, _ = await hit_rate(dp1)
    async with serve_dp(tiny_model_dir, policy="prefix") as c:
        prefix, s = await hit_rate(c)
    assert [e["num_routed"] for e in s["engines"]] != [40, 0]  # both engines served
    async with serve_dp(tiny_model_dir, policy="round-robin") as c:
        rr, _ = await hit_rate(c)
    assert one > 0.5, one
    assert abs(prefix - one) <= 0.1 * one, (prefix, one)
    assert rr < one - 0.15, (rr, one)  # a turn lands away from its prefix half the time


async def test_every_block_free_on_every_engine_after_random_disconnects(dp2):
    rng = random.Random(3)

    async def stream(i: int) -> None:
        payload = {"prompt": f"{i} " + PROMPTS[i % len(PROMPTS)] * 3, "max_tokens": 200,
                   "ignore_eos": True, "stream": True}
        leave_after = rng.choice([1, 3, 8, None])
        async with dp2.stream("POST", "/v1/completions", json=payload) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: {")
                if leave_after is not None and seen >= leave_after:
                    return  # the client goes away mid-stream

    await asyncio.gather(*(stream(i) for i in range(12)))

    def idle(s: dict) -> bool:
        return all(e["scheduler"]["num_running"] == 0 and e["scheduler"]["num_waiting"] == 0
                   and e["kv_cache"]["num_free_blocks"] == e["kv_cache"]["num_blocks"]
                   for e in s["engines"])

    s = await until_stats(dp2, idle, "idle on every engine")
    assert s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"]
    assert s["kv_cache"]["num_blocks"] == sum(e["kv_cache"]["num_blocks"] for e in s["engines"])


async def test_metrics_per_engine_and_their_sum(dp2):
    r = await dp2.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 3})
    assert r.status_code == 200
    text = (await dp2.get("/metrics")).text
    by_engine: dict[str, float] = {}
    up: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pagedserve:prompt_tokens_total":
                by_engine[sample.labels["engine"]] = sample.value
            elif sample.name == "pagedserve:data_parallel_engine_up":
                up[sample.labels["engine"]] = sample.value
            elif sample.name == "pagedserve:num_requests_running":
                assert sample.labels["engine"] in ("0", "1")
    assert set(by_engine) == {"0", "1"} and up == {"0": 1.0, "1": 1.0}
    s = await stats(dp2)
    queries = sum(e["kv_cache"]["prefix_cache_queries"] for e in s["engines"])
    assert s["kv_cache"]["prefix_cache_queries"] == queries
    assert sum(by_engine.values()) > 0


async def test_a_dead_engine_leaves_the_group_degraded(tiny_model_dir):
    """Engine 1 runs its model in two worker processes (tp=2); SIGKILL one: engine 1 fails
    the request it runs next, /health says degraded and names it, requests go to engine 0,
    shutdown stops both."""
    config = engine_config(tiny_model_dir)
    engines = [await AsyncEngine.start(config)]
    engines.append(await AsyncEngine.start(
        engine_config(tiny_model_dir, parallel=ParallelConfig(2))))
    engine = DataParallelEngine(engines, "round-robin")
    try:
        async with running_server(engine, ServingConfig(TINY_NAME)) as url:
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                assert (await client.get("/health")).status_code == 200
                pid = engines[1].info.parallel_layout[1]["pid"]
                os.kill(pid, signal.SIGKILL)
                # Round-robin: the first request runs on engine 0, the second on engine 1,
                # whose next step finds the worker gone and fails that request only.
                body = {"prompt": PROMPTS[1], "max_tokens": 4}
                assert (await client.post("/v1/completions", json=body)).status_code == 200
                failed = await client.post("/v1/completions", json=body)
                assert failed.status_code >= 500, failed.text
                await asyncio.wait_for(engines[1].wait_failed(), 60)
                r = await client.get("/health")
                assert r.status_code == 200 and r.json()["status"] == "degraded"
                assert list(r.json()["failed_engines"]) == ["1"]
                for _ in range(3):  # round-robin skips the dead one
                    _, tokens, _ = await stream_chat(client, PROMPTS[0], max_tokens=4)
                    assert len(tokens) == 4
                s = await stats(client)
                assert s["engines"][1]["failed"] and s["engines"][1]["scheduler"] is None
                assert s["engines"][0]["num_routed"] >= 3
    finally:
        await engine.shutdown()


def test_serve_flags_start_the_group_and_sigterm_stops_it(tiny_model_dir, tmp_path):
    """``pagedserve serve -dp 2 --data-parallel-routing round-robin``: two engines with one
    thread each (of PAGEDSERVE_CPU_THREADS=2), requests alternate, SIGTERM exits 0."""
    import json
    import subprocess
    import urllib.request

    from pagedserve.server.launch import start_server_process

    log = (tmp_path / "server.log").open("w")
    proc, url = start_server_process(
        [str(tiny_model_dir), "--max-model-len", "256", "-dp", "2",
         "--data-parallel-routing", "round-robin"],
        env={**os.environ, "PAGEDSERVE_CPU_THREADS": "2"}, stdout=log,
        stderr=subprocess.STDOUT)
    try:
        for _ in range(2):
            body = json.dumps({"prompt": "Hello", "max_tokens": 2}).encode()
            req = urllib.request.Request(f"{url}/v1/completions", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                assert r.status == 200
        with urllib.request.urlopen(f"{url}/admin/stats", timeout=60) as r:
            s = json.load(r)
        assert s["data_parallel"] == {"size": 2, "routing": "round-robin"}
        assert [e["num_routed"] for e in s["engines"]] == [1, 1]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    text = (tmp_path / "server.log").read_text()
    assert text.count("threads=1") >= 2 and "data_parallel_ready" in text
