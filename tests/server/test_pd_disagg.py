"""Disaggregated prefill/decode end to end: a producer and a consumer instance of the tiny Llama
(float32) with a KV connector between them, ``pagedserve proxy`` in front. Greedy output
equals one instance's for a short and a chunked (> 2,048-token) prompt with both connectors
(and a prompt whose first blocks the decode instance already caches: local hits, then the load),
and the decode instance loads the prompt rather than computing it; a load run with random
client disconnects leaves every block free on both sides (held ones after the hold timeout);
a producer killed mid-transfer is recomputed (or, with ``fail``, a clear error), never a hang.
"""

from __future__ import annotations

import asyncio
import json
import random
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from pagedserve.gpu.kv_connector.config import parse_kv_transfer_config
from pagedserve.server.launch import free_port, start_server_process
from pagedserve.server.proxy import ProxyConfig, running_proxy
from tests.conftest import chat, serve, stream_chat, until_stats
from tests.kv_relay import Relay
from tests.server.test_pd_proxy import num_aborted

BS = 16
LONG_LEN = 2100  # > 2,048: chunked (512-token steps) on both instances
MAX_MODEL_LEN = 2304
PROMPTS = {"short": 70, "long": LONG_LEN, "shared": 88}
SHARED = 48  # "shared" starts with "short"'s first 3 blocks: local prefix-cache hits
CHAT = "Tell me a long story about a dragon who learned to paint with watercolors."


def token_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49000) for _ in range(n)]


def prompt_of(name: str) -> list[int]:
    if name == "shared":
        return prompt_of("short")[:SHARED] + token_prompt(PROMPTS[name] - SHARED, 99)
    return token_prompt(PROMPTS[name], list(PROMPTS).index(name))


def kv_config(connector: str, role: str, tmp: Path, **extra) -> str:
    """``--kv-transfer-config`` JSON for ``connector`` in ``role``."""
    port = extra.pop("port", None)
    timeout_s = extra.pop("timeout_s", 10.0)
    if connector == "TCPConnector":
        ce = {"port": port or free_port(), "timeout_s": timeout_s}
    else:
        ce = {"shared_storage_path": str(tmp)}
    return json.dumps({"kv_connector": connector, "kv_role": role,
                       "kv_connector_extra_config": ce, **extra})


def instance(model_dir: Path, kv: str | None = None):
    return serve(model_dir, max_model_len=MAX_MODEL_LEN, num_blocks=400,
                 kv_transfer_config=parse_kv_transfer_config(kv) if kv else None)


@asynccontextmanager
async def deployment(model_dir: Path, connector: str, tmp: Path, **extra):
    """(proxy, producer, consumer) clients: a whole P/D deployment in this process."""
    async with instance(model_dir, kv_config(connector, "kv_producer", tmp, **extra)) as p, \
            instance(model_dir, kv_config(connector, "kv_consumer", tmp, **extra)) as d:
        config = ProxyConfig([str(p.base_url)], [str(d.base_url)], port=free_port())
        async with running_proxy(config) as url, httpx.AsyncClient(base_url=url,
                                                                   timeout=120) as proxy:
            yield proxy, p, d


