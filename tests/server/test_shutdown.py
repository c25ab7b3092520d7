"""Shutdown as vLLM's server does it: SIGTERM drains the running requests (within
``--shutdown-timeout``) and exits 0; SIGINT when idle exits at once with its log lines; a second
signal ends the drain."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import httpx
import pytest

from pagedserve.server.launch import start_server_process

MSG = [{"role": "user", "content": "Say something."}]

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


def test_sigint_when_idle_exits_zero_with_its_log_lines(tiny_model_dir, tmp_path):
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        proc, _ = start_server_process([str(tiny_model_dir)], stdout=log,
                                       stderr=subprocess.STDOUT)
        try:
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=120) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    out = log_path.read_text()
    assert "shutdown_started" in out and out.rstrip().endswith("stopped"), out[-2000:]
    assert "Traceback" not in out, out


def test_a_second_signal_aborts_the_drain_and_exits_at_once(tiny_model_dir, tmp_path):
    """A drain of 600 s would outlast the wait below: only the second SIGINT ends the stream,
    which says so in-band and is logged ``finish_reason=['abort']``."""
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        proc, url = start_server_process(
            [str(tiny_model_dir), "--max-model-len", "40000", "--num-gpu-blocks-override",
             "2600", "--shutdown-timeout", "600"], stdout=log, stderr=subprocess.STDOUT)
        try:
            lines: list[str] = []
            started = threading.Event()
            stream = threading.Thread(target=_stream, args=(url, 39000, lines, started))
            stream.start()
            assert started.wait(300)
            proc.send_signal(signal.SIGINT)
            while "shutdown_started" not in log_path.read_text():  # the drain has begun
                assert proc.poll() is None
                time.sleep(0.05)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=120) == 0
            stream.join(60)
        finally:
            if proc.poll() is None:
                proc.kill()
    events = [ln for ln in lines if ln.startswith("data: {")]
    assert "server shutting down" in events[-1], events[-1]
    assert [ln for ln in lines if ln][-1] == "data: [DONE]"
    out = log_path.read_text()
    assert "shutdown_forced" in out and "finish_reason=['abort']" in out, out[-2000:]
    assert "Traceback" not in out, out
