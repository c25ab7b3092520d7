"""Serve the app with Hypercorn: the CLI's path, and an in-process one for tests and tools."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import h11
from hypercorn.asyncio import serve
from hypercorn.config import Config
from hypercorn.protocol.h11 import H11Protocol

from pagedserve.actors.engine.protocol import EngineClient
from pagedserve.server.app import build_app
from pagedserve.server.errors import error_body
from pagedserve.server.openai.serving import ServingConfig

MAX_HEADER_BYTES = 16 * 1024  # request line and headers together; larger ones get 431

_PROTOCOL_ERRORS = {
    431: f"request line and headers exceed {MAX_HEADER_BYTES} bytes",
    400: "malformed HTTP request (request line, a header or Content-Length)",
}


def hypercorn_config(host: str, port: int) -> Config:
    config = Config()
    bind_host = f"[{host}]" if ":" in host else host
    config.bind = [f"{bind_host}:{port}"]
    config.accesslog = None  # we log each request ourselves, with its token counts
    config.errorlog = None
    config.graceful_timeout = 5.0
    config.h11_max_incomplete_size = MAX_HEADER_BYTES
    # Hypercorn's 100 drops connections when many clients connect at once (200 in issue 16's
    # mass cancellation); uvicorn, which vLLM serves with, takes 2048.
    config.backlog = 2048
    H11Protocol._send_error_response = _send_openai_error_response  # type: ignore[method-assign]
    return config


async def _send_openai_error_response(self: H11Protocol, status_code: int) -> None:
    """Hypercorn's answer to a request h11 cannot parse (bad ``Content-Length``, headers past
    ``MAX_HEADER_BYTES``), with an OpenAI error object instead of its empty body. Hypercorn
    has no hook for this, so ``hypercorn_config`` puts this method on its HTTP/1 protocol."""
    message = _PROTOCOL_ERRORS.get(status_code, "malformed HTTP request")
    body = json.dumps(error_body(message, status_code), separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()), (b"connection", b"close"),
               *self.config.response_headers("h11")]
    await self._send_h11_event(h11.Response(status_code=status_code, headers=headers))
    await self._send_h11_event(h11.Data(data=body))
    await self._send_h11_event(h11.EndOfMessage())


@asynccontextmanager
async def running_server(
    engine: EngineClient, serving: ServingConfig, host: str = "127.0.0.1", port: int = 0,
    **app_kwargs,
) -> AsyncIterator[str]:
    """Serve ``engine`` on ``host:port`` inside the running loop; yields the base URL.

    ``port=0`` picks a free port; ``app_kwargs`` go to ``build_app``.
    """
    if port == 0:
        port = free_port(host)
    stop = asyncio.Event()
    task = asyncio.create_task(
        serve(build_app(engine, serving, **app_kwargs), hypercorn_config(host, port),
              shutdown_trigger=stop.wait)
    )
    try:
        for _ in range(500):
            try:
                _, writer = await asyncio.open_connection(host, port)
                writer.close()
                break
            except OSError:
                if task.done():
                    task.result()
                await asyncio.sleep(0.01)
        yield f"http://{host}:{port}"
    finally:
        stop.set()
        await task


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_server_process(
    serve_args: list[str], timeout: float = 180.0, **popen_kwargs
) -> tuple[subprocess.Popen, str]:
    """Run ``pagedserve serve SERVE_ARGS --port <free>`` (the one next to this Python) and wait
    until ``/health`` answers; returns the process and its base URL (for tests and tools).

    Raises:
        RuntimeError: the process exited, or did not answer within ``timeout`` seconds (it is
            killed then).
    """
    port = free_port()
    exe = str(Path(sys.executable).parent / "pagedserve")
    proc = subprocess.Popen([exe, "serve", *serve_args, "--port", str(port)], **popen_kwargs)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"`pagedserve serve {' '.join(serve_args)}` did not start")
        time.sleep(0.2)
