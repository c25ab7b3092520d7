"""No input crashes the server or leaks a block; one request's failure stays its own; clients
that leave (mid-body, mid-stream, 200 at once) are normal events. SIGTERM's drain is in
``test_shutdown.py``, the hypothesis fuzz over request bodies in ``test_fuzz.py``."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import pytest_asyncio

import pagedserve.gpu.model_runner
from pagedserve.actors.engine.async_engine import AsyncEngine
from pagedserve.actors.engine.detokenizer import IncrementalDetokenizer
from pagedserve.gpu.model_runner import ModelRunner
from pagedserve.server.launch import running_server
from pagedserve.server.openai.serving import ServingConfig
from tests.conftest import chat, engine_config, serve, stats, until_stats

MSG = [{"role": "user", "content": "Say something."}]


async def test_sampler_failure_fails_only_its_request(tiny_model_dir, monkeypatch):
    real = pagedserve.gpu.model_runner.sample

    def faulty(logits, rows):  # fault injection: the real sampler, except for one marked row
        if any(r.params.seed == 4242 for r in rows):
            raise RuntimeError("injected sampler fault")
        return real(logits, rows)

    monkeypatch.setattr(pagedserve.gpu.model_runner, "sample", faulty)
    async with serve(tiny_model_dir) as client:
        good = {"messages": MSG, "max_tokens": 30, "ignore_eos": True, "temperature": 0,
                "return_token_ids": True}
        want = (await client.post("/v1/chat/completions", json=good)).json()
        bad = {**good, "temperature": 1.0, "seed": 4242}
        results = await asyncio.gather(
            *[client.post("/v1/chat/completions", json=good) for _ in range(3)],
            client.post("/v1/chat/completions", json=bad),
        )
        for r in results[:3]:
            assert r.status_code == 200
            assert r.json()["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
        assert results[3].status_code == 500
        assert "injected sampler fault" in results[3].json()["error"]["message"]
        lines = []
        async with client.stream("POST", "/v1/chat/completions",
                                 json={**bad, "stream": True}) as r:
            assert r.status_code == 200
            lines = [ln async for ln in r.aiter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["error"]["code"] == 500
        s = await stats(client)
        assert s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"]


async def test_detokenizer_failure_fails_only_its_request(tiny_model_dir, monkeypatch):
    real = IncrementalDetokenizer.update

    def faulty(self, token_ids, final):
        if "BOOM" in self._stops:
            raise ValueError("injected detokenizer fault")
        return real(self, token_ids, final)

    monkeypatch.setattr(IncrementalDetokenizer, "update", faulty)
    async with serve(tiny_model_dir) as client:
        bad = {"messages": MSG, "max_tokens": 50, "ignore_eos": True, "stop": ["BOOM"]}
        other = asyncio.create_task(chat(client, "meanwhile", max_tokens=40, ignore_eos=True))
        r = await client.post("/v1/chat/completions", json=bad)
        assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"
        async with client.stream("POST", "/v1/chat/completions",
                                 json={**bad, "stream": True}) as s:
            lines = [ln async for ln in s.aiter_lines() if ln.startswith("data: ")]
        assert "injected detokenizer fault" in lines[-2] and lines[-1] == "data: [DONE]"
        assert len((await other)["choices"][0]["token_ids"]) == 40
        for _ in range(100):
            s = await stats(client)
            if s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"]:
                break
            await asyncio.sleep(0.01)
        assert s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"]


async def test_tokenizer_failure_fails_only_its_request(tiny_model_dir):
    engine = await AsyncEngine.start(engine_config(tiny_model_dir))
    real = engine.tokenizer.encode  # fault injection: encode fails for one marked prompt

    def faulty(text, *a, **kw):
        if "TOKFAIL" in text:
            raise RuntimeError("injected tokenizer fault")
        return real(text, *a, **kw)

    engine.tokenizer.encode = faulty
    try:
        async with running_server(engine, ServingConfig("tiny-llama")) as url:
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                other = asyncio.create_task(chat(client, "fine", max_tokens=20, ignore_eos=True))
                r = await client.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "TOKFAIL"}]})
                assert r.status_code == 500
                assert "injected tokenizer fault" in r.json()["error"]["message"]
                assert len((await other)["choices"][0]["token_ids"]) == 20
                s = await stats(client)
                assert s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"]
    finally:
        await engine.shutdown()


# -- hostile inputs: each an OpenAI-shaped 4xx, never a 500 ----------------------------------

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
_CHAT_HEAD = b'{"messages": [{"role": "user", "content": '


def _chat_raw(content: bytes, tail: bytes = b"") -> bytes:
    return _CHAT_HEAD + content + b"}]" + tail + b"}"


EMPTY = "Either prompt or prompt_embeds must be provided and non-empty."  # vLLM's words
HOSTILE = [  # (path, raw body, param, words the message must hold)
    (CHAT, b'{"messages": ' + b"[" * 100 + b"]" * 100 + b"}", "messages", "nested deeper"),
    (CHAT, b'{"messages": ' + b"[" * 1000 + b"]" * 1000 + b"}", None, "nested deeper"),
    (CHAT, b"[" * 100_000 + b"]" * 100_000, None, "nested deeper"),
    (CHAT, _chat_raw(b'"hi"', b', "max_tokens": ' + b"7" * 5000), None, "not valid JSON"),
    (CHAT, _chat_raw(b'"a \\ud800 b"'), "messages", "lone surrogate"),
    (CHAT, _chat_raw(b'"a \xed\xa0\x80 b"'), "messages", "lone surrogate"),
    (COMPLETIONS, b'{"prompt": "x\\udfff"}', "prompt", "lone surrogate"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "prompt", "lone surrogate"),
    (CHAT, _chat_raw(b'"hi"', b', "stop": ["\\ud800"]'), "stop", "lone surrogate"),
    (CHAT, _chat_raw(b'"hi"', b', "model": "m\\ud800"'), "model", "lone surrogate"),
    (CHAT, _chat_raw(b'"hi"', '"logit_bias": {"²": 1}'.encode().join([b", ", b""])),
     "logit_bias", "not a token id"),
    (CHAT, _chat_raw(b'"hi"', '"logit_bias": {"¹": 1}'.encode().join([b", ", b""])),
     "logit_bias", "not a token id"),
    (CHAT, _chat_raw(b'"hi"', b', "logit_bias": {"--5": 1}'), "logit_bias", "not a token id"),
    (CHAT, _chat_raw(b'"hi"', '"logit_bias": {"٣": 1}'.encode().join([b", ", b""])),
     "logit_bias", "not a token id"),
    (CHAT, _chat_raw(b'"hi"', b', "min_tokens": 3, "stop_token_ids": [49152]'),
     "stop_token_ids", "token id 49152 is out of vocabulary (the vocabulary has 49152"),
    (CHAT, _chat_raw(b'"hi"', b', "stop_token_ids": [5, -1]'),
     "stop_token_ids", "token id -1 is out of vocabulary (the vocabulary has 49152"),
    (CHAT, _chat_raw(b'"hi"', b', "logit_bias": {"-5": 1}'), "logit_bias", "token id -5"),
    (CHAT, _chat_raw(b'"hi"', b', "logit_bias": {"999999": 1}'), "logit_bias",
     "token id 999999 is out of vocabulary"),
    (CHAT, _chat_raw(b'"hi"', b', "stream": "maybe"'), "stream", "valid boolean"),
    (CHAT, _chat_raw(b'"hi"', b', "stream": 5'), "stream", "valid boolean"),
    (CHAT, _chat_raw(b'"hi"', b', "max_tokens": "12"'), "max_tokens", "valid integer"),
    (CHAT, _chat_raw(b'"hi"', b', "max_tokens": true'), "max_tokens", "valid integer"),
    (CHAT, _chat_raw(b'[{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]'),
     "messages", "text content parts only"),
    (COMPLETIONS, b'{"prompt": ""}', "prompt", EMPTY),
    (COMPLETIONS, b'{"prompt": []}', "prompt", EMPTY),
    (COMPLETIONS, b'{"max_tokens": 3}', "prompt", EMPTY),
    (COMPLETIONS, b'{"prompt": [1, 60000]}', "prompt", "token id 60000 is out of vocabulary"),
    ("/detokenize", b'{"tokens": [-3]}', "tokens", "token id -3 is out of vocabulary"),
]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def hostile_client(tiny_model_dir):
    async with serve(tiny_model_dir, max_model_len=128,
                     app_kwargs={"body_read_timeout_s": 0.5}) as client:
        yield client


@pytest.mark.parametrize("path,raw,param,words", HOSTILE,
                         ids=[f"{i}-{h[0]}" for i, h in enumerate(HOSTILE)])
async def test_hostile_input_is_an_openai_400(hostile_client, path, raw, param, words):
    r = await hostile_client.post(path, content=raw,
                                  headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and err["param"] == param, err
    assert words in err["message"], err


async def test_huge_top_k_means_the_whole_vocabulary(hostile_client, capfd):
    """2⁶³ overflowed int64 in the sampler (and the batch was rerun request by request)."""
    body = {"prompt": "Once upon", "max_tokens": 6, "temperature": 1.0, "seed": 7,
            "ignore_eos": True, "return_token_ids": True}
    huge = await hostile_client.post(COMPLETIONS, json={**body, "top_k": 2**63})
    off = await hostile_client.post(COMPLETIONS, json={**body, "top_k": -1})
    assert huge.status_code == 200, huge.text
    assert huge.json()["choices"][0]["token_ids"] == off.json()["choices"][0]["token_ids"]
    assert "step_failed" not in capfd.readouterr().out  # the batch was not rerun one by one


async def _raw_http(url: str, request: bytes, then_wait: bool = True) -> bytes:
    """Send ``request`` bytes as they are; read the answer until the server closes."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 120)  # a hung server, not a slow one
    finally:
        writer.close()


