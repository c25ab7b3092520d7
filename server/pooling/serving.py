"""``POST /v1/embeddings`` and ``/pooling``: validate, tokenize, run pooling requests, shape
the answer (vLLM's ``vllm/entrypoints/pooling/{embed,pooling}/serving.py``, read to learn).

Each input becomes one engine pooling request (``PoolingClient.encode``), all queued at once so
the scheduler batches them. Everything wrong with a request is a 400 before any is queued.
A model served for generation answers vLLM's error (``The model does not support Embeddings
API``); so does an endpoint the pooling model has no head for.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from typing import Any

import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from pagedserve.actors.engine.pooling import PoolingOutput
from pagedserve.actors.engine.protocol import PoolingClient
from pagedserve.actors.errors import EngineError, EngineShuttingDown
from pagedserve.gpu.pooling.pooling_params import PoolingParams
from pagedserve.server.disconnect import DisconnectWatch, until_disconnect
from pagedserve.server.errors import OpenAIError
from pagedserve.server.openai.admission import ADMISSION_ERRORS, admission_error, check_priority
from pagedserve.server.openai.prompts import check_token_ids, truncate_ids
from pagedserve.server.pooling.protocol import EmbeddingRequest, PoolingRequest
from pagedserve.server.request_body import parse_body

log = structlog.get_logger(__name__)

API_NAMES = {"embed": "Embeddings API", "pooling": "Pooling API", "score": "Score API",
             "rerank": "Rerank (Score) API"}


class PoolingServing:
    """The pooling endpoints of one engine. ``serving``: the generation handlers' ``Serving``
    (its model-name check, tokenizer and limits)."""

    def __init__(self, serving: Any):
        self.serving = serving
        self.engine = serving.engine
        self.tokenizer = serving.tokenizer
        self.info = self.engine.info.pooling  # None: a generation model

    def routes(self) -> list[Route]:
        return [Route("/v1/embeddings", self.embeddings, methods=["POST"]),
                Route("/pooling", self.pooling, methods=["POST"])]

    # -- shared by every pooling endpoint (scoring.py too) ----------------------------------

    def require(self, api: str, need_embed: bool = False, need_classifier: bool = False) -> None:
        """vLLM's 400 when the model cannot serve ``api`` (a key of ``API_NAMES``)."""
        if (self.info is None or (need_embed and self.info.is_cross_encoder)
                or (need_classifier and not self.info.is_cross_encoder)):
            raise OpenAIError(f"The model does not support {API_NAMES[api]}")

    def check_length(self, ids: list[int], param: str) -> None:
        limit = self.serving.max_model_len
        if len(ids) > limit:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {len(ids)} tokens in the input for embedding generation. Please "
                f"reduce the length of the input.", param=param)
        if not ids:
            raise OpenAIError(f"{param}: an input has no tokens", param=param)

    async def run(self, request: Request, prefix: str, prompts: list[list[int]],
                  params: list[PoolingParams], body: Any) -> list[PoolingOutput] | JSONResponse:
        """Queue one pooling request per prompt and await them all (a 499 response when the
        client left first: every request is aborted)."""
        check_priority(body, self.engine.config.scheduler.policy)
        engine = self.engine
        if not isinstance(engine, PoolingClient):
            raise OpenAIError("pooling is not served with data parallelism yet", status=501)
        given = request.headers.get("x-request-id")
        request_id = given or f"{prefix}-{uuid.uuid4().hex}"
        watch = DisconnectWatch(request)
        try:
            return await until_disconnect(watch, self._encode_all(engine, request_id, prompts,
                                                                   params, body), request_id)
        finally:
            watch.stop()

    async def _encode_all(self, engine: PoolingClient, request_id: str,
                          prompts: list[list[int]], params: list[PoolingParams],
                          body: Any) -> list[PoolingOutput]:
        tasks = [asyncio.ensure_future(engine.encode(
            f"{request_id}-{i}" if len(prompts) > 1 else request_id, ids, p,
            priority=body.priority, cache_salt=body.cache_salt))
            for i, (ids, p) in enumerate(zip(prompts, params, strict=True))]
        try:
            outs = await asyncio.gather(*tasks)
        except ADMISSION_ERRORS as e:
            raise admission_error(e) from e
        except EngineShuttingDown as e:
            raise OpenAIError(str(e), status=503) from e
        except EngineError as e:
            raise OpenAIError(f"request failed: {e}", status=500) from e
        finally:
            for t in tasks:  # one refused or failed: the others are aborted
                t.cancel()
        log.info("pooling_done", request_id=request_id, inputs=len(prompts),
                 prompt_tokens=sum(len(p) for p in prompts))
        return outs

    def tokenize(self, text: str, add_special_tokens: bool, body: Any) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        return truncate_ids(ids, body.truncate_prompt_tokens, body.truncation_side,
                            self.serving.max_model_len)

    # -- /v1/embeddings and /pooling ----------------------------------------------------------

    def _prompts(self, body: EmbeddingRequest) -> list[list[int]]:
        """The inputs as token ids: OpenAI's four shapes (a string, strings, token ids, lists
        of token ids), each checked and truncated."""
        raw = body.input
        if isinstance(raw, str) or (raw and all(isinstance(t, int) for t in raw)):
            raw = [raw]  # type: ignore[list-item]
        if not raw:
            raise OpenAIError("input: must not be empty", param="input")
        prompts = []
        for item in raw:
            if isinstance(item, str):
                ids = self.tokenize(item, body.add_special_tokens, body)
            else:
                check_token_ids(item, self.serving.vocab_size, "input")
                ids = truncate_ids(list(item), body.truncate_prompt_tokens,
                                   body.truncation_side, self.serving.max_model_len)
            self.check_length(ids, "input")
            prompts.append(ids)
        return prompts

    def embed_params(self, body: EmbeddingRequest) -> PoolingParams:
        """The request's embedding head, with vLLM's Matryoshka checks on ``dimensions``."""
        info = self.info
        dims = body.dimensions if body.dimensions is not None else info.dimensions
        if body.dimensions is not None:
            name = self.serving.config.model_name
            allowed = info.matryoshka_dimensions
            if allowed is None:
                raise OpenAIError(
                    f'Model "{name}" does not support matryoshka representation, changing '
                    f"output dimensions will lead to poor results.", param="dimensions")
            if allowed and dims not in allowed:
                raise OpenAIError(
                    f'Model "{name}" only supports {allowed} matryoshka dimensions, use other '
                    f"output dimensions will lead to poor results.", param="dimensions")
            if dims < 1 or dims > info.hidden_size:
                raise OpenAIError(f"Dimensions must be greater than 0 and at most the "
                                  f"model's {info.hidden_size}", param="dimensions")
        switch = body.normalize if body.normalize is not None else body.use_activation
        return PoolingParams(task="embed", dimensions=dims,
                             normalize=info.normalize if switch is None else switch)

    async def embeddings(self, request: Request):
        body: EmbeddingRequest = await parse_body(request, EmbeddingRequest)
        self.require("embed", need_embed=True)
        self.serving.check_model(body.model)
        prompts = self._prompts(body)
        params = self.embed_params(body)
        outs = await self.run(request, "embd", prompts, [params] * len(prompts), body)
        if isinstance(outs, JSONResponse):
            return outs
        data = [{"index": i, "object": "embedding",
                 "embedding": encode_vector(o.data, body.encoding_format)}
                for i, o in enumerate(outs)]
        return JSONResponse(self._answer(outs, data, "embd"))

    async def pooling(self, request: Request):
        body: PoolingRequest = await parse_body(request, PoolingRequest)
        self.require("pooling")
        self.serving.check_model(body.model)
        prompts = self._prompts(body)
        if self.info.is_cross_encoder:
            use = body.use_activation if body.use_activation is not None else True
            params = PoolingParams(task="classify", use_activation=use)
        else:
            params = self.embed_params(body)
        outs = await self.run(request, "pool", prompts, [params] * len(prompts), body)
        if isinstance(outs, JSONResponse):
            return outs
        data = [{"index": i, "object": "pooling",
                 "data": encode_vector(o.data, body.encoding_format)}
                for i, o in enumerate(outs)]
        return JSONResponse(self._answer(outs, data, "pool"))

    def _answer(self, outs: list[PoolingOutput], data: list[dict], prefix: str) -> dict:
        tokens = sum(o.num_prompt_tokens for o in outs)
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": "list",
                "created": int(time.time()), "model": self.serving.config.model_name,
                "data": data, "usage": usage(tokens)}


def usage(prompt_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
            "completion_tokens": 0, "prompt_tokens_details": None}


def encode_vector(values: list[float], encoding_format: str) -> list[float] | str:
    """``float``: the list; ``base64``: its float32 little-endian bytes, base64 (what OpenAI's
    client decodes with ``numpy.frombuffer(..., dtype="float32")``)."""
    if encoding_format == "float":
        return values
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
