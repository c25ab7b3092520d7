"""``pagedserve proxy``: one OpenAI endpoint in front of prefill and decode instances
(disaggregated prefill/decode).

What vLLM's disaggregated-serving proxy example does (``examples/online_serving/
disaggregated_serving`` and ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``),
read to learn, written here for Starlette + httpx:

1. the request goes to a prefill instance (round-robin) as a one-token, non-streamed request
   (``max_tokens: 1``, ``max_completion_tokens: 1``, ``stream: false``) carrying
   ``kv_transfer_params: {"do_remote_decode": true, ...}``: the instance computes the prompt's
   KV, holds its blocks and answers with the ``kv_transfer_params`` a consumer needs to find them;
2. the client's own request, with those ``kv_transfer_params``, goes to a decode instance
   (round-robin), which loads the blocks instead of computing them (or recomputes them, when it
   has no connector or the load fails: same greedy output either way);
3. the decode instance's answer (SSE, or JSON) is relayed to the client byte for byte.

A client that goes away cancels the upstream request of whichever phase is running (httpx
closes that connection, so the instance sees its client gone and aborts); an upstream error
comes back with its status and its OpenAI error body, an unreachable instance as a 502.
Other ``GET`` routes (``/``, the chat page's files, ``/v1/models``, ``/version``) are served
by a decode instance, so curl, the openai client and the chat page work through the proxy.

Nothing here imports torch: the proxy is light enough to run anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import itertools
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import httpx
import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pagedserve.server.errors import error_body

log = structlog.get_logger(__name__)

# What a prefill request asks a producer for: hold the prompt's blocks for a remote decode.
PREFILL_KV_TRANSFER_PARAMS = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}
_FORWARDED_HEADERS = ("authorization", "x-request-id")
_RELAYED_HEADERS = ("content-type", "x-request-id", "cache-control")
_BAD_GATEWAY = 502


@dataclass(slots=True)
class ProxyConfig:
    """``pagedserve proxy`` flags.

    Attributes:
        prefill: base URLs of the prefill (producer) instances, e.g. ``http://10.0.0.1:8100``.
        decode: base URLs of the decode (consumer) instances.
        host, port: where the proxy listens.
        connect_timeout_s: seconds to open a connection to an instance (reads never time out:
            a long generation is not an error).
    """

    prefill: list[str]
    decode: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    connect_timeout_s: float = 10.0
    _rr: dict[str, itertools.cycle] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("the proxy needs at least one --prefill and one --decode URL")
        self.prefill = [u.rstrip("/") for u in self.prefill]
        self.decode = [u.rstrip("/") for u in self.decode]
        self._rr = {"prefill": itertools.cycle(self.prefill),
                    "decode": itertools.cycle(self.decode)}

    def next_url(self, role: str) -> str:
        """The next instance of ``role`` (``prefill`` or ``decode``), round-robin."""
        return next(self._rr[role])


class UpstreamError(Exception):
    """An instance answered with an error, or could not be reached: relayed as it is."""

    def __init__(self, status: int, body: bytes, content_type: str = "application/json"):
        super().__init__(status)
        self.status = status
        self.body = body
        self.content_type = content_type

    @classmethod
    def unreachable(cls, url: str, e: Exception) -> UpstreamError:
        message = f"instance {url} did not answer: {type(e).__name__}: {e}"
        return cls(_BAD_GATEWAY, json.dumps(error_body(message, _BAD_GATEWAY)).encode())

    def response(self) -> Response:
        return Response(self.body, status_code=self.status, media_type=self.content_type)


def prefill_body(body: dict) -> dict:
    """The producer's copy of a request: one token, not streamed, its blocks held for a remote
    decode (``min_tokens`` and ``stream_options`` dropped: they contradict that)."""
    out = copy.deepcopy(body)
    out.update(max_tokens=1, stream=False, kv_transfer_params=dict(PREFILL_KV_TRANSFER_PARAMS))
    if "messages" in out:
        out["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens"):
        out.pop(key, None)
    return out


def decode_body(body: dict, kv_transfer_params: dict | None) -> dict:
    """The consumer's copy: the client's request, plus where its prompt's blocks are."""
    out = dict(body)
    if kv_transfer_params is not None:
        out["kv_transfer_params"] = kv_transfer_params
    return out