def _split_response(raw: bytes) -> tuple[int, dict[str, str], dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


@pytest.mark.parametrize("request_bytes,status", [
    (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
     b"content-length: 12abc\r\n\r\n{}", 400),
    (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 65536 + b"\r\n\r\n{}", 431),
])
async def test_malformed_http_gets_an_openai_error_body(hostile_client, request_bytes, status):
    got, headers, body = _split_response(
        await _raw_http(str(hostile_client.base_url), request_bytes))
    assert got == status and headers["content-type"] == "application/json"
    assert body["error"]["code"] == status and body["error"]["message"]
    assert (await hostile_client.get("/health")).status_code == 200


async def test_body_stalled_mid_way_gets_408_and_the_connection_closes(hostile_client):
    """The server (0.5 s body read timeout) answers and hangs up: reading to EOF returns."""
    partial = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
               b"\r\ncontent-length: 100\r\n\r\n{\"prompt\": \"")
    got, headers, body = _split_response(await _raw_http(str(hostile_client.base_url), partial))
    assert got == 408 and body["error"]["type"] == "RequestTimeoutError"
    assert headers.get("connection") == "close"


async def test_client_gone_mid_body_or_mid_stream_is_no_error(tiny_model_dir, capfd):
    """A client closing mid-body, and an ``n = 3`` stream whose client hangs up, are normal
    events: logged as disconnects, without tracebacks, and every block comes back."""
    async with serve(tiny_model_dir, max_model_len=256) as client:
        url = str(client.base_url)
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     b"application/json\r\ncontent-length: 100\r\n\r\n{\"prompt\"")
        await writer.drain()
        writer.close()
        body = {"messages": MSG, "max_tokens": 200, "ignore_eos": True, "n": 3, "stream": True}
        async with client.stream("POST", CHAT, json=body) as r:
            async for line in r.aiter_lines():
                if '"content": "' in line and '"content": ""' not in line:
                    break  # hang up once tokens flow
        await until_stats(client, lambda s: s["scheduler"]["num_running"] == 0
                          and s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"],
                          "freed every block after the hang-ups")
        assert (await chat(client, "still here", max_tokens=2))["choices"]
    out, err = capfd.readouterr()
    assert out.count("client_disconnected") >= 2, out
    for bad in ("Traceback", "unhandled_error", "already running", "stream_failed"):
        assert bad not in out + err, out + err


