"""The whole engine on the tiny random Llama, through a real Hypercorn server on loopback.

Every scheduling feature must leave greedy outputs equal to transformers' ``generate``.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import pytest_asyncio

from tests.conftest import (
    TINY_NAME,
    chat,
    chat_prompt_ids,
    hf_greedy,
    serve,
    stats,
    stream_chat,
    until_stats,
)

PROMPTS = [
    "Hi",
    "What is the capital of France?",
    "Tell me a long story about a dragon who learned to paint with watercolors.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "Écris un poème sur la mer 🌊",
    "Why?",
    "List three colours.",
    "Explain paged attention in one sentence, please, and be brief about it.",
]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def client(tiny_model_dir):
    async with serve(tiny_model_dir) as c:
        yield c


async def wait_idle(client: httpx.AsyncClient, timeout: float = 120.0) -> dict:
    """Poll /admin/stats until every block is free; ``timeout`` only catches a hung server (a
    loaded machine may take its time)."""
    deadline = time.monotonic() + timeout
    while True:
        s = await stats(client)
        kv = s["kv_cache"]
        if kv["num_free_blocks"] == kv["num_blocks"] and s["scheduler"]["num_running"] == 0:
            return s
        assert time.monotonic() < deadline, f"blocks not freed in {timeout}s: {s}"
        await asyncio.sleep(0.02)


async def test_greedy_parity_with_transformers(client, tiny_model_dir):
    for prompt in PROMPTS[:5]:
        body = await chat(client, prompt, max_tokens=24)
        want = hf_greedy(tiny_model_dir, chat_prompt_ids(tiny_model_dir, prompt), 24)
        assert body["choices"][0]["token_ids"] == want, prompt
        assert body["prompt_token_ids"] == chat_prompt_ids(tiny_model_dir, prompt)
        assert body["usage"]["completion_tokens"] == len(want)


async def test_float16_on_the_cpu_serves(tiny_model_dir):
    """float16 runs the torch reference path on the CPU (our kernels take float32/bfloat16):
    it answers, and its greedy tokens mostly agree with float32's."""
    async with serve(tiny_model_dir, dtype="float16") as client:
        body = await chat(client, PROMPTS[0], max_tokens=12)
        s = await stats(client)
    assert s["model"]["dtype"] == "float16" and s["model"]["quantization"] == "none"
    got = body["choices"][0]["token_ids"]
    want = hf_greedy(tiny_model_dir, chat_prompt_ids(tiny_model_dir, PROMPTS[0]), 12)
    assert len(got) == len(want) == 12 and got[:4] == want[:4]


async def test_stream_concatenation_equals_non_stream(client):
    for prompt in PROMPTS[3:6]:
        full = await chat(client, prompt, max_tokens=30)
        text, tokens, chunks = await stream_chat(client, prompt, max_tokens=30)
        assert text == full["choices"][0]["message"]["content"]
        assert tokens == full["choices"][0]["token_ids"]
        assert "\ufffd" not in text
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)


async def test_continuous_batching_matches_single_requests(client):
    lengths = [5, 40, 12, 60, 8, 25, 33, 17]
    singles = [
        (await chat(client, p, max_tokens=n, ignore_eos=True))["choices"][0]["token_ids"]
        for p, n in zip(PROMPTS, lengths)
    ]
    results = await asyncio.gather(
        *(stream_chat(client, p, max_tokens=n, ignore_eos=True) for p, n in zip(PROMPTS, lengths))
    )
    for (_, tokens, _), want, n in zip(results, singles, lengths):
        assert tokens == want and len(tokens) == n
    await wait_idle(client)


async def test_late_arrival_streams_before_running_requests_finish(client):
    done_at: dict[str, float] = {}

    async def long(i: int) -> None:
        await stream_chat(client, PROMPTS[i], max_tokens=300, ignore_eos=True)
        done_at[f"long{i}"] = time.monotonic()

    tasks = [asyncio.create_task(long(i)) for i in range(3)]
    await until_stats(client, lambda s: s["scheduler"]["num_running"] == 3, "three decoding")
    first_token_at = None
    payload = {"messages": [{"role": "user", "content": "late"}], "stream": True,
               "max_tokens": 4, "temperature": 0}
    async with client.stream("POST", "/v1/chat/completions", json=payload) as r:
        async for line in r.aiter_lines():
            if '"content": "' in line and '"role"' not in line:
                first_token_at = time.monotonic()
                break
    assert first_token_at is not None
    assert not done_at, "a running request finished before the late one streamed"
    await asyncio.gather(*tasks)
    assert min(done_at.values()) > first_token_at


async def test_seeded_sampling_is_reproducible(client):
    a = await chat(client, "Say something", temperature=1.0, seed=7, max_tokens=20)
    b = await chat(client, "Say something", temperature=1.0, seed=7, max_tokens=20)
    c = await chat(client, "Say something", temperature=1.0, seed=8, max_tokens=20)
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    assert a["choices"][0]["token_ids"] != c["choices"][0]["token_ids"]


