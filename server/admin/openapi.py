"""``GET /openapi.json`` and ``GET /docs``: the API described from the routes and the pydantic
protocol models, so the description cannot drift from what is validated.

vLLM gets both from FastAPI; here the request schemas are pydantic's own
(``models_json_schema``, JSON Schema 2020-12 as OpenAPI 3.1 takes it) and the routes are read
from the Starlette route table. ``/docs`` is one static HTML page (no script, no CDN) listing
the routes and linking each request schema to its JSON.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterable

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.routing import BaseRoute, Route

from pagedserve.server.anthropic.errors import is_messages_path
from pagedserve.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from pagedserve.server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagedserve.server.pooling.protocol import (
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from pagedserve.server.responses.protocol import ResponsesRequest

# The body each POST route validates (``/invocations`` takes either generation body).
REQUEST_BODIES: dict[str, tuple[type[BaseModel], ...]] = {
    "/v1/chat/completions": (ChatCompletionRequest,),
    "/v1/completions": (CompletionRequest,),
    "/v1/responses": (ResponsesRequest,),
    "/v1/messages": (MessagesRequest,),
    "/v1/messages/count_tokens": (CountTokensRequest,),
    "/invocations": (ChatCompletionRequest, CompletionRequest),
    "/tokenize": (TokenizeRequest,),
    "/detokenize": (DetokenizeRequest,),
    "/v1/embeddings": (EmbeddingRequest,),
    "/pooling": (PoolingRequest,),
    **dict.fromkeys(("/score", "/v1/score"), (ScoreRequest,)),
    **dict.fromkeys(("/rerank", "/v1/rerank", "/v2/rerank"), (RerankRequest,)),
}
# What each route does, for /docs' "what" column and the spec's summaries (a handler's
# docstring is for whoever reads the code; this is for whoever calls the route).
SUMMARIES: dict[str, str] = {
    "/v1/chat/completions": "Chat completion (OpenAI): messages in, a message or an SSE stream "
                            "out; tools, structured output, logprobs, n, beam search.",
    "/v1/completions": "Text completion (OpenAI): a prompt (text, token ids, or a list) in.",
    "/v1/responses": "Responses API (OpenAI): input items and instructions in, output items "
                     "out; previous_response_id continues a stored response.",
    "/v1/responses/{response_id}": "A stored response by its id.",
    "/v1/messages": "Messages API (Anthropic): system and messages in, content blocks (text, "
                    "tool_use) or Anthropic's SSE events out; tools, stop_sequences.",
    "/v1/messages/count_tokens": "Prompt tokens of a Messages API conversation.",
    "/v1/models": "The served model names (--served-model-name) and LoRA adapters (with "
                  "their parent), one card each.",
    "/v1/load_lora_adapter": "Load a LoRA adapter by lora_name and lora_path "
                             "(VLLM_ALLOW_RUNTIME_LORA_UPDATING=1).",
    "/v1/unload_lora_adapter": "Unload a LoRA adapter by lora_name "
                               "(VLLM_ALLOW_RUNTIME_LORA_UPDATING=1).",
    "/v1/models/{model}": "One served name's card; 404 for a name not served.",
    "/tokenize": "Token ids of a prompt or of chat messages (rendered as the chat route "
                 "renders them).",
    "/detokenize": "Text of token ids.",
    "/version": "The server's version.",
    "/health": "200 while the engine serves, else 503 (shutting down, or failed).",
    "/reset_prefix_cache": "Drop the prefix cache's unused blocks.",
    "/": "The chat page.",
    "/admin": "The dashboard: queues, KV cache, throughput, requests, settings.",
    "/admin/stats": "The engine's stats snapshot as JSON (the dashboard's data).",
    "/admin/events": "Stats snapshots as an SSE stream.",
    "/metrics": "Prometheus metrics (--metrics-prefix vllm: vLLM's names).",
    "/favicon.ico": "The pages' icon.",
    "/v1/embeddings": "Embeddings (OpenAI): one vector per input (--runner pooling).",
    "/pooling": "vLLM's raw pooling output per input: an embedding, or a classifier's scores.",
    **dict.fromkeys(("/score", "/v1/score"), "Scores of text pairs: a cross-encoder's, or the "
                    "cosine of their embeddings (vLLM's shape)."),
    **dict.fromkeys(("/rerank", "/v1/rerank", "/v2/rerank"), "Documents ranked by relevance "
                    "to a query (Jina's and Cohere's shape)."),
}
_REF = "#/components/schemas/{model}"
_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}},
}
_ANTHROPIC_ERROR = {
    "type": "object", "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "error": {"type": "object", "properties": {
        "type": {"type": "string"}, "message": {"type": "string"}}}},
}


def openapi_spec(routes: Iterable[BaseRoute], title: str, version: str) -> dict:
    """An OpenAPI 3.1 document for ``routes`` (``Route``s only; mounts are static files)."""
    models = sorted({m for ms in REQUEST_BODIES.values() for m in ms}, key=lambda m: m.__name__)
    refs, schema = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
    components = dict(schema.get("$defs", {}))
    components["ErrorResponse"] = _ERROR
    components["AnthropicErrorResponse"] = _ANTHROPIC_ERROR
    paths: dict[str, dict] = {}
    for route in routes:
        if not isinstance(route, Route):
            continue
        path = re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path)  # {model:path} -> {model}
        for method in sorted((route.methods or set()) - {"HEAD"}):
            paths.setdefault(path, {})[method.lower()] = _operation(
                route, path, method, [refs[(m, "validation")] for m in REQUEST_BODIES.get(
                    route.path, ()) if method == "POST"])
    return {"openapi": "3.1.0", "info": {"title": title, "version": version},
            "paths": paths, "components": {"schemas": components}}


def _operation(route: Route, path: str, method: str, bodies: list[dict]) -> dict:
    doc = (route.endpoint.__doc__ or "").strip().split("\n")[0]
    error = ("Anthropic", "AnthropicErrorResponse") if is_messages_path(path) else (
        "OpenAI", "ErrorResponse")
    op: dict = {"operationId": f"{method.lower()}_{route.name}",
                "summary": SUMMARIES.get(path) or doc or method.upper(),
                "responses": {"200": {"description": "OK"},
                              "4XX": {"description": f"{error[0]} error object", "content": {
                                  "application/json": {"schema": {
                                      "$ref": _REF.format(model=error[1])}}}}}}
    params = [p for p in route.param_convertors]
    if params:
        op["parameters"] = [{"name": p, "in": "path", "required": True,
                             "schema": {"type": "string"}} for p in params]
    if bodies:
        schema = bodies[0] if len(bodies) == 1 else {"anyOf": bodies}
        op["requestBody"] = {"required": True,
                             "content": {"application/json": {"schema": schema}}}
    return op


def docs_page(spec: dict) -> str:
    """``/docs``: the routes, each with its summary and request schema, as plain HTML."""
    rows = []
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {})
            refs = [s["$ref"] for s in body.get("schema", {}).get("anyOf", [body.get("schema")])
                    if s]
            names = ", ".join(f'<a href="#{html.escape(r.rsplit("/", 1)[1])}">'
                              f'{html.escape(r.rsplit("/", 1)[1])}</a>' for r in refs)
            rows.append(f'<tr><td><code class="method">{method.upper()}</code></td>'
                        f"<td><code>{html.escape(path)}</code></td>"
                        f"<td>{html.escape(op['summary'])}</td><td>{names}</td></tr>")
    schemas = "".join(
        f'<h3 id="{html.escape(name)}">{html.escape(name)}</h3>'
        f"<pre>{html.escape(json.dumps(s, indent=2, ensure_ascii=False))}</pre>"
        for name, s in spec["components"]["schemas"].items())
    title = html.escape(f"{spec['info']['title']} {spec['info']['version']}")
    return ("<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{title} API</title>"
            '<link rel="stylesheet" href="/static/style.css">'
            '<link rel="icon" href="/static/favicon.svg" type="image/svg+xml"></head>'
            '<body class="docs"><header class="topbar"><span class="brand">pagedserve</span>'
            '<span class="muted">API</span><nav><a href="/">chat</a> · '
            '<a href="/admin">dashboard</a></nav></header><main>'
            f"<h1>{title} API</h1><p>Machine-readable: <a href=\"/openapi.json\">"
            "/openapi.json</a> (OpenAPI 3.1).</p><table class=\"routes\">"
            "<tr><th>method</th><th>path</th><th>what</th><th>request body</th></tr>"
            f"{''.join(rows)}</table><h2>Schemas</h2>{schemas}</main></body></html>")