# -- mass cancellation (vLLM's test_request_cancellation) ------------------------------------

NUM_GONE = 200


async def test_clients_gone_before_admission_are_never_scheduled(tiny_model_dir, monkeypatch):
    """200 clients give up while the scheduler is held in a step; once the step ends, none of
    their requests is ever scheduled (their aborts are in the same mailbox drain as their
    adds), the scheduler ends idle with every block free, and the next request is answered.

    No timing is assumed: the step is held by a gate around the real ``execute_model``; the
    clients give up once all 200 requests wait in the scheduler's mailbox, and the gate opens
    once their 200 aborts are there too."""
    real = ModelRunner.execute_model
    gate, in_step = threading.Event(), threading.Event()
    scheduled: set[str] = set()

    def gated(self, so):
        scheduled.update(sr.req_id for sr in so.scheduled)
        if so.scheduled and not gate.is_set():
            in_step.set()
            assert gate.wait(120), "the test never opened the gate"
        return real(self, so)

    monkeypatch.setattr(ModelRunner, "execute_model", gated)
    engine = await AsyncEngine.start(engine_config(tiny_model_dir, max_model_len=256,
                                                   max_num_seqs=256))
    mailbox = engine.scheduler.mailbox
    try:
        async with running_server(engine, ServingConfig("tiny-llama")) as url:
            async with httpx.AsyncClient(base_url=url, timeout=120,
                                         limits=httpx.Limits(max_connections=None)) as client:
                blocker = asyncio.create_task(chat(client, "hold the step", max_tokens=20))
                assert await asyncio.to_thread(in_step.wait, 120)
                body = {"messages": MSG, "max_tokens": 200, "min_tokens": 200}
                gone = [asyncio.create_task(client.post(
                    CHAT, json=body, headers={"x-request-id": f"gone-{i}"}))
                    for i in range(NUM_GONE)]
                await _until(lambda: mailbox.qsize() >= NUM_GONE, "200 adds in the mailbox")
                for task in gone:  # the clients give up
                    task.cancel()
                await asyncio.gather(*gone, return_exceptions=True)
                await _until(lambda: mailbox.qsize() >= 2 * NUM_GONE, "200 aborts as well")
                gate.set()
                assert len((await blocker)["choices"][0]["token_ids"]) == 20
                last = await chat(client, "after the storm", max_tokens=10)
                assert len(last["choices"][0]["token_ids"]) == 10
                s = await until_stats(client, lambda s: s["scheduler"]["num_running"] == 0
                                      and s["scheduler"]["num_waiting"] == 0, "idle")
                assert s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"]
    finally:
        gate.set()
        await engine.shutdown()
    assert not {r for r in scheduled if r.startswith("gone-")}


async def _until(check, what: str) -> None:
    deadline = time.monotonic() + 120  # a hung server, not a slow one
    while not check():
        assert time.monotonic() < deadline, f"never {what}"
        await asyncio.sleep(0.01)