async def test_top_k_1_is_greedy(client):
    greedy = await chat(client, PROMPTS[2], max_tokens=15)
    top1 = await chat(client, PROMPTS[2], temperature=1.5, top_k=1, max_tokens=15)
    assert top1["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"]


async def test_stop_string_and_stop_token(client):
    full = (await chat(client, PROMPTS[1], max_tokens=30, ignore_eos=True))["choices"][0]
    text = full["message"]["content"]
    stop = text[8:11]  # some text in the middle, likely spanning tokens
    cut = await chat(client, PROMPTS[1], max_tokens=30, ignore_eos=True, stop=[stop])
    assert cut["choices"][0]["message"]["content"] == text[: text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"
    streamed, _, _ = await stream_chat(client, PROMPTS[1], max_tokens=30, ignore_eos=True,
                                       stop=stop)
    assert streamed == text[: text.index(stop)]
    token = full["token_ids"][5]
    by_id = await chat(client, PROMPTS[1], max_tokens=30, ignore_eos=True, stop_token_ids=[token])
    ids = by_id["choices"][0]["token_ids"]
    assert ids == full["token_ids"][: full["token_ids"].index(token) + 1]
    assert by_id["choices"][0]["finish_reason"] == "stop"
    await wait_idle(client)


async def test_completions_endpoint(client, tiny_model_dir):
    from tests.conftest import hf_tokenizer

    r = await client.post("/v1/completions", json={
        "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0,
        "return_token_ids": True, "ignore_eos": True})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion"
    ids = hf_tokenizer(str(tiny_model_dir)).encode("Once upon a time")
    assert body["choices"][0]["token_ids"] == hf_greedy(tiny_model_dir, ids, 10)
    assert body["choices"][0]["finish_reason"] == "length"
    chunks = []
    async with client.stream("POST", "/v1/completions", json={
            "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0,
            "ignore_eos": True, "stream": True}) as s:
        async for line in s.aiter_lines():
            if line.startswith("data: {"):
                chunks.append(httpx.Response(200, content=line[6:]).json())
    assert "".join(c["choices"][0]["text"] for c in chunks) == body["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_models_and_health(client):
    r = await client.get("/v1/models")
    assert r.json()["data"][0]["id"] == "tiny-llama"
    assert (await client.get("/health")).status_code == 200


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"messages": [{"role": "user", "content": "x"}], "model": "nope"}, 404, "model"),
        ({"model": "tiny-llama"}, 400, "messages"),
        ({"messages": [{"role": "user"}]}, 400, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 9}, 400, "temperature"),
        ({"messages": [{"role": "user", "content": "x " * 600}]}, 400, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "priority": 3}, 400, "priority"),
    ],
)
async def test_bad_input_gets_openai_error(client, body, status, param):
    for stream in (False, True):
        r = await client.post("/v1/chat/completions", json={**body, "stream": stream})
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["param"] == param and err["code"] == status and err["message"]
    await wait_idle(client)
    assert (await chat(client, "still serving?", max_tokens=3))["choices"][0]["message"]


async def test_body_not_json(client):
    for raw in (b"{not json", b"\xff\xfe", b"[1, 2]"):
        r = await client.post("/v1/chat/completions", content=raw,
                              headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    r = await client.post("/v1/completions", json={"max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


async def num_aborted(client: httpx.AsyncClient) -> float:
    """Requests ended by their client going away, from /metrics."""
    line = f'pagedserve:request_success_total{{finished_reason="abort",model_name="{TINY_NAME}"}}'
    text = (await client.get("/metrics")).text
    return next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)), 0.0)


async def test_stream_disconnect_frees_blocks(client):
    idle = await wait_idle(client)
    aborted = await num_aborted(client)
    payload = {"messages": [{"role": "user", "content": PROMPTS[2]}], "stream": True,
               "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    async with client.stream("POST", "/v1/chat/completions", json=payload) as r:
        n = 0
        async for line in r.aiter_lines():
            n += line.startswith("data: ")
            if n == 5:
                break
        busy = await stats(client)
        assert busy["scheduler"]["num_running"] == 1
        assert busy["kv_cache"]["num_free_blocks"] < idle["kv_cache"]["num_free_blocks"]
    # leaving the block closes the connection mid-stream
    after = await wait_idle(client)
    assert after["kv_cache"]["num_free_blocks"] == idle["kv_cache"]["num_free_blocks"]
    assert await num_aborted(client) == aborted + 1  # freed by the abort, not by running out


async def test_non_stream_disconnect_frees_blocks(client):
    await wait_idle(client)
    aborted = await num_aborted(client)
    payload = {"messages": [{"role": "user", "content": PROMPTS[2]}],
               "max_tokens": 450, "ignore_eos": True, "temperature": 0}
    task = asyncio.create_task(client.post("/v1/chat/completions", json=payload))
    await until_stats(client, lambda s: s["scheduler"]["num_running"] == 1, "it running")
    assert not task.done(), task.result().text
    await asyncio.sleep(0.1)
    task.cancel()  # the client gives up: httpx closes the connection
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_idle(client)
    assert await num_aborted(client) == aborted + 1  # freed by the abort, not by running out
