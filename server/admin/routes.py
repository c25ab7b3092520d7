"""The operators' routes: live stats (JSON and SSE), Prometheus metrics, the dashboard and the
chat page.

Every figure comes from the scheduler actor by message (``EngineClient.get_stats``, typed) or
from the engine's stat loggers; nothing here reads actor state directly. The typed stats become
JSON in ``server/admin/stats_json.py``, on their way out.

With data parallelism (``actors/dp/engine.py``) the stats are the group's totals with an
``engines`` list (each engine's own figures and the router's view of it) and ``/metrics``
labels each series ``engine="k"``.

Access: when an admin key is set, ``/admin/stats``, ``/admin/events`` and ``/metrics`` need
``Authorization: Bearer <admin key>``; with no admin key but an API key, they need the API key.
The HTML pages and their scripts hold no data and stay open (a browser cannot put a bearer
header on a page load): the dashboard asks for the key and sends it on its own requests.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from pagedserve.actors.engine.protocol import EngineClient
from pagedserve.actors.stats import EngineStats
from pagedserve.server.admin.metrics import CONTENT_TYPE, PrometheusStatLogger
from pagedserve.server.admin.stats_json import stats_json
from pagedserve.server.errors import OpenAIError

STATIC_DIR = Path(__file__).parents[1] / "static"  # server/static: the chat page too
EVENTS_MAX_INTERVAL_S = 0.5  # a snapshot at least this often
EVENTS_POLL_S = 0.1  # how often the stream asks the scheduler whether something changed

# Pages load only what pagedserve serves: no CDN, no inline script.
_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

Handler = Callable[[Request], Awaitable[Response]]


def admin_routes(engine: EngineClient, model_name: str, admin_key: str | None,
                 api_key: str | None, metrics_prefix: str = "pagedserve",
                 serving: dict | None = None) -> list[BaseRoute]:
    """The routes; registers the Prometheus stat logger with ``engine`` (with data
    parallelism, one per engine: its series carry ``engine="k"``). ``serving``: the HTTP
    layer's settings shown beside the engine's (``stats_json``)."""
    group = getattr(engine, "engines", None)  # a DataParallelEngine's engines
    metrics = PrometheusStatLogger(model_name, metrics_prefix, engine.effective_config()["cache"],
                                   engine.info.max_model_len, len(group) if group else 1)
    if group and len(group) > 1:
        for k, member in enumerate(group):
            member.add_stat_logger(metrics.for_engine(k))
    else:
        engine.add_stat_logger(metrics)
    guard = _bearer_guard(admin_key or api_key)

    async def stats(request: Request) -> Response:
        return JSONResponse(stats_json(await engine.get_stats(), model_name, serving))

    async def events(request: Request) -> Response:
        return EventSourceResponse(_snapshots(engine.get_stats, model_name, serving), ping=15,
                                   sep="\n")

    async def prometheus(request: Request) -> Response:
        body = metrics.render(await engine.get_stats())
        return Response(body, media_type=CONTENT_TYPE)

    return [
        Route("/", _page("chat.html"), methods=["GET"]),
        Route("/admin", _page("admin.html"), methods=["GET"]),
        Route("/admin/stats", guard(stats), methods=["GET"]),
        Route("/admin/events", guard(events), methods=["GET"]),
        Route("/metrics", guard(prometheus), methods=["GET"]),
        Route("/favicon.ico", favicon, methods=["GET"]),
        Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
    ]


async def favicon(request: Request) -> Response:
    """The pages' icon (browsers ask for /favicon.ico whatever the page links)."""
    return FileResponse(STATIC_DIR / "favicon.svg", media_type="image/svg+xml",
                        headers={"Cache-Control": "max-age=86400"})


def _bearer_guard(key: str | None) -> Callable[[Handler], Handler]:
    def guard(handler: Handler) -> Handler:
        if key is None:
            return handler

        async def checked(request: Request) -> Response:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), key.encode()
            ):
                raise OpenAIError("missing or wrong admin key: send `Authorization: Bearer "
                                  "<key>` (the --admin-key, else the --api-key)", status=401)
            return await handler(request)

        return checked

    return guard


def _page(name: str) -> Handler:
    async def page(request: Request) -> Response:
        return FileResponse(STATIC_DIR / name, media_type="text/html",
                            headers={"Content-Security-Policy": _CSP,
                                     "Cache-Control": "no-cache"})

    return page


def _changed(a: EngineStats | None, b: EngineStats) -> bool:
    """Whether a dashboard would draw something different (ages and clocks aside)."""
    if a is None:
        return True
    sa, sb = a.scheduler, b.scheduler
    return (sa.num_steps_total != sb.num_steps_total
            or sa.num_waiting != sb.num_waiting or sa.num_running != sb.num_running
            or a.kv_cache.num_free_blocks != b.kv_cache.num_free_blocks)


async def _snapshots(
    snapshot: Callable[[], Awaitable[EngineStats]], model_name: str, serving: dict | None,
) -> AsyncIterator[dict[str, str]]:
    """Stats snapshots as SSE events: on change (checked every ``EVENTS_POLL_S``) and at least
    every ``EVENTS_MAX_INTERVAL_S``. Ends when the client goes away (sse-starlette cancels)."""
    last: EngineStats | None = None
    last_sent = 0.0
    while True:
        snap = await snapshot()
        now = time.monotonic()
        if _changed(last, snap) or now - last_sent >= EVENTS_MAX_INTERVAL_S:
            yield {"event": "stats", "data": json.dumps(stats_json(snap, model_name, serving))}
            last, last_sent = snap, now
        await asyncio.sleep(EVENTS_POLL_S)
