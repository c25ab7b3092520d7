"""Data-parallel servers as processes, for the -dp tests: ``pagedserve serve`` spawned with
its log in a file, waited healthy, stopped with SIGTERM, and the engine-core processes it
started found through ``/proc`` (none may be left)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from pagedserve.server.launch import free_port

ARGS = ["--dtype", "float32", "--max-model-len", "512", "--num-gpu-blocks-override", "256",
        "--max-num-seqs", "64", "--max-num-batched-tokens", "512"]
EXE = str(Path(sys.executable).parent / "pagedserve")


def engine_pids(parent: int) -> dict[int, int]:
    """``{rank: pid}`` of the live engine-core processes ``parent`` started."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        rank = re.search(r"engine_core\.proc\x00--engine-index=(\d+)", cmd)
        if rank and int(fields[1]) == parent and fields[0] != "Z":
            out[int(rank.group(1))] = int(entry.name)
    return out


async def until_logged(path: Path, pattern: str, timeout: float = 60.0) -> None:
    """Until the log at ``path`` has a line matching ``pattern`` (``timeout`` catches a hang)."""
    deadline = time.monotonic() + timeout
    while not re.search(pattern, path.read_text()):
        assert time.monotonic() < deadline, f"never logged {pattern!r}"
        await asyncio.sleep(0.05)


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def spawn(args: list[str], log: Path, **kw: Any) -> subprocess.Popen:
    with log.open("w") as f:
        return subprocess.Popen([EXE, "serve", *args], stdout=f, stderr=subprocess.STDOUT, **kw)


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, f"{url} did not start"
        time.sleep(0.2)


@contextmanager
def dp_server(model_dir: Path, *extra: str, logs: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    """``pagedserve serve MODEL -dp 2 EXTRA`` (both engines local, one thread each); yields
    the process and its URL; SIGTERM at the end must exit 0 and leave no engine behind."""
    port = free_port()
    proc = spawn([str(model_dir), *ARGS, "-dp", "2", *extra, "--port", str(port)],
                 logs / "server.log", env={**os.environ, "PAGEDSERVE_CPU_THREADS": "2"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        yield proc, url
    finally:
        if proc.poll() is None:
            assert stop(proc) == 0
        assert engine_pids(proc.pid) == {}
