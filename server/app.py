"""The Starlette application: routes and the mapping of errors to OpenAI error objects."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from importlib.metadata import PackageNotFoundError, version

import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pagedserve.actors.engine.protocol import EngineClient
from pagedserve.server.admin.routes import admin_routes
from pagedserve.server.anthropic.serving import MessagesServing
from pagedserve.server.compat.vllm_routes import doc_routes, vllm_routes
from pagedserve.server.config import DEFAULT_MAX_REQUEST_BODY_BYTES
from pagedserve.server.errors import OpenAIError, error_body_for
from pagedserve.server.lora_modules import lora_routes
from pagedserve.server.middleware import DEFAULT_BODY_READ_TIMEOUT_S, RequestGuard, ServerLoad
from pagedserve.server.openai.protocol import DetokenizeRequest, TokenizeRequest
from pagedserve.server.openai.serving import Serving, ServingConfig
from pagedserve.server.pooling.scoring import Scoring
from pagedserve.server.pooling.serving import PoolingServing
from pagedserve.server.request_body import parse_body
from pagedserve.server.responses.api import ResponsesServing
from pagedserve.server.responses.store import ResponseStore
from pagedserve.server.tools.calling import tool_dicts

log = structlog.get_logger(__name__)

ExceptionHandler = Callable[[Request, Exception], Awaitable[Response]]


def _version() -> str:
    try:
        return version("pagedserve")
    except PackageNotFoundError:
        return "0.0.0+unknown"


def build_app(engine: EngineClient, config: ServingConfig,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              access_log: bool = True,
              body_read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S) -> RequestGuard:
    """The ASGI app: routes behind the guard (``config.api_key``, body size limit and read
    timeout, access log)."""
    serving = Serving(engine, config)
    pooling = PoolingServing(serving)
    load = ServerLoad(config.enable_server_load_tracking)

    async def version_route(request: Request) -> JSONResponse:
        return JSONResponse({"version": _version()})

    async def health(request: Request) -> Response:
        return health_response(engine)

    async def reset_prefix_cache(request: Request) -> JSONResponse:
        return JSONResponse({"num_blocks_dropped": await engine.reset_prefix_cache()})

    routes = [
        Route("/v1/chat/completions", serving.chat, methods=["POST"]),
        Route("/v1/completions", serving.completion, methods=["POST"]),
        *ResponsesServing(serving, ResponseStore(config.max_stored_responses)).routes(),
        *pooling.routes(),
        *Scoring(pooling).routes(),
        *MessagesServing(serving).routes(),
        *_model_routes(engine, serving),
        *_tokenizer_routes(engine, serving),
        Route("/version", version_route, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
        *admin_routes(engine, config.model_name, config.admin_key, config.api_key,
                      config.metrics_prefix, serving_json(serving)),
        *vllm_routes(serving.chat, serving.completion, load),
        *lora_routes(serving.loras),
    ]
    routes += doc_routes(routes, _version())
    app = Starlette(routes=routes, exception_handlers=_exception_handlers())
    return RequestGuard(app, config.api_key, max_request_body_bytes, access_log=access_log,
                        load=load, body_read_timeout_s=body_read_timeout_s)


def serving_json(serving: Serving) -> dict:
    """What ``/admin/stats`` shows of the HTTP layer's settings (the dashboard's panel)."""
    auto = serving.auto_tools
    return {"served_model_names": list(serving.config.served_model_name),
            "tool_call_parser": auto.parser, "tool_call_parser_source": auto.source,
            "auto_tool_choice": auto.enabled}


def health_response(engine: EngineClient) -> Response:
    """``/health``: 200 with no body while every engine serves; with data parallelism, 200 and
    ``{"status": "degraded", "failed_engines": {"1": why}}`` while some engine still serves
    (the router avoids the dead ones); 503 with ``{"status": "failed", "reason": ...}`` once
    none does."""
    if engine.failure:
        return JSONResponse({"status": "failed", "reason": engine.failure}, status_code=503)
    degraded = getattr(engine, "degraded", None)  # a DataParallelEngine's failed engines
    if degraded:
        return JSONResponse({"status": "degraded",
                             "failed_engines": {str(k): v for k, v in degraded.items()}})
    return Response(status_code=200)


def _model_routes(engine: EngineClient, serving: Serving) -> list[Route]:
    """``/v1/models`` and ``/v1/models/{model}``: a card per served name (vLLM lists each of
    ``--served-model-name``'s names; the first is the one answers report)."""
    created = int(time.time())

    def card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created,
                "owned_by": "pagedserve", "root": engine.info.path,
                "max_model_len": engine.info.max_model_len}

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list",
                             "data": [card(n) for n in serving.config.served_model_name]
                             + serving.loras.cards(created)})

    async def model(request: Request) -> JSONResponse:
        name = request.path_params["model"]
        serving.check_model(name)
        adapter = [c for c in serving.loras.cards(created) if c["id"] == name]
        return JSONResponse(adapter[0] if adapter else card(name))

    return [Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model:path}", model, methods=["GET"])]


def _tokenizer_routes(engine: EngineClient, serving: Serving) -> list[Route]:
    """``/tokenize`` (text or chat messages → ids) and ``/detokenize`` (ids → text)."""

    async def tokenize(request: Request) -> JSONResponse:
        body: TokenizeRequest = await parse_body(request, TokenizeRequest)
        serving.check_model(body.model)
        if body.messages is not None:  # rendered exactly as the chat endpoint renders it
            ids = serving.prompts.for_messages(
                body.messages, tool_dicts(body.tools) if body.tools else None,
                body.add_generation_prompt, body.continue_final_message,
                body.chat_template_kwargs).token_ids
        else:
            ids = engine.tokenizer.encode(body.prompt,
                                          add_special_tokens=body.add_special_tokens)
        strs = engine.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": engine.info.max_model_len,
                             "tokens": ids, "token_strs": strs})

    async def detokenize(request: Request) -> JSONResponse:
        body: DetokenizeRequest = await parse_body(request, DetokenizeRequest)
        serving.check_model(body.model)
        serving.check_token_ids(body.tokens, "tokens")
        return JSONResponse({"prompt": engine.tokenizer.decode(body.tokens)})

    return [Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"])]


def _exception_handlers() -> dict[type[Exception], ExceptionHandler]:
    """OpenAI error objects (Anthropic's under ``/v1/messages``) for our errors, Starlette's
    HTTP errors and anything unhandled."""

    async def on_openai_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, OpenAIError)
        return exc.response(request.url.path)

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        return JSONResponse(error_body_for(request.url.path, str(exc.detail), exc.status_code),
                            exc.status_code)

    async def on_client_gone(request: Request, exc: Exception) -> Response:
        # The client closed mid-body: a normal event, logged as one (nobody reads the reply).
        log.info("client_disconnected", path=request.url.path, while_reading="body")
        return Response(status_code=499)

    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled_error", path=request.url.path)
        return JSONResponse(error_body_for(
            request.url.path, f"internal error: {type(exc).__name__}: {exc}", 500), 500)

    return {OpenAIError: on_openai_error, HTTPException: on_http_error,
            ClientDisconnect: on_client_gone, Exception: on_error}
