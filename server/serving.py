"""Chat and text completions: validate, tokenize, run the request task, shape the answer.

Everything that can be wrong with a request is found before a stream starts, so a bad request
always gets an HTTP error status, never a 200 with an error inside the stream.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import structlog
from pydantic import BaseModel, ValidationError
from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse

from actors.engine import AsyncEngine, EngineError, GenerationDelta, GrammarError
from gpu.sampling_params import SamplingParams
from server.errors import OpenAIError, error_body
from server.protocol import ChatCompletionRequest, CompletionRequest

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class ServingConfig:
    served_model_name: str
    chat_template: str | None = None
    scheduling_policy: str = "fcfs"


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    """JSON body → pydantic model, or a 400 naming the offending field."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(f"request body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise OpenAIError("request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise OpenAIError(f"{param}: {err['msg']}" if param else err["msg"], param=param) from e


class Serving:
    """Request handlers bound to one engine."""

    def __init__(self, engine: AsyncEngine, config: ServingConfig):
        self.engine = engine
        self.config = config
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.info.max_model_len

    # -- shared validation -------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            raise OpenAIError(
                f"The model `{model}` does not exist. Served: `{self.config.served_model_name}`.",
                status=404, param="model",
            )

    def _sampling_params(
        self, body: Any, prompt_len: int, max_tokens: int | None
    ) -> SamplingParams:
        if prompt_len >= self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {prompt_len} tokens, leaving no room for output.", param="messages"
                if isinstance(body, ChatCompletionRequest) else "prompt",
            )
        room = self.max_model_len - prompt_len
        if max_tokens is not None and max_tokens > room:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                f"{max_tokens} for the completion).", param="max_tokens",
            )
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        return SamplingParams(
            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed,
            max_tokens=max_tokens if max_tokens is not None else room, stop=stop,
            stop_token_ids=list(body.stop_token_ids), ignore_eos=body.ignore_eos,
            skip_special_tokens=body.skip_special_tokens,
        )

    async def _structured_outputs(self, body: Any, params: SamplingParams) -> None:
        """Attach the request's guided-decoding constraint, compiled now so that a bad one is a
        400 before any stream starts."""
        spec, param = body.structured_outputs_params()
        if spec is None:
            return
        try:
            await self.engine.compile_grammar(spec)
        except GrammarError as e:
            raise OpenAIError(str(e), param=param) from e
        params.structured_outputs = spec

    def _start(self, request_id: str, prompt_ids: list[int], params: SamplingParams, body: Any):
        if body.priority != 0 and self.config.scheduling_policy != "priority":
            raise OpenAIError(
                "priority is only honoured with --scheduling-policy priority", param="priority"
            )
        return self.engine.generate(request_id, prompt_ids, params, priority=body.priority,
                                    cache_salt=body.cache_salt)

    # -- endpoints ---------------------------------------------------------------------------

    async def chat(self, request: Request):
        body: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest)
        self._check_model(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True,
                chat_template=self.config.chat_template,
            )
        except Exception as e:  # jinja raises for roles/orders the template rejects
            raise OpenAIError(f"chat template failed: {e}", param="messages") from e
        prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        max_tokens = body.max_completion_tokens or body.max_tokens
        params = self._sampling_params(body, len(prompt_ids), max_tokens)
        await self._structured_outputs(body, params)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = self._start(request_id, prompt_ids, params, body)
        meta = _Meta(request_id, int(time.time()), self.config.served_model_name, chat=True,
                     prompt_token_ids=prompt_ids if body.return_token_ids else None)
        if body.stream:
            return EventSourceResponse(_sse(meta, stream), sep="\n")
        return await _until_disconnect(request, _collect(meta, stream))

    async def completion(self, request: Request):
        body: CompletionRequest = await parse_body(request, CompletionRequest)
        self._check_model(body.model)
        prompt_ids = self.tokenizer.encode(body.prompt)
        params = self._sampling_params(body, len(prompt_ids), body.max_tokens)
        await self._structured_outputs(body, params)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = self._start(request_id, prompt_ids, params, body)
        meta = _Meta(request_id, int(time.time()), self.config.served_model_name, chat=False,
                     prompt_token_ids=prompt_ids if body.return_token_ids else None)
        if body.stream:
            return EventSourceResponse(_sse(meta, stream), sep="\n")
        return await _until_disconnect(request, _collect(meta, stream))


