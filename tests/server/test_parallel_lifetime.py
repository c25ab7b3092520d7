"""Lifetime of a tensor-parallel server's worker processes (issue 13's "zombie processes"):
a SIGTERM stops every worker, a worker killed mid-stream fails its request and the server
exits 1, an exception raised inside a worker's step fails the executor with its reason, a
layout or setting that cannot split ends the start with one line; after each, no process of
the server's process group (or of this one's children) is left."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from pagedserve.actors.engine.async_engine import AsyncEngine
from pagedserve.actors.executor.multiproc import MultiprocExecutor, WorkerFailed
from pagedserve.gpu.batch import ScheduledRequest, SchedulerOutput
from pagedserve.gpu.config import CacheConfig, ModelConfig, ParallelConfig
from pagedserve.gpu.sample.sampling_params import SamplingParams
from pagedserve.server.launch import start_server_process
from tests.conftest import engine_config

MSG = [{"role": "user", "content": "Count with me, forever"}]


def group_pids(pgid: int) -> list[int]:
    """Live processes (not zombies) whose process group is ``pgid``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def _serve(tiny_model_dir: Path, log) -> tuple[subprocess.Popen, str, list[int]]:
    """A tp=2 server in a process group of its own; its worker pids from /admin/stats."""
    proc, url = start_server_process(
        [str(tiny_model_dir), "-tp", "2", "--dtype", "float32", "--max-model-len", "4096",
         "--num-gpu-blocks-override", "300"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    workers = [r["pid"] for r in _our_layout(proc, url)]
    assert len(workers) == 2 and set(workers) <= set(group_pids(proc.pid))
    return proc, url, workers


def _our_layout(proc: subprocess.Popen, url: str, timeout: float = 180.0) -> list[dict]:
    """The rank layout of *this* server (its workers in its process group). On a machine
    shared with other checkouts another server can take the free port first and answer the
    start's ``/health`` check (seen once: a tp=1 server, no layout) until it stops and this
    one binds: wait for this one, however long; ``timeout`` only catches a hung start."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"the server exited with code {proc.returncode}"
        try:
            layout = httpx.get(f"{url}/admin/stats", timeout=30).json()["model"]["parallel"]
            if layout and {r["pid"] for r in layout} <= set(group_pids(proc.pid)):
                return layout
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        assert time.monotonic() < deadline, f"no answer from this server at {url}"
        time.sleep(0.2)


def _wait_group_empty(pgid: int, timeout: float = 60.0) -> None:
    """Until nothing of the group lives; ``timeout`` only catches a leak."""
    deadline = time.monotonic() + timeout
    while (left := group_pids(pgid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes left behind: {left}"


def test_sigterm_stops_every_worker(tiny_model_dir, tmp_path):
    with (tmp_path / "server.log").open("w") as log:
        proc, url, _ = _serve(tiny_model_dir, log)
        try:
            r = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                           json={"messages": MSG, "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=120) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    _wait_group_empty(proc.pid)


def test_killed_worker_fails_the_stream_and_the_server_exits(tiny_model_dir, tmp_path):
    with (tmp_path / "server.log").open("w") as log:
        proc, url, workers = _serve(tiny_model_dir, log)
        events: list[dict] = []
        try:
            body = {"messages": MSG, "max_tokens": 3000, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=120,
                              json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
                        if len(events) == 3:  # streaming: kill a rank mid-stream
                            os.kill(workers[1], signal.SIGKILL)
            assert proc.wait(timeout=120) == 1
        finally:
            if proc.poll() is None:
                proc.kill()
    out = (tmp_path / "server.log").read_text()
    assert "error" in events[-1], events[-1]
    assert f"worker rank 1 (pid {workers[1]}) exited" in events[-1]["error"]["message"]
    assert "the engine failed: worker rank 1" in out
    _wait_group_empty(proc.pid)


async def test_refused_layouts_end_the_start_with_one_line(tiny_model_dir):
    """A tp that does not divide the heads, or GGUF blocks that tp would cut (o_proj's 16
    inputs per rank at tp=4, under the 32-element block), are refused before any process
    starts."""
    with pytest.raises(ValueError, match=r"^--tensor-parallel-size 3 does not divide the "
                                         r"model's 4 attention heads; sizes that work for "
                                         r"this model: 1, 2, 4$"):
        await AsyncEngine.start(engine_config(tiny_model_dir, parallel=ParallelConfig(3)))
    config = engine_config(tiny_model_dir, parallel=ParallelConfig(4), quantization="gguf")
    with pytest.raises(ValueError, match=r"^--tensor-parallel-size 4 cuts GGUF blocks under "
                                         r"--quantization gguf: o_proj's input per rank is 16 "
                                         r"elements.*; sizes that work for this model: 1, 2$"):
        await AsyncEngine.start(config)
    assert not multiprocessing.active_children()


async def test_exception_in_a_worker_step_fails_the_executor_with_its_reason(tiny_model_dir):
    """A step the workers cannot run (a block table too short for its positions: the
    scheduler never sends one, so it stands for any bug) raises inside every worker's step:
    the executor reports the first rank's exception, ends every worker, and refuses later
    steps with the same reason."""
    executor = MultiprocExecutor(
        ModelConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=64),
        CacheConfig(num_gpu_blocks_override=8), ParallelConfig(2), 64, 4)
    await executor.load()
    try:
        greedy = SamplingParams(temperature=0.0)
        ok = executor.execute_model(SchedulerOutput(
            [ScheduledRequest("a", [1, 2, 3], 0, [0], greedy, True, 3)]))
        assert len(ok.sampled_token_ids["a"]) == 1
        bad = SchedulerOutput([ScheduledRequest("b", [1, 2, 3], 100, [0], greedy, True, 3)])
        with pytest.raises(WorkerFailed, match=r"^rank \d: IndexError: "):
            executor.execute_model(bad)
        assert not multiprocessing.active_children()
        with pytest.raises(WorkerFailed, match="IndexError"):
            executor.execute_model(SchedulerOutput([]))
    finally:
        await executor.stop()
