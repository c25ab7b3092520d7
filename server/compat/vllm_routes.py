"""Routes vLLM's server has beside the OpenAI ones: ``/load``, SageMaker's ``/ping`` and
``/invocations``, and the API description (``/openapi.json``, ``/docs``).

- ``GET /load``: ``{"server_load": N}``, the generation requests in flight (counted by the
  guard, ``middleware.ServerLoad``) when ``--enable-server-load-tracking`` is on, else 0, as in
  vLLM's ``api_server.py``;
- ``GET|POST /ping``: ``/health`` under SageMaker's name;
- ``POST /invocations``: SageMaker's one route: a body with ``messages`` is a chat completion,
  one with ``prompt`` a completion (vLLM tries its request types in that order);
- ``GET /openapi.json``, ``GET /docs``: ``server/admin/openapi.py``.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Route

from pagedserve.server.admin.openapi import docs_page, openapi_spec
from pagedserve.server.errors import OpenAIError
from pagedserve.server.middleware import ServerLoad

Handler = Callable[[Request], Awaitable[Response]]


def vllm_routes(chat: Handler, completion: Handler, load: ServerLoad) -> list[BaseRoute]:
    """``/load``, ``/ping`` and ``/invocations`` (``chat``/``completion``: the OpenAI
    routes' handlers, which parse the body themselves)."""

    async def server_load(request: Request) -> JSONResponse:
        """Generation requests in flight (0 unless --enable-server-load-tracking)."""
        return JSONResponse({"server_load": load.value})

    async def ping(request: Request) -> Response:
        """Health check under SageMaker's name."""
        return Response(status_code=200)

    async def invocations(request: Request) -> Response:
        """SageMaker: a chat completion when the body has messages, else a completion."""
        try:
            body = json.loads(await request.body())  # Starlette keeps it for the handler
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, ValueError) as e:
            raise OpenAIError(f"request body is not valid JSON: {e}") from e
        if isinstance(body, dict) and "messages" in body:
            return await chat(request)
        if isinstance(body, dict) and "prompt" in body:
            return await completion(request)
        raise OpenAIError("no handler takes this body: /invocations expects a "
                          "ChatCompletionRequest (with `messages`) or a CompletionRequest "
                          "(with `prompt`)")

    return [Route("/load", server_load, methods=["GET"]),
            Route("/ping", ping, methods=["GET", "POST"]),
            Route("/invocations", invocations, methods=["POST"])]


def doc_routes(routes: list[BaseRoute], version: str) -> list[BaseRoute]:
    """``/openapi.json`` and ``/docs`` for ``routes`` (and themselves), built once."""
    cache: dict[str, dict] = {}

    def spec() -> dict:
        if "spec" not in cache:
            cache["spec"] = openapi_spec([*routes, *own], "pagedserve", version)
        return cache["spec"]

    async def openapi(request: Request) -> JSONResponse:
        """This document."""
        return JSONResponse(spec())

    async def docs(request: Request) -> HTMLResponse:
        """The routes and request schemas, as a page."""
        return HTMLResponse(docs_page(spec()), headers={
            "Content-Security-Policy": "default-src 'none'; style-src 'self'; img-src 'self'"})

    own: list[BaseRoute] = [Route("/openapi.json", openapi, methods=["GET"]),
                            Route("/docs", docs, methods=["GET"])]
    return own