async def _until_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    """Returns when the client has gone (the body is already read, so nothing else comes)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class DisaggregatedProxy:
    """The proxy's handlers over one ``httpx.AsyncClient`` (pooled connections)."""

    def __init__(self, config: ProxyConfig, client: httpx.AsyncClient | None = None):
        self.config = config
        timeout = httpx.Timeout(None, connect=config.connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.client = client or httpx.AsyncClient(timeout=timeout, limits=limits)

    async def aclose(self) -> None:
        await self.client.aclose()

    def app(self) -> Starlette:
        routes = [
            Route("/v1/completions", self.generate, methods=["POST"]),
            Route("/v1/chat/completions", self.generate, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/{path:path}", self.passthrough, methods=["GET"]),
        ]
        return Starlette(routes=routes)

    @staticmethod
    def _headers(request: Request, request_id: str) -> dict[str, str]:
        headers = {k: v for k, v in request.headers.items() if k in _FORWARDED_HEADERS}
        headers["x-request-id"] = request_id  # both instances log the same id
        return headers

    async def generate(self, request: Request) -> Response:
        """``POST /v1/completions`` and ``/v1/chat/completions``: prefill, then decode."""
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return JSONResponse(error_body(f"body is not JSON: {e}", 400), status_code=400)
        if not isinstance(body, dict):
            return JSONResponse(error_body("body must be a JSON object", 400), status_code=400)
        request_id = request.headers.get("x-request-id") or f"pd-{uuid.uuid4().hex}"
        return _Disaggregated(self, request.url.path, body, self._headers(request, request_id))

    async def prefill(self, path: str, body: dict, headers: dict[str, str]) -> dict | None:
        """Run the prompt on a prefill instance; returns its ``kv_transfer_params``."""
        url = self.config.next_url("prefill")
        try:
            r = await self.client.post(url + path, json=prefill_body(body), headers=headers)
        except httpx.HTTPError as e:
            raise UpstreamError.unreachable(url, e) from e
        if r.status_code != 200:
            raise UpstreamError(r.status_code, r.content,
                                r.headers.get("content-type", "application/json"))
        return r.json().get("kv_transfer_params")

    @contextlib.asynccontextmanager
    async def decode(self, path: str, body: dict,
                     headers: dict[str, str]) -> AsyncIterator[httpx.Response]:
        """The decode instance's streamed response (closed, i.e. its connection dropped, on
        exit: the instance then aborts a request still running)."""
        url = self.config.next_url("decode")
        try:
            req = self.client.build_request("POST", url + path, json=body, headers=headers)
            r = await self.client.send(req, stream=True)
        except httpx.HTTPError as e:
            raise UpstreamError.unreachable(url, e) from e
        try:
            if r.status_code != 200:
                content = await r.aread()
                raise UpstreamError(r.status_code, content,
                                    r.headers.get("content-type", "application/json"))
            yield r
        finally:
            await r.aclose()

    async def health(self, request: Request) -> Response:
        """200 when every instance's ``/health`` is; else 503 naming those that are not."""
        urls = [*self.config.prefill, *self.config.decode]

        async def ok(url: str) -> bool:
            try:
                return (await self.client.get(url + "/health")).status_code == 200
            except httpx.HTTPError:
                return False

        down = [u for u, up in zip(urls, await asyncio.gather(*map(ok, urls)), strict=True)
                if not up]
        if not down:
            return Response(status_code=200)
        return JSONResponse(error_body(f"instances not healthy: {', '.join(down)}", 503),
                            status_code=503)

    async def passthrough(self, request: Request) -> Response:
        """Any other ``GET`` (models, version, the chat page): a decode instance answers."""
        url = self.config.next_url("decode") + request.url.path
        headers = {k: v for k, v in request.headers.items() if k in _FORWARDED_HEADERS}
        try:
            r = await self.client.get(url, params=request.query_params, headers=headers)
        except httpx.HTTPError as e:
            return UpstreamError.unreachable(url, e).response()
        relayed = {k: v for k, v in r.headers.items() if k in _RELAYED_HEADERS}
        return Response(r.content, status_code=r.status_code, headers=relayed)


class _Disaggregated(Response):
    """One generation request's ASGI response: prefill, decode and relay, cancelled as a whole
    when the client disconnects (watched from the start, whichever phase is running)."""

    def __init__(self, proxy: DisaggregatedProxy, path: str, body: dict,
                 headers: dict[str, str]):
        super().__init__()
        self.proxy, self.path, self.body, self.upstream_headers = proxy, path, body, headers

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        gone = asyncio.ensure_future(_until_disconnect(receive))
        work = asyncio.ensure_future(self._serve(send))
        await asyncio.wait({gone, work}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            gone.cancel()
            work.result()
            return
        work.cancel()  # the upstream request in flight is closed: its instance aborts
        with contextlib.suppress(asyncio.CancelledError):
            await work
        log.info("client_disconnected", request_id=self.upstream_headers["x-request-id"])

    async def _serve(self, send) -> None:
        try:
            params = await self.proxy.prefill(self.path, self.body, self.upstream_headers)
            async with self.proxy.decode(self.path, decode_body(self.body, params),
                                         self.upstream_headers) as r:
                relayed = [(k.encode(), v.encode()) for k, v in r.headers.items()
                           if k in _RELAYED_HEADERS]
                await send({"type": "http.response.start", "status": r.status_code,
                            "headers": relayed})
                try:
                    async for chunk in r.aiter_raw():
                        await send({"type": "http.response.body", "body": chunk,
                                    "more_body": True})
                except httpx.HTTPError as e:  # the decode instance went away mid-answer
                    log.warning("upstream_broken", error=f"{type(e).__name__}: {e}",
                                request_id=self.upstream_headers["x-request-id"])
                await send({"type": "http.response.body", "body": b""})
        except UpstreamError as e:
            log.info("upstream_error", status=e.status,
                     request_id=self.upstream_headers["x-request-id"])
            await send({"type": "http.response.start", "status": e.status,
                        "headers": [(b"content-type", e.content_type.encode())]})
            await send({"type": "http.response.body", "body": e.body})


def hypercorn_config(host: str, port: int):
    """Hypercorn's settings for the proxy (its own: ``server/launch.py`` imports the engine)."""
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = None
    config.graceful_timeout = 5.0
    config.backlog = 2048
    return config


@contextlib.asynccontextmanager
async def running_proxy(config: ProxyConfig) -> AsyncIterator[str]:
    """Serve the proxy inside the running loop (tests, tools); yields its base URL."""
    from hypercorn.asyncio import serve

    proxy = DisaggregatedProxy(config)
    stop = asyncio.Event()
    task = asyncio.create_task(serve(proxy.app(), hypercorn_config(config.host, config.port),
                                     shutdown_trigger=stop.wait))
    url = f"http://{config.host}:{config.port}"
    try:
        while True:  # until it accepts connections (or failed to bind)
            try:
                _, writer = await asyncio.open_connection(config.host, config.port)
                writer.close()
                break
            except OSError:
                if task.done():
                    task.result()
                await asyncio.sleep(0.01)
        yield url
    finally:
        stop.set()
        await task
        await proxy.aclose()


def add_proxy_parser(sub) -> None:
    """The ``proxy`` subcommand on the CLI's subparsers."""
    p = sub.add_parser("proxy", help="one OpenAI endpoint over prefill and decode instances")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="prefill (kv_producer) instances' base URLs, used round-robin")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="decode (kv_consumer) instances' base URLs, used round-robin")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"])


def proxy_main(args: argparse.Namespace) -> None:
    """The CLI's entry: run the proxy; a bad flag value or a taken port ends it with a line."""
    import sys

    try:
        asyncio.run(run_proxy(args))
    except (ValueError, OSError) as e:
        print(f"pagedserve proxy: error: {e}", file=sys.stderr)
        sys.exit(1)


async def run_proxy(args: argparse.Namespace) -> None:
    """``pagedserve proxy ...`` until SIGINT/SIGTERM."""
    import signal

    from hypercorn.asyncio import serve

    config = ProxyConfig(args.prefill, args.decode, args.host, args.port)
    proxy = DisaggregatedProxy(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    log.info("proxy_serving", url=f"http://{args.host}:{args.port}/v1", prefill=config.prefill,
             decode=config.decode)
    try:
        await serve(proxy.app(), hypercorn_config(args.host, args.port),
                    shutdown_trigger=stop.wait)
    finally:
        await proxy.aclose()