async def complete(client: httpx.AsyncClient, ids: list[int], max_tokens: int = 8,
                   **body) -> dict:
    r = await client.post("/v1/completions", json={
        "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def idle(s: dict) -> bool:
    kv, sched = s["kv_cache"], s["scheduler"]
    return (kv["num_free_blocks"] == kv["num_blocks"] and not sched["num_running"]
            and not sched["num_waiting"] and not sched["kv_transfer"]["num_held_blocks"]
            and not sched["kv_transfer"]["num_waiting_for_remote_kvs"])


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def want(tiny_model_dir) -> dict[str, list[int]]:
    """One instance's greedy tokens per prompt (no connector, no proxy)."""
    async with instance(tiny_model_dir) as client:
        out = {name: (await complete(client, prompt_of(name)))["choices"][0]["token_ids"]
               for name in PROMPTS}
        body = await chat(client, CHAT, max_tokens=12)
        out["chat"] = body["choices"][0]["token_ids"]
        out["chat_prompt_len"] = [body["usage"]["prompt_tokens"]]
        return out


@pytest.mark.parametrize("connector", ["TCPConnector", "SharedStorageConnector"])
async def test_pd_through_the_proxy_equals_one_instance(tiny_model_dir, tmp_path, want,
                                                        connector):
    async with deployment(tiny_model_dir, connector, tmp_path) as (proxy, producer, consumer):
        for name in PROMPTS:  # "shared" after "short": local hits, then the load
            body = await complete(proxy, prompt_of(name))
            assert body["choices"][0]["token_ids"] == want[name], name
        _, tokens, _ = await stream_chat(proxy, CHAT, max_tokens=12)  # chat, streamed
        assert tokens == want["chat"]
        s = await until_stats(consumer, idle, "the consumer idle")
        await until_stats(producer, idle, "the producer idle, its holds released")
    t = s["scheduler"]["kv_transfer"]
    lengths = [*PROMPTS.values(), *want["chat_prompt_len"]]
    full = sum((n - 1) // BS * BS for n in lengths)  # all but the last token's block
    assert t["num_loaded_prompt_tokens_total"] == full - SHARED  # loaded, not computed
    assert t["num_computed_prompt_tokens_total"] == sum(lengths) - full
    assert t["num_failed_loads_total"] == 0


async def test_random_client_disconnects_leave_every_block_free(tiny_model_dir, tmp_path):
    """Clients leave at random points (before any answer: mid-prefill or mid-transfer; or
    after a few tokens); prefills whose decode never comes are held until the timeout."""
    rng = random.Random(7)
    async with deployment(tiny_model_dir, "TCPConnector", tmp_path,
                          kv_hold_timeout_s=1.0) as (proxy, producer, consumer):

        async def one(i: int) -> None:
            leave_after = rng.choice([0, 0, 1, 3, None])  # chunks read; None: to the end
            payload = {"prompt": token_prompt(rng.randrange(20, 300), 100 + i),
                       "max_tokens": 120, "temperature": 0, "ignore_eos": True, "stream": True}
            req = asyncio.ensure_future(_stream(proxy, payload, leave_after))
            if leave_after == 0:
                await asyncio.sleep(0)  # the request is on its way: leave before any answer
                req.cancel()
            try:
                await req
            except asyncio.CancelledError:
                pass

        aborted = await num_aborted(consumer)
        await asyncio.gather(*(one(i) for i in range(12)))
        for client in (producer, consumer):
            s = await until_stats(client, idle, "every block free")
            assert s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"]
        assert await num_aborted(consumer) > aborted  # the clients' leaving reached it


async def _stream(proxy: httpx.AsyncClient, payload: dict, leave_after: int | None) -> None:
    async with proxy.stream("POST", "/v1/completions", json=payload) as r:
        assert r.status_code == 200
        n = 0
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                n += 1
                if leave_after is not None and n >= leave_after:
                    return


async def test_a_producer_killed_mid_transfer_is_recomputed(tiny_model_dir, tmp_path, want):
    """The producer is a real process, killed (SIGKILL) once part of the blocks went out; the
    consumer recomputes the prompt: the same tokens, and no hang."""
    kv_port = free_port()
    proc, url = start_server_process([
        str(tiny_model_dir), "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
        "--num-gpu-blocks-override", "400", "--kv-transfer-config",
        kv_config("TCPConnector", "kv_producer", tmp_path, port=kv_port)])
    ids = token_prompt(LONG_LEN, 1)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=120) as producer:
            params = (await complete(producer, ids, max_tokens=1,
                                     kv_transfer_params={"do_remote_decode": True})
                      )["kv_transfer_params"]
        relay = Relay(kv_port, limit=100_000, close=False)  # then silent until the kill
        async with instance(tiny_model_dir, kv_config("TCPConnector", "kv_consumer",
                                                      tmp_path)) as consumer:
            answer = asyncio.ensure_future(complete(
                consumer, ids, kv_transfer_params={**params, "remote_port": relay.port}))
            # Mid-transfer (the timeout only catches a pull that never started).
            assert await asyncio.to_thread(relay.cut.wait, 120), "the pull never came"
            proc.kill()
            proc.wait()
            relay.close()  # the dead producer's connection ends
            assert (await answer)["choices"][0]["token_ids"] == want["long"]
            s = await until_stats(consumer, idle, "the consumer idle")
            assert s["scheduler"]["kv_transfer"]["num_failed_loads_total"] == 1
    finally:
        proc.kill()
        proc.wait()


async def test_a_silent_producer_fails_the_request_under_policy_fail(tiny_model_dir, tmp_path):
    """``kv_load_failure_policy: fail``: the request ends with a clear error once the socket
    timeout passes (the producer stopped sending mid-transfer), and the consumer serves on."""
    ids = token_prompt(300, 3)
    async with instance(tiny_model_dir, kv_config("TCPConnector", "kv_producer", tmp_path,
                                                  kv_hold_timeout_s=1.0)) as producer:
        params = (await complete(producer, ids, max_tokens=1,
                                 kv_transfer_params={"do_remote_decode": True}))[
            "kv_transfer_params"]
        relay = Relay(params["remote_port"], limit=5_000, close=False)
        kv = kv_config("TCPConnector", "kv_consumer", tmp_path, timeout_s=0.5,
                       kv_load_failure_policy="fail")
        async with instance(tiny_model_dir, kv) as consumer:
            r = await consumer.post("/v1/completions", json={
                "prompt": ids, "max_tokens": 4, "temperature": 0,
                "kv_transfer_params": {**params, "remote_port": relay.port}})
            assert r.status_code == 500 and "KV transfer failed" in r.json()["error"]["message"]
            assert (await complete(consumer, ids, max_tokens=2))["choices"][0]["token_ids"]
            await until_stats(consumer, idle, "the consumer idle")
        relay.close()
        await until_stats(producer, idle, "the producer's hold released by its timeout")