@dataclass(slots=True)
class _Meta:
    request_id: str
    created: int
    model: str
    chat: bool
    prompt_token_ids: list[int] | None = None  # set when the client asked for token ids

    def envelope(self, choices: list[dict], chunk: bool, first: bool = True) -> dict:
        if self.chat:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        body = {"id": self.request_id, "object": obj, "created": self.created,
                "model": self.model, "choices": choices}
        if self.prompt_token_ids is not None and first:
            body["prompt_token_ids"] = self.prompt_token_ids
        return body

    def choice(self, index: int, text: str, finish: str | None, token_ids: list[int],
               chunk: bool) -> dict:
        if self.chat and chunk:
            c = {"index": index, "delta": {"content": text} if text else {}}
        elif self.chat:
            c = {"index": index, "message": {"role": "assistant", "content": text}}
        else:
            c = {"index": index, "text": text}
        c["logprobs"] = None
        c["finish_reason"] = finish
        if self.prompt_token_ids is not None:
            c["token_ids"] = token_ids
        return c


def _usage(d: GenerationDelta) -> dict:
    return {"prompt_tokens": d.num_prompt_tokens, "completion_tokens": d.num_output_tokens,
            "total_tokens": d.num_prompt_tokens + d.num_output_tokens}


async def _sse(meta: _Meta, stream: AsyncIterator[GenerationDelta]) -> AsyncIterator[str]:
    """SSE ``data:`` payloads; cancelled by sse-starlette when the client goes away, which
    closes ``stream`` and so aborts the request."""
    start = time.monotonic()
    try:
        async with aclosing(stream) as deltas:
            first = True
            if meta.chat:
                role = {"index": 0, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}
                yield json.dumps(meta.envelope([role], chunk=True))
                first = False
            pending: list[int] = []  # tokens whose text is still held back
            async for d in deltas:
                pending.extend(d.token_ids)
                if not d.text and d.finish_reason is None:
                    continue  # nothing to show yet (held back for a stop string or a UTF-8 char)
                choice = meta.choice(0, d.text, d.finish_reason, pending, chunk=True)
                yield json.dumps(meta.envelope([choice], chunk=True, first=first))
                first, pending = False, []
                if d.finish_reason is not None:
                    _log_done(meta, d, start)
    except EngineError as e:
        yield json.dumps(error_body(str(e), 500))
    yield "[DONE]"


async def _collect(meta: _Meta, stream: AsyncIterator[GenerationDelta]) -> JSONResponse:
    start = time.monotonic()
    parts: list[str] = []
    token_ids: list[int] = []
    last: GenerationDelta | None = None
    try:
        async with aclosing(stream) as deltas:
            async for d in deltas:
                parts.append(d.text)
                token_ids.extend(d.token_ids)
                last = d
    except EngineError as e:
        raise OpenAIError(str(e), status=500) from e
    assert last is not None  # the engine always ends a request with a finish_reason
    choice = meta.choice(0, "".join(parts), last.finish_reason, token_ids, chunk=False)
    body = meta.envelope([choice], chunk=False)
    body["usage"] = _usage(last)
    _log_done(meta, last, start)
    return JSONResponse(body)


def _log_done(meta: _Meta, d: GenerationDelta, start: float) -> None:
    log.info("request_done", request_id=meta.request_id, prompt_tokens=d.num_prompt_tokens,
             output_tokens=d.num_output_tokens, finish_reason=d.finish_reason,
             duration_s=round(time.monotonic() - start, 3))


async def _until_disconnect(request: Request, work) -> Any:
    """Await ``work``; if the client disconnects first, cancel it (which aborts the request)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            log.info("client_disconnected")
    if task.cancelled():
        return JSONResponse(error_body("client disconnected", 499), status_code=499)
    return task.result()
