"""``pagedserve proxy`` over two real instances of the tiny Llama without a connector: the
decode instance recomputes the prompt, so everything a client sees must equal one instance's
answer (greedy), through curl-like httpx, the openai client and the chat page's routes; errors
come back OpenAI-shaped with their status; a client that leaves frees both instances."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import pytest_asyncio

from pagedserve.server.launch import free_port
from pagedserve.server.proxy import ProxyConfig, prefill_body, running_proxy
from tests.conftest import TINY_NAME, chat, serve, stats, stream_chat

PROMPTS = ["Hi", "What is the capital of France?", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15"]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def deployment(tiny_model_dir):
    """(proxy client, prefill client, decode client)."""
    async with serve(tiny_model_dir) as prefill, serve(tiny_model_dir) as decode:
        config = ProxyConfig([str(prefill.base_url)], [str(decode.base_url)],
                             port=free_port())
        async with running_proxy(config) as url:
            async with httpx.AsyncClient(base_url=url, timeout=120) as proxy:
                yield proxy, prefill, decode


async def num_aborted(client: httpx.AsyncClient) -> float:
    """Requests the instance ended as ``abort`` (its client went away), from ``/metrics``."""
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith("pagedserve:request_success_total") and '"abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no abort counter in /metrics")


async def idle(client: httpx.AsyncClient) -> dict:
    """Stats once nothing runs or waits and every block is free (a state, not a duration)."""
    while True:
        s = await stats(client)
        kv = s["kv_cache"]
        if (kv["num_free_blocks"] == kv["num_blocks"] and not s["scheduler"]["num_running"]
                and not s["scheduler"]["num_waiting"]):
            return s
        await asyncio.sleep(0.01)


def test_the_prefill_copy_asks_for_one_token_and_a_remote_decode():
    body = {"messages": [], "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": 50, "min_tokens": 5}
    p = prefill_body(body)
    assert p["max_tokens"] == p["max_completion_tokens"] == 1 and p["stream"] is False
    assert p["kv_transfer_params"]["do_remote_decode"] is True
    assert "stream_options" not in p and "min_tokens" not in p
    assert body["max_tokens"] == 50 and "kv_transfer_params" not in body  # a copy
    config = ProxyConfig(["http://a/", "http://b"], ["http://c"])
    assert [config.next_url("prefill") for _ in range(3)] == ["http://a", "http://b", "http://a"]


async def test_greedy_output_through_the_proxy_equals_one_instance(deployment):
    proxy, _, decode = deployment
    for prompt in PROMPTS:
        want = (await chat(decode, prompt, max_tokens=20))["choices"][0]["token_ids"]
        assert (await chat(proxy, prompt, max_tokens=20))["choices"][0]["token_ids"] == want
        _, tokens, _ = await stream_chat(proxy, prompt, max_tokens=20)
        assert tokens == want
    r = await proxy.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 12,
                                                  "temperature": 0})
    direct = await decode.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 12,
                                                        "temperature": 0})
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]


async def test_openai_client_and_the_chat_pages_routes_work_through_it(deployment):
    proxy, _, decode = deployment
    client = openai.AsyncOpenAI(base_url=f"{proxy.base_url}/v1", api_key="unused")
    models = await client.models.list()
    assert [m.id for m in models.data] == [TINY_NAME]
    stream = await client.chat.completions.create(
        model=TINY_NAME, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=16,
        temperature=0, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    want = (await chat(decode, PROMPTS[1], max_tokens=16))["choices"][0]["message"]["content"]
    assert text == want
    page = await proxy.get("/")
    assert page.status_code == 200 and "chat.js" in page.text
    assert (await proxy.get("/health")).status_code == 200


async def test_upstream_errors_come_back_openai_shaped(deployment):
    proxy, _, _ = deployment
    r = await proxy.post("/v1/chat/completions", json={
        "model": "no-such-model", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = await proxy.post("/v1/completions", json={"prompt": "x", "max_tokens": 10**6})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    r = await proxy.post("/v1/completions", content=b"{not json")
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]


async def test_an_unreachable_instance_is_a_502_and_unhealthy(deployment):
    _, prefill, _ = deployment
    config = ProxyConfig([str(prefill.base_url)], [f"http://127.0.0.1:{free_port()}"],
                         port=free_port())
    async with running_proxy(config) as url, httpx.AsyncClient(base_url=url) as proxy:
        r = await proxy.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 502 and "did not answer" in r.json()["error"]["message"]
        assert (await proxy.get("/health")).status_code == 503
    await idle(prefill)


async def test_a_client_that_leaves_mid_stream_frees_both_instances(deployment):
    proxy, prefill, decode = deployment
    before = await num_aborted(decode)
    payload = {"messages": [{"role": "user", "content": PROMPTS[2]}], "stream": True,
               "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    async with proxy.stream("POST", "/v1/chat/completions", json=payload) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get(
                    "content"):
                break  # decoding on the decode instance: leave
    while await num_aborted(decode) == before:  # the decode instance saw its client go
        await asyncio.sleep(0.01)
    await idle(decode)
    await idle(prefill)


@pytest.mark.parametrize("path", ["/v1/models", "/version"])
async def test_get_routes_are_a_decode_instances(deployment, path):
    proxy, _, decode = deployment
    assert (await proxy.get(path)).json() == (await decode.get(path)).json()
