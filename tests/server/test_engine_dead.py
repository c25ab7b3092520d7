"""An exception in an actor never leaves a silent zombie (issue 33, item 14).

What raises for one request fails that request (a 500 with an OpenAI body, logged with its
traceback) and the engine serves on; what the engine cannot contain (the scheduler's loop or the
executor's loop raising) makes it dead: every waiting and running request gets an error at once,
``/health`` says 503, new requests get a 503, ``/admin/stats`` answers instead of hanging, and
``pagedserve serve`` exits non-zero. The faults are injected by patching one method of the real
scheduler or executor; the rest of the engine is real.
"""

from __future__ import annotations

import asyncio
import json
import signal

import httpx
import pytest

from pagedserve.actors.core.scheduler import Scheduler
from pagedserve.actors.core.scheduler_stats import SchedulerStatsRecorder
from pagedserve.actors.executor.base import Executor
from pagedserve.server import cli
from pagedserve.server.launch import free_port
from tests.conftest import serve, until_stats

MSG = [{"role": "user", "content": "Say something."}]
BODY = {"messages": MSG, "max_tokens": 30, "ignore_eos": True, "temperature": 0,
        "return_token_ids": True}


def _openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


async def test_a_fault_in_one_requests_update_fails_only_that_request(
        tiny_model_dir, monkeypatch, capfd):
    real = Scheduler._check_stop

    def faulty(self, request):  # the real stop check, except for one marked request
        if request.sampling_params.seed == 4242:
            raise ZeroDivisionError("injected update fault")
        return real(self, request)

    monkeypatch.setattr(Scheduler, "_check_stop", faulty)
    async with serve(tiny_model_dir) as client:
        want = (await client.post("/v1/chat/completions", json=BODY)).json()
        bad = {**BODY, "temperature": 1.0, "seed": 4242}
        results = await asyncio.gather(
            *[client.post("/v1/chat/completions", json=BODY) for _ in range(3)],
            client.post("/v1/chat/completions", json=bad))
        for r in results[:3]:
            assert r.json()["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
        assert "injected update fault" in _openai_error(results[3], 500)["message"]
        assert (await client.get("/health")).status_code == 200
        s = await until_stats(client, lambda s: s["scheduler"]["num_running"] == 0, "idle")
        assert s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"]
        r = await client.post("/v1/chat/completions", json=BODY)  # serves on
        assert r.json()["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    out = "".join(capfd.readouterr())  # structlog's default output
    assert "request_failed" in out and "Traceback" in out and "ZeroDivisionError" in out


async def _stream_lines(client: httpx.AsyncClient, body: dict, first: asyncio.Event) -> list:
    lines = []
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                first.set()
    return lines


@pytest.mark.parametrize("where", ["scheduler", "executor"])
async def test_a_fault_the_engine_cannot_contain_makes_it_dead(tiny_model_dir, monkeypatch,
                                                               where):
    """A running stream and a waiting request (``max_num_seqs=1``) both end with an error at
    once; afterwards nothing hangs."""
    armed = asyncio.Event()
    cls, name = ((SchedulerStatsRecorder, "record_step") if where == "scheduler"  # its task
                 else (Executor, "_submit"))
    real = getattr(cls, name)

    def faulty(self, *args):
        if armed.is_set():
            raise RuntimeError(f"injected {where} fault")
        return real(self, *args)

    monkeypatch.setattr(cls, name, faulty)
    async with serve(tiny_model_dir, max_num_seqs=1, max_model_len=4096) as client:
        first = asyncio.Event()
        running = asyncio.create_task(_stream_lines(
            client, {**BODY, "max_tokens": 4000}, first))
        await first.wait()
        waiting = asyncio.create_task(client.post("/v1/chat/completions", json=BODY))
        await until_stats(client, lambda s: s["scheduler"]["num_waiting"] == 1, "waiting")
        armed.set()
        lines = await asyncio.wait_for(running, 60)  # "at once": a hang fails here
        assert lines[-1] == "[DONE]"
        error = json.loads(lines[-2])["error"]
        assert f"injected {where} fault" in error["message"] and error["code"] == 500
        assert f"injected {where} fault" in _openai_error(
            await asyncio.wait_for(waiting, 60), 500)["message"]
        health = await client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert f"injected {where} fault" in health.json()["reason"]
        assert "engine is dead" in _openai_error(
            await client.post("/v1/chat/completions", json=BODY), 503)["message"]
        _openai_error(await client.get("/admin/stats"), 500)  # an answer, not a hang


async def test_serve_exits_non_zero_when_the_engine_dies(tiny_model_dir, monkeypatch):
    """``pagedserve serve`` itself (in this process, so the fault can be injected): the engine
    dies, the server stops on its own and exits with the reason."""
    def faulty(self, *args):
        raise RuntimeError("injected scheduler fault")

    monkeypatch.setattr(SchedulerStatsRecorder, "record_step", faulty)  # the scheduler's task
    port = free_port()
    args = cli.build_parser().parse_args([
        "serve", str(tiny_model_dir), "--port", str(port), "--max-model-len", "256",
        "--num-gpu-blocks-override", "64", "--dtype", "float32"])
    async def run() -> SystemExit | None:  # asyncio lets a task's SystemExit stop the loop
        try:
            await cli.serve(args)
        except SystemExit as e:
            return e
        return None

    server = asyncio.create_task(run())
    loop = asyncio.get_running_loop()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            while True:
                try:
                    if (await client.get("/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    assert not server.done(), server.result()
                    await asyncio.sleep(0.05)
            r = await client.post("/v1/chat/completions", json=BODY)
            assert "injected scheduler fault" in _openai_error(r, 500)["message"]
        exit_ = await asyncio.wait_for(server, 60)
        assert exit_ is not None and "the engine failed: the scheduler crashed" in str(exit_.code)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # serve() set them on this shared loop
            loop.remove_signal_handler(sig)
        if not server.done():
            server.cancel()
