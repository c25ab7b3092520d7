"""The Starlette application: routes and the mapping of errors to OpenAI error objects."""

from __future__ import annotations

import time

import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from actors.engine import AsyncEngine
from server.errors import OpenAIError, error_body
from server.serving import Serving, ServingConfig

log = structlog.get_logger(__name__)


def build_app(engine: AsyncEngine, config: ServingConfig) -> Starlette:
    serving = Serving(engine, config)
    created = int(time.time())

    async def models(request: Request) -> JSONResponse:
        card = {"id": config.served_model_name, "object": "model", "created": created,
                "owned_by": "pagedserve", "root": engine.info.path,
                "max_model_len": engine.info.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def admin_stats(request: Request) -> JSONResponse:
        return JSONResponse(await engine.get_stats())

    async def reset_prefix_cache(request: Request) -> JSONResponse:
        return JSONResponse({"num_blocks_dropped": await engine.reset_prefix_cache()})

    async def on_openai_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, OpenAIError)
        return exc.response()

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        return JSONResponse(error_body(str(exc.detail), exc.status_code), exc.status_code)

    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled_error", path=request.url.path)
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", 500), 500)

    routes = [
        Route("/v1/chat/completions", serving.chat, methods=["POST"]),
        Route("/v1/completions", serving.completion, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/admin/stats", admin_stats, methods=["GET"]),
        Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
    ]
    return Starlette(
        routes=routes,
        exception_handlers={OpenAIError: on_openai_error, HTTPException: on_http_error,
                            Exception: on_error},
    )
