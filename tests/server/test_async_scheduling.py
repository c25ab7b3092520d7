"""``--async-scheduling`` through a real server (tiny model, float32): the scheduler builds step
k+1 while step k runs (``actors/core/inflight.py``), and the output is the synchronous loop's,
token for token: batched, chunked-prefill, prefix-cached and preempted greedy requests equal
transformers'; stop tokens, ``max_tokens`` and stop strings that end a request while its next
decode is in flight, ``n > 1`` and seeded sampling equal a synchronous server's; a client that
goes away mid-flight leaves every block free."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import httpx
import pytest
import pytest_asyncio

from pagedserve.actors.core.config import SchedulerConfig
from pagedserve.actors.core.inflight import in_flight_depth
from pagedserve.actors.engine.async_engine import AsyncEngine
from pagedserve.actors.spec_decode.config import parse_speculative_config
from pagedserve.server.launch import running_server
from pagedserve.server.openai.serving import ServingConfig
from tests.conftest import (
    TINY_NAME,
    chat,
    chat_prompt_ids,
    engine_config,
    hf_greedy,
    stats,
    stream_chat,
    until_stats,
)

PROMPTS = [f"Request number {i}: tell me about {w}" for i, w in
           enumerate(["cats", "dogs", "the sea", "mountains", "rain", "paging"])]
LONG = " ".join(f"word{i}" for i in range(22))  # ~90 tokens: chunked at 32 a step
# 12 blocks of 16 tokens: two ~100-token requests at once, so the batch preempts.
SMALL = dict(num_blocks=12, max_model_len=144, max_num_batched_tokens=32)


@asynccontextmanager
async def serve_tiny(model_dir, async_scheduling: bool):
    config = engine_config(model_dir, **SMALL)
    config.scheduler.async_scheduling = async_scheduling
    engine = await AsyncEngine.start(config)
    try:
        async with running_server(engine, ServingConfig(TINY_NAME)) as url:
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                yield client
    finally:
        await engine.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def servers(tiny_model_dir):
    """``(async, sync)`` clients of two servers of the same tiny model and settings."""
    async with serve_tiny(tiny_model_dir, True) as a, serve_tiny(tiny_model_dir, False) as s:
        yield a, s


async def both(servers, prompt: str, **body) -> list[dict]:
    """The same chat completion from the async and the sync server (in that order)."""
    return list(await asyncio.gather(*(chat(c, prompt, **body) for c in servers)))


def choices(resp: dict) -> list[tuple]:
    return [(c["message"]["content"], c["token_ids"], c["finish_reason"])
            for c in resp["choices"]]


async def test_greedy_batched_chunked_preempted_equal_transformers(servers, tiny_model_dir):
    client = servers[0]
    prompts = [*PROMPTS, LONG]
    wants = [hf_greedy(tiny_model_dir, chat_prompt_ids(tiny_model_dir, p), 40) for p in prompts]
    results = await asyncio.gather(
        *(stream_chat(client, p, max_tokens=40, ignore_eos=True) for p in prompts))
    for (_, tokens, _), want, p in zip(results, wants, prompts):
        assert tokens == want[:40], p
    s = await stats(client)
    sched = s["scheduler"]
    assert sched["num_preempted_total"] > 0
    assert sched["max_batches_in_flight"] == 2 and sched["num_scheduled_ahead_total"] > 0
    assert s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"]
    sync = (await stats(servers[1]))["scheduler"]
    assert sync["max_batches_in_flight"] <= 1 and sync["num_scheduled_ahead_total"] == 0


async def test_prefix_cached_request_equals_transformers(servers, tiny_model_dir):
    client = servers[0]
    want = hf_greedy(tiny_model_dir, chat_prompt_ids(tiny_model_dir, LONG), 16)
    before = (await stats(client))["kv_cache"]["prefix_cache_hits"]
    for _ in range(2):
        _, tokens, _ = await stream_chat(client, LONG, max_tokens=16, ignore_eos=True)
        assert tokens == want[:16]
    assert (await stats(client))["kv_cache"]["prefix_cache_hits"] > before


async def test_finishing_while_the_next_decode_is_in_flight_equals_sync(servers):
    """max_tokens, a stop token id and a stop string each end a request one step before the
    decode built ahead of it: the async output is the sync one, token for token."""
    (_, base, _), = choices((await both(servers, PROMPTS[1], max_tokens=24,
                                        ignore_eos=True))[1])
    stop_id = base[7]
    stop_text = (await chat(servers[1], PROMPTS[1], max_tokens=24, ignore_eos=True)
                 )["choices"][0]["message"]["content"][10:14]
    cases = [dict(max_tokens=n, ignore_eos=True) for n in (1, 2, 5)]
    cases += [dict(max_tokens=24, ignore_eos=True, stop_token_ids=[stop_id]),
              dict(max_tokens=24, ignore_eos=True, stop=[stop_text]),
              dict(max_tokens=24)]
    for body in cases:
        results = await asyncio.gather(*(both(servers, p, **body) for p in PROMPTS[:3]))
        for async_resp, sync_resp in results:
            assert choices(async_resp) == choices(sync_resp), body
    s = await stats(servers[0])
    assert s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"]


async def test_n_and_seeded_sampling_equal_sync(servers):
    body = dict(max_tokens=20, temperature=1.0, seed=1234, n=3, ignore_eos=True)
    async_resp, sync_resp = await both(servers, PROMPTS[2], **body)
    assert len(async_resp["choices"]) == 3
    assert choices(async_resp) == choices(sync_resp)
    pen = dict(max_tokens=20, temperature=0, repetition_penalty=1.5, ignore_eos=True)
    async_resp, sync_resp = await both(servers, PROMPTS[3], **pen)
    assert choices(async_resp) == choices(sync_resp)


async def test_clients_leaving_mid_flight_free_every_block(servers):
    client = servers[0]

    async def leave_after(n_chunks: int, prompt: str) -> None:
        payload = {"messages": [{"role": "user", "content": prompt}], "stream": True,
                   "max_tokens": 100, "ignore_eos": True, "temperature": 0}
        async with client.stream("POST", "/v1/chat/completions", json=payload) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= n_chunks:
                    break  # closing the stream: the server sees the client go

    await asyncio.gather(*(leave_after(2 + i, p) for i, p in enumerate(PROMPTS[:4])))
    s = await until_stats(client, lambda s: s["scheduler"]["num_running"] == 0
                          and s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"],
                          "every block free after the aborts")
    assert s["scheduler"]["num_waiting"] == 0


def test_refused_with_speculative_decoding_or_several_ranks():
    spec = SchedulerConfig(async_scheduling=True,
                           speculative=parse_speculative_config('{"method": "ngram"}'))
    with pytest.raises(ValueError, match="--speculative-config"):
        in_flight_depth(spec, object())

    class Pipeline:  # what the multi-process executor tells the scheduler
        pipeline_depth = 2

    class TensorParallel:  # -tp alone: no stages, and no rank fills PREV_SAMPLED
        pipeline_depth = 1

    with pytest.raises(ValueError, match="one rank"):
        in_flight_depth(SchedulerConfig(async_scheduling=True), TensorParallel())
    assert in_flight_depth(SchedulerConfig(async_scheduling=True), Pipeline()) == (2, False)
    assert in_flight_depth(SchedulerConfig(), Pipeline()) == (1, False)


async def test_failed_step_fails_only_its_request_with_the_next_in_flight(tiny_model_dir,
                                                                          monkeypatch):
    """A step that raises while the next one is in flight: the newer step's output is
    dropped, the failed one rerun request by request, and only the faulty request fails."""
    import pagedserve.gpu.model_runner as model_runner

    real = model_runner.sample

    def faulty(logits, rows):  # the real sampler, except for one marked row
        if any(r.params.seed == 4242 for r in rows):
            raise RuntimeError("injected sampler fault")
        return real(logits, rows)

    monkeypatch.setattr(model_runner, "sample", faulty)
    async with serve_tiny(tiny_model_dir, True) as client:
        good = dict(max_tokens=30, ignore_eos=True)
        want = (await chat(client, PROMPTS[0], **good))["choices"][0]["token_ids"]
        bad = {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 30,
               "temperature": 1.0, "seed": 4242}
        results = await asyncio.gather(*(chat(client, PROMPTS[0], **good) for _ in range(3)),
                                       client.post("/v1/chat/completions", json=bad))
        assert all(r["choices"][0]["token_ids"] == want for r in results[:3])
        assert results[3].status_code == 500
        assert "injected sampler fault" in results[3].json()["error"]["message"]
        s = await stats(client)
        assert s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"]
        assert s["scheduler"]["num_scheduled_ahead_total"] > 0
