"""No input crashes the server or leaks a block; one request's failure stays its own; SIGTERM
drains and exits cleanly."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pagedserve.gpu.model_runner
from pagedserve.actors.detokenizer import IncrementalDetokenizer
from pagedserve.actors.engine import AsyncEngine
from pagedserve.server.launch import running_server, start_server_process
from pagedserve.server.serving import ServingConfig
from tests.conftest import chat, engine_config, serve, stats

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


# -- property-based: any body gets a completion or a 4xx error object, never a 500 ---------

_any = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3),
    max_leaves=6,
)
_fields = {
    "model": st.sampled_from(["tiny-llama", "other"]) | _any,
    "messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "bogus"]),
         "content": st.text(max_size=30) | _any}), max_size=3) | _any,
    "prompt": st.text(max_size=30) | st.lists(st.integers(-5, 60000), max_size=5) | _any,
    "max_tokens": st.integers(-2, 6) | _any, "temperature": st.floats(-1, 3) | _any,
    "top_p": st.floats(-0.5, 1.5) | _any, "top_k": st.integers(-3, 50) | _any,
    "min_p": st.floats(-1, 2) | _any, "n": st.integers(-1, 3) | _any,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=3) | _any,
    "stream": st.booleans() | _any, "logprobs": st.booleans() | st.integers(-1, 25) | _any,
    "top_logprobs": st.integers(-1, 25) | _any, "seed": st.integers() | _any,
    "logit_bias": st.dictionaries(st.text(max_size=6), st.floats(-200, 200), max_size=2) | _any,
    "stop_token_ids": st.lists(st.integers(-3, 60000), max_size=3) | _any,
    "min_tokens": st.integers(-1, 10) | _any, "echo": st.booleans() | _any,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | _any,
    "repetition_penalty": st.floats(-1, 3) | _any, "presence_penalty": st.floats(-3, 3) | _any,
    "continue_final_message": st.booleans() | _any, "cache_salt": st.text(max_size=4) | _any,
}
_bodies = st.fixed_dictionaries({}, optional=_fields)


class _ServerThread:
    """An engine and a real server in a thread of their own, for synchronous hypothesis."""

    def __init__(self, model_dir: Path):
        self.ready = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stop: asyncio.Event | None = None
        self.url = ""
        self.thread = threading.Thread(target=asyncio.run, args=(self._main(model_dir),),
                                       daemon=True)
        self.thread.start()
        assert self.ready.wait(60)

    async def _main(self, model_dir: Path) -> None:
        self.loop, self.stop = asyncio.get_running_loop(), asyncio.Event()
        engine = await AsyncEngine.start(engine_config(model_dir, max_model_len=128))
        async with running_server(engine, ServingConfig("tiny-llama")) as url:
            self.url = url
            self.ready.set()
            await self.stop.wait()
        await engine.shutdown()

    def close(self) -> None:
        assert self.loop is not None and self.stop is not None
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)


@pytest.fixture(scope="module")
def threaded_server(tiny_model_dir):
    server = _ServerThread(tiny_model_dir)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client
    server.close()


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_bodies, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_fuzzed_bodies_never_500(threaded_server, body, path):
    r = threaded_server.post(path, content=json.dumps(body, allow_nan=True),
                             headers={"content-type": "application/json"})
    assert r.status_code in (200, 400, 404), (r.status_code, r.text)
    if r.status_code != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == r.status_code
    elif body.get("stream") is True:
        assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text
    else:
        assert r.json()["choices"]


def test_fuzzing_leaked_no_block(threaded_server):
    deadline = time.monotonic() + 120  # a hung server, not a slow one
    while True:  # aborted streams may take one scheduler step to be freed
        s = threaded_server.get("/admin/stats").json()
        if s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"]:
            break
        assert time.monotonic() < deadline, s
        time.sleep(0.05)
    assert s["scheduler"]["num_running"] == s["scheduler"]["num_waiting"] == 0


# -- SIGTERM ----------------------------------------------------------------------------------

SHORT_TOKENS = 100
SIGTERM_AT_LEFT = 20  # tokens the short request may still have to make when the drain starts
DRAIN_S = 8


def _stream(url: str, max_tokens: int, lines: list[str], started: threading.Event,
            nearly_done: threading.Event | None = None) -> None:
    """A streamed chat with usage on every chunk; sets ``started`` at its first token and
    ``nearly_done`` once ``SIGTERM_AT_LEFT`` or fewer tokens remain."""
    body = {"messages": MSG, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=300, json=body) as r:
            for line in r.iter_lines():
                lines.append(line)
                usage = json.loads(line[6:]).get("usage") if line.startswith("data: {") else None
                if usage and usage["completion_tokens"] > 0:
                    started.set()
                    if nearly_done and usage["completion_tokens"] >= max_tokens - SIGTERM_AT_LEFT:
                        nearly_done.set()
    except httpx.HTTPError:
        pass
    finally:
        started.set()  # a request that failed to start fails the assertions, not a wait


def test_sigterm_drains_running_requests_then_exits_zero(tiny_model_dir, tmp_path):
    """The SIGTERM comes when the short request is nearly done (a state, not a time), so what
    the drain has left to make fits in it on any machine; the long one cannot finish in it."""
    log = (tmp_path / "server.log").open("w")
    proc, url = start_server_process(
        [str(tiny_model_dir), "--max-model-len", "40000", "--num-gpu-blocks-override", "2600",
         "--shutdown-timeout", str(DRAIN_S)], stdout=log, stderr=subprocess.STDOUT)
    try:
        short_lines: list[str] = []
        long_lines: list[str] = []
        long_started, short_started, short_nearly_done = (threading.Event() for _ in range(3))
        threads = [threading.Thread(target=_stream, args=(url, 39000, long_lines, long_started))]
        threads[0].start()
        assert long_started.wait(300)
        threads.append(threading.Thread(target=_stream, args=(
            url, SHORT_TOKENS, short_lines, short_started, short_nearly_done)))
        threads[1].start()
        assert short_nearly_done.wait(300), short_lines[-3:]
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        assert proc.wait(timeout=DRAIN_S + 120) == 0
        elapsed = time.monotonic() - start
        for t in threads:
            t.join(60)
        _assert_finished(short_lines, SHORT_TOKENS)  # in the drain
        events = [ln for ln in long_lines if ln.startswith("data: {")]
        assert 0 < len(events) < 39001 and "server shutting down" in events[-1]
        assert [ln for ln in long_lines if ln][-1] == "data: [DONE]"
        assert elapsed >= DRAIN_S  # the long request had the whole drain before it was cut
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=1)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    out = (tmp_path / "server.log").read_text()
    assert "Traceback" not in out, out


def _assert_finished(lines: list[str], max_tokens: int) -> None:
    chunks = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
    assert not any("error" in c for c in chunks), chunks[-1]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == max_tokens
    assert [ln for ln in lines if ln][-1] == "data: [DONE]"


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
