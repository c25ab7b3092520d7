"""ASGI guard in front of the app: access log, API key, request-body size limit and read
timeout, content type, and the count of generation requests in flight (``/load``).

Pure ASGI (not Starlette middleware) so an oversized body is refused from its
``Content-Length`` before a byte of it is read, and a chunked one as soon as it passes the
limit; a body that stops arriving half-way ends in a 408 instead of holding its connection;
and every request, the ones the guard itself refuses (401, 408, 413, 415, 503) included, gets
one ``access`` log line when it ends: method, path, status, duration and the request id, never
a body (vLLM leaves this to uvicorn's access log).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import structlog

from pagedserve.server.errors import OpenAIError, error_body_for

log = structlog.get_logger("pagedserve.access")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


DEFAULT_BODY_READ_TIMEOUT_S = 30.0
# Open without the API key (the --api-key row of docs/serving.md): probes a load balancer
# reads without credentials (/health, /ping, /load), pages that hold no data and send the key
# themselves (/, /admin, /static/*), the schema (the same on every server), and the operator
# routes, which check the admin key themselves.
OPEN_PATHS = frozenset({"/health", "/", "/admin", "/admin/stats", "/admin/events", "/metrics",
                        "/ping", "/load", "/openapi.json", "/docs", "/favicon.ico"})
# The routes that run the model, counted by ``ServerLoad`` (vLLM's ``load_aware_call`` routes).
LOAD_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/invocations",
                        "/v1/messages"})


@dataclass(slots=True)
class ServerLoad:
    """Requests to ``LOAD_PATHS`` from arrival until their last byte is sent (a stream counts
    until it ends), when ``enabled`` (``--enable-server-load-tracking``); ``/load`` shows it."""

    enabled: bool = False
    value: int = 0


class RequestGuard:
    """Args:
    app: the ASGI app behind the guard.
    api_key: when set, every path outside ``open_paths`` needs ``Authorization: Bearer <key>``
        or ``x-api-key: <key>`` (Anthropic's clients send the key so), compared in constant
        time.
    max_body_bytes: larger request bodies get 413.
    body_read_timeout_s: a body not received in full this many seconds after the handler
        starts reading it gets 408 (a client stalled mid-body; Hypercorn has no such limit of
        its own but for the whole connection, which would also cut long streams).
    open_paths: paths this guard lets through without the API key: ``/health``, the pages
        (which hold no data) and the operator routes, which check the admin key themselves.
    """

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int,
                 open_paths: frozenset[str] = OPEN_PATHS, access_log: bool = True,
                 load: ServerLoad | None = None,
                 body_read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S):
        self.app = app
        self.access_log = access_log
        self.load = load or ServerLoad()
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.body_read_timeout_s = body_read_timeout_s
        self.open_paths = open_paths
        self.draining = False  # set on SIGTERM: new requests get 503

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        counted = self.load.enabled and scope["path"] in LOAD_PATHS
        if not (self.access_log or counted):
            return await self._guarded(scope, receive, send)
        start = time.monotonic()
        seen: dict[str, Any] = {"status": None, "request_id": None}

        async def watched(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
                for k, v in message.get("headers", []):
                    if k.lower() == b"x-request-id":
                        seen["request_id"] = v.decode("latin-1")
            await send(message)

        if counted:
            self.load.value += 1
        try:
            await self._guarded(scope, receive, watched)
        finally:
            if counted:
                self.load.value -= 1
            if self.access_log:
                _log_access(scope, seen, start)

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.draining:
            return await _reply(send, 503, "server is shutting down", {"retry-after": "1"},
                                path=scope["path"])
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        path = scope["path"]
        if (self.api_key is not None and path not in self.open_paths
                and not path.startswith("/static/") and not _authorized(headers, self.api_key)):
            return await _reply(send, 401, "invalid or missing API key (send Authorization: "
                                "Bearer <key>, or x-api-key: <key>)", path=path)
        if scope["method"] in ("POST", "PUT", "PATCH"):
            ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if ctype and ctype != b"application/json" and not ctype.endswith(b"+json"):
                return await _reply(send, 415, f"content type {ctype.decode()!r} is not "
                                    "supported; send application/json", path=path)
            length = headers.get(b"content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
                return await _reply(send, 413, f"request body of {int(length)} bytes exceeds "
                                    f"the limit of {self.max_body_bytes}", path=path)
            receive = self._limited(receive)
        await self.app(scope, receive, send)

    def _limited(self, receive: Receive) -> Receive:
        """``receive`` under the size limit and, until the body's last chunk, the read
        deadline; later reads (the wait for a disconnect) have no deadline. Errors are raised
        inside the handler's body read, so its exception handlers answer them."""
        seen = 0
        limit = self.max_body_bytes
        timeout = self.body_read_timeout_s
        deadline: float | None = None
        body_done = False

        async def wrapped() -> MutableMapping[str, Any]:
            nonlocal seen, deadline, body_done
            if body_done:
                return await receive()
            loop = asyncio.get_running_loop()
            if deadline is None:
                deadline = loop.time() + timeout
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError as e:  # TimeoutError from 3.11 on; 3.10 is supported
                raise OpenAIError(f"request body not received in full within {timeout:g} s",
                                  408, headers={"connection": "close"}) from e
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if seen > limit:
                    raise OpenAIError(f"request body exceeds the limit of {limit} bytes", 413)
            else:  # http.disconnect: nothing more will come
                body_done = True
            return message

        return wrapped


def _authorized(headers: dict[bytes, bytes], key: bytes) -> bool:
    """The bearer token or the ``x-api-key`` header is ``key`` (both compared, in constant
    time, whichever was sent)."""
    auth = headers.get(b"authorization", b"")
    bearer = hmac.compare_digest(auth[7:] if auth[:7].lower() == b"bearer " else b"", key)
    return hmac.compare_digest(headers.get(b"x-api-key", b""), key) or bearer


def _log_access(scope: Scope, seen: dict[str, Any], start: float) -> None:
    """One line per request; ``status`` is ``None`` when the client left before any reply."""
    client = scope.get("client")
    request_id = seen["request_id"]
    if request_id is None:
        for k, v in scope.get("headers", []):
            if k.lower() == b"x-request-id":
                request_id = v.decode("latin-1")
    log.info("access", method=scope["method"], path=scope["path"], status=seen["status"],
             duration_ms=round((time.monotonic() - start) * 1000, 1), request_id=request_id,
             client=f"{client[0]}:{client[1]}" if client else None)


async def _reply(send: Send, status: int, message: str,
                 extra_headers: dict[str, str] | None = None, path: str = "") -> None:
    # Rendered as Starlette's JSONResponse renders every other error: compact, UTF-8; in the
    # shape of the API ``path`` belongs to.
    body = json.dumps(error_body_for(path, message, status), ensure_ascii=False,
                      separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in (extra_headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
