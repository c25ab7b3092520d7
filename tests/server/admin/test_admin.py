"""The operators' view on the tiny model through a real server: /admin/stats under load and back
to idle, the /admin/events stream, per-step records, and who may read them."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest_asyncio

from pagedserve.kernels import cpu_isa
from pagedserve.server.openai.serving import ServingConfig
from tests.conftest import TINY_NAME, hf_tokenizer, serve, stats

BLOCK = 16
MAX_NUM_SEQS = 8


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def client(tiny_model_dir):
    # Long contexts and room for them: the load outlasts the test even on a fast machine.
    async with serve(tiny_model_dir, max_num_seqs=MAX_NUM_SEQS, max_model_len=2048,
                     num_blocks=1024) as c:
        yield c


def prompt(i: int) -> str:
    # A distinct first word per request: no two requests could ever share a KV block.
    return f"{i} apples and {i} pears make a basket of fruit number {i}."


async def stream_forever(client: httpx.AsyncClient, text: str, seen: list[int],
                         priority: int = 0) -> None:
    """Stream a long completion until cancelled; counts received chunks in ``seen``."""
    payload = {"prompt": text, "max_tokens": 1800, "ignore_eos": True, "temperature": 0,
               "stream": True, "priority": priority}
    async with client.stream("POST", "/v1/completions", json=payload) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                seen.append(1)


def assert_idle(s: dict) -> None:
    sched, kv = s["scheduler"], s["kv_cache"]
    assert (sched["num_waiting"], sched["num_running"], sched["requests"]) == (0, 0, []), sched
    assert kv["num_free_blocks"] == kv["num_blocks"] and kv["usage"] == 0.0, kv


async def wait_idle(client: httpx.AsyncClient, timeout: float = 120.0) -> dict:
    """Poll until idle; ``timeout`` only catches a hung server, not a slow machine."""
    deadline = time.monotonic() + timeout
    while True:
        s = await stats(client)
        try:
            assert_idle(s)
            return s
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.02)


async def test_stats_under_load_then_idle_after_mass_abort(client, tiny_model_dir):
    tok = hf_tokenizer(str(tiny_model_dir))
    idle = await wait_idle(client)
    seen: list[int] = []
    tasks = [asyncio.create_task(stream_forever(client, prompt(i), seen)) for i in range(16)]
    try:
        deadline = time.monotonic() + 120  # a hung server, not a slow one
        while True:  # until every request is in (and the running ones have tokens)
            s = await stats(client)
            sched = s["scheduler"]
            if len(sched["requests"]) == 16 and sched["num_running"] == MAX_NUM_SEQS and all(
                r["output_tokens"] > 0 for r in sched["requests"] if r["state"] == "running"
            ):
                break
            assert time.monotonic() < deadline, sched
            await asyncio.sleep(0.02)
        # Polled every 100 ms under load, every snapshot is consistent with itself.
        lengths = {str(i): len(tok.encode(prompt(i))) for i in range(16)}
        for _ in range(8):
            r = await client.get("/admin/stats")
            s = r.json()
            sched, kv = s["scheduler"], s["kv_cache"]
            assert sched["num_running"] + sched["num_waiting"] == 16
            assert sched["num_running"] == MAX_NUM_SEQS and sched["policy"] == "fcfs"
            rows = sched["requests"]
            assert len(rows) == 16 and len({row["id"] for row in rows}) == 16
            held = sum(row["num_blocks"] for row in rows)
            assert held > 0 and kv["num_free_blocks"] == kv["num_blocks"] - held
            assert kv["usage"] == round(held / kv["num_blocks"], 6)
            for row in rows:
                if row["state"] == "running":
                    # between steps, the blocks cover exactly the computed tokens
                    assert row["num_blocks"] == -(-row["num_computed_tokens"] // BLOCK)
                    assert row["num_computed_tokens"] == (
                        row["prompt_tokens"] + row["output_tokens"] - 1)
                    assert row["ttft_s"] is not None and 0 < row["ttft_s"] <= row["age_s"]
                else:
                    assert row["state"] == "waiting"
                    assert (row["num_blocks"], row["output_tokens"], row["ttft_s"]) == (0, 0, None)
                assert row["priority"] == 0 and row["cached_tokens"] == 0
            assert sorted(row["prompt_tokens"] for row in rows) == sorted(lengths.values())
            assert "apples" not in r.text  # never the prompt text
            assert s["throughput"]["generation_tokens_per_s"] > 0
            assert s["steps"] and s["steps"][-1]["batch_size"] == MAX_NUM_SEQS
            await asyncio.sleep(0.1)
        assert len(seen) > 0
    finally:
        for t in tasks:  # the mass abort: every client goes away at once
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    after = await wait_idle(client)
    assert_idle(after)
    assert after["kv_cache"]["num_blocks"] == idle["kv_cache"]["num_blocks"]
    # and nothing comes back to life: the next snapshots stay idle, no step runs
    await asyncio.sleep(0.3)
    later = await stats(client)
    assert_idle(later)
    assert later["scheduler"]["num_steps_total"] == after["scheduler"]["num_steps_total"]


async def test_steps_record_prefill_and_decode(client, tiny_model_dir):
    await wait_idle(client)
    text = "Once upon a time in a land far away"
    num_prompt = len(hf_tokenizer(str(tiny_model_dir)).encode(text))
    before = (await stats(client))["scheduler"]["num_steps_total"]
    r = await client.post("/v1/completions", json={
        "prompt": text, "max_tokens": 12, "ignore_eos": True, "temperature": 0})
    assert r.json()["usage"] == {"prompt_tokens": num_prompt, "completion_tokens": 12,
                                 "total_tokens": num_prompt + 12,
                                 "prompt_tokens_details": None}  # no flag: vLLM's null
    s = await stats(client)
    assert_idle(s)  # a finished request is gone, with its blocks, before its answer is sent
    assert s["scheduler"]["num_steps_total"] - before == 12
    steps = s["steps"][-12:]
    assert [st["batch_size"] for st in steps] == [1] * 12
    assert [(st["prefill_tokens"], st["decode_tokens"]) for st in steps] == (
        [(num_prompt, 0)] + [(0, 1)] * 11)
    assert all(st["duration_ms"] > 0 for st in steps)
    assert len(s["steps"]) <= 100
    assert s["throughput"]["window_s"] == 10.0
    assert s["throughput"]["prompt_tokens_per_s"] >= num_prompt / 10
    assert s["throughput"]["generation_tokens_per_s"] >= 12 / 10


async def test_model_and_config(client):
    s = await stats(client)
    assert s["model"]["name"] == TINY_NAME and s["model"]["max_model_len"] == 2048
    cfg = s["config"]
    assert cfg["scheduler"] == {"max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": 512,
                                "policy": "fcfs", "max_waiting_requests": None,
                                "async_scheduling": False, "speculative": None,
                                "enable_chunked_prefill": True, "max_loras": 0}
    assert cfg["cache"]["block_size"] == BLOCK and cfg["cache"]["num_blocks"] == 1024
    assert cfg["model"]["max_model_len"] == 2048 and cfg["model"]["dtype"] == "float32"
    assert cfg["model"]["cpu_isa"] in cpu_isa.LEVELS  # the kernels' tier, _vnni or not
    # The tiny model is a Hugging Face folder: nothing to keep quantized.
    assert cfg["model"]["quantization"] == s["model"]["quantization"] == "none"
    # The HTTP layer's settings the dashboard shows: SmolLM2's ChatML template picks hermes.
    assert s["serving"] == {"served_model_names": [TINY_NAME], "tool_call_parser": "hermes",
                            "tool_call_parser_source": "chat template", "auto_tool_choice": True}
    assert cfg["model"]["model"] == s["model"]["path"]
    # 2 layers x (K, V) x 1024 blocks x 16 tokens x 2 kv heads x 16 dims x 4 bytes
    assert cfg["cache"]["kv_cache_memory_bytes"] == 2 * 2 * 1024 * BLOCK * 2 * 16 * 4
    kv = s["kv_cache"]
    assert (kv["prefix_cache_queries"], kv["prefix_cache_hits"], kv["prefix_cache_hit_rate"]) == (
        0, 0, 0.0) or kv["prefix_cache_queries"] >= kv["prefix_cache_hits"]
    assert kv["num_cached_blocks"] >= 0


async def test_request_rows_show_priority_and_prefix_cache_hits(tiny_model_dir):
    text = " ".join(f"word{i}" for i in range(40))  # several full blocks
    async with serve(tiny_model_dir, policy="priority", max_model_len=2048) as c:
        r = await c.post("/v1/completions", json={"prompt": text, "max_tokens": 2})
        num_prompt = r.json()["usage"]["prompt_tokens"]
        assert num_prompt > 2 * BLOCK
        seen: list[int] = []
        task = asyncio.create_task(stream_forever(c, text, seen, priority=3))
        try:
            while True:  # until the request has been admitted and has produced a token
                rows = (await stats(c))["scheduler"]["requests"]
                if rows and rows[0]["output_tokens"] > 0:
                    break
                if task.done():
                    task.result()  # the stream failed: show why
                await asyncio.sleep(0.02)
            # every full block of the prompt but the one holding its last token is a hit
            assert rows[0]["priority"] == 3
            assert rows[0]["cached_tokens"] == (num_prompt - 1) // BLOCK * BLOCK
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def test_stats_json_shape(client):
    """The JSON of /admin/stats is an interface (admin.js, operators' scripts): exactly these
    keys, whatever the typed stats behind it hold."""
    await wait_idle(client)
    seen: list[int] = []
    task = asyncio.create_task(stream_forever(client, prompt(99), seen))
    try:
        while not (s := await stats(client))["scheduler"]["requests"] or not s["steps"]:
            if task.done():
                task.result()  # the stream failed: show why
            await asyncio.sleep(0.02)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert set(s) == {"scheduler", "kv_cache", "steps", "throughput", "model", "config", "time",
                      "serving"}
    assert set(s["serving"]) == {"served_model_names", "tool_call_parser",
                                 "tool_call_parser_source", "auto_tool_choice"}
    assert set(s["scheduler"]) == {
        "num_waiting", "num_waiting_for_grammar", "num_running", "num_preempted_total",
        "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "num_steps_total",
        "num_computed_tokens_total", "policy", "requests", "num_beam_forks_total",
        "spec_decode", "max_batches_in_flight", "num_scheduled_ahead_total",
        "kv_transfer",  # null without a KV connector
        "num_pooling_running", "num_pooling_waiting", "num_pooling_finished_total"}
    assert set(s["scheduler"]["spec_decode"]) == {
        "num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos",
        "acceptance_rate_per_pos", "mean_acceptance_length", "draft_time_s", "verify_time_s"}
    assert set(s["scheduler"]["requests"][0]) == {
        "id", "state", "priority", "prompt_tokens", "output_tokens", "num_computed_tokens",
        "num_blocks", "cached_tokens", "num_preemptions", "age_s", "ttft_s", "kind"}
    assert set(s["kv_cache"]) == {
        "block_size", "num_blocks", "num_free_blocks", "num_cached_blocks", "usage",
        "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hit_rate",
        "num_shared_blocks", "num_copied_blocks_total", "sliding_window",
        "num_released_blocks_total", "max_blocks_in_use"}
    assert set(s["steps"][0]) == {"batch_size", "prefill_tokens", "decode_tokens", "duration_ms"}
    assert set(s["throughput"]) == {"window_s", "prompt_tokens_per_s", "generation_tokens_per_s"}
    assert set(s["model"]) == {"name", "path", "dtype", "device", "quantization",
                               "max_model_len", "parallel"}
    assert s["model"]["parallel"] is None  # one process: no ranks
    assert set(s["config"]) == {"model", "cache", "parallel", "scheduler", "structured_output"}
    await wait_idle(client)


async def read_events(client: httpx.AsyncClient, n: int, headers=None) -> list[tuple[float, dict]]:
    out: list[tuple[float, dict]] = []
    async with client.stream("GET", "/admin/events", headers=headers) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        event = None
        async for line in r.aiter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                assert event == "stats"
                out.append((time.monotonic(), json.loads(line[6:])))
                if len(out) == n:
                    return out


async def test_events_stream_idle_and_under_load(client):
    await wait_idle(client)
    idle = await read_events(client, 3)
    gaps = [b[0] - a[0] for a, b in zip(idle, idle[1:], strict=False)]
    assert all(0.4 < g < 1.5 for g in gaps), gaps  # every 500 ms when nothing changes
    for _, snap in idle:
        assert_idle(snap)
        assert {"scheduler", "kv_cache", "steps", "throughput", "model", "config"} <= set(snap)
    seen: list[int] = []
    tasks = [asyncio.create_task(stream_forever(client, prompt(i), seen)) for i in range(4)]
    try:
        while (await stats(client))["scheduler"]["num_running"] < 4:
            await asyncio.sleep(0.01)
        busy = await read_events(client, 6)
        # on change: faster than the idle beat (5 gaps of 500 ms would take 2.5 s)
        assert busy[-1][0] - busy[0][0] < 2.0
        assert all(e["scheduler"]["num_running"] == 4 for _, e in busy)
        steps = [e["scheduler"]["num_steps_total"] for _, e in busy]
        assert steps == sorted(steps) and steps[-1] > steps[0]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await wait_idle(client)


async def test_admin_key_and_api_key_fallback(tiny_model_dir):
    serving = ServingConfig(TINY_NAME, api_key="sk-api", admin_key="sk-admin")
    async with serve(tiny_model_dir, serving=serving) as c:
        for path in ("/admin/stats", "/admin/events", "/metrics"):
            for headers in ({}, {"Authorization": "Bearer sk-api"},
                            {"Authorization": "Bearer sk-admin-x"},
                            {"Authorization": "Basic sk-admin"}):
                r = await c.get(path, headers=headers)
                assert r.status_code == 401, (path, headers)
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}
                assert (err["type"], err["code"]) == ("AuthenticationError", 401)
        good = {"Authorization": "Bearer sk-admin"}
        assert (await c.get("/admin/stats", headers=good)).json()["scheduler"]["num_running"] == 0
        assert "pagedserve:num_requests_running" in (await c.get("/metrics", headers=good)).text
        assert (await read_events(c, 1, headers=good))[0][1]["scheduler"]["num_waiting"] == 0
        # the pages hold no data; their scripts ask for the key
        for path in ("/", "/admin", "/static/admin.js", "/static/chat.js", "/static/style.css"):
            r = await c.get(path)
            assert r.status_code == 200, path
        r = await c.get("/admin")
        assert "default-src 'self'" in r.headers["content-security-policy"]
    async with serve(tiny_model_dir, serving=ServingConfig(TINY_NAME, api_key="sk-api")) as c:
        assert (await c.get("/admin/stats")).status_code == 401
        r = await c.get("/admin/stats", headers={"Authorization": "Bearer sk-api"})
        assert r.status_code == 200
