"""Chat and text completions: validate, tokenize, run the request tasks, shape the answer.

Everything that can be wrong with a request is found before a stream starts (including the
scheduler's admission), so a bad request always gets an HTTP error status, never a 200 with an
error inside the stream. ``n > 1`` fans out into ``n`` engine requests with the same prompt,
which share its KV blocks through the prefix cache (as vLLM V1 does).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import structlog
from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse

from pagedserve.actors.engine import AsyncEngine
from pagedserve.actors.errors import DuplicateRequestId, EngineOverloaded
from pagedserve.actors.request_stream import RequestStream, close_all
from pagedserve.actors.structured_output import CompiledConstraint, GrammarError
from pagedserve.gpu.sampling_params import SamplingParams
from pagedserve.server.config import ServingConfig
from pagedserve.server.errors import OpenAIError, error_body
from pagedserve.server.protocol import ChatCompletionRequest, CompletionRequest, _SamplingBody
from pagedserve.server.request_body import parse_body
from pagedserve.server.responses import (
    DisconnectWatch,
    OnDone,
    RequestSummary,
    ResponseBuilder,
    collect,
    sse_events,
    until_disconnect,
)

log = structlog.get_logger(__name__)


def request_id_from(request: Request, prefix: str) -> str:
    """``X-Request-Id`` when the client sent one (echoed back), else a fresh id."""
    given = request.headers.get("x-request-id")
    return given if given else f"{prefix}-{uuid.uuid4().hex}"


class Serving:
    """Request handlers bound to one engine."""

    def __init__(self, engine: AsyncEngine, config: ServingConfig):
        self.engine = engine
        self.config = config
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.info.max_model_len
        self.vocab_size = engine.info.vocab_size

    # -- shared validation -------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            raise OpenAIError(
                f"The model `{model}` does not exist. Served: `{self.config.served_model_name}`.",
                status=404, param="model",
            )

    def _sampling_params(
        self, body: _SamplingBody, prompt_len: int, max_tokens: int | None, prompt_param: str,
        logprobs: int | None,
    ) -> SamplingParams:
        if prompt_len >= self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {prompt_len} tokens, leaving no room for output.", param=prompt_param,
            )
        room = self.max_model_len - prompt_len
        if max_tokens is not None and max_tokens > room:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                f"{max_tokens} for the completion).", param="max_tokens",
            )
        if body.min_tokens > (max_tokens or room):
            raise OpenAIError("min_tokens: must not exceed max_tokens", param="min_tokens")
        bias = {int(k): v for k, v in (body.logit_bias or {}).items()}
        self.check_token_ids(bias, "logit_bias")
        self.check_token_ids(body.stop_token_ids, "stop_token_ids")
        return SamplingParams(  # top_k past the vocabulary means all of it (no int64 overflow)
            temperature=body.temperature, top_p=body.top_p,
            top_k=min(body.top_k, self.vocab_size), min_p=body.min_p,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty, logit_bias=bias, seed=body.seed,
            max_tokens=max_tokens if max_tokens is not None else room,
            min_tokens=body.min_tokens, stop=body.stop_list(),
            include_stop_str_in_output=body.include_stop_str_in_output,
            stop_token_ids=list(body.stop_token_ids), ignore_eos=body.ignore_eos,
            skip_special_tokens=body.skip_special_tokens, logprobs=logprobs,
        )

    async def _structured_outputs(
        self, body: Any, params: SamplingParams,
    ) -> CompiledConstraint | None:
        """Attach the request's guided-decoding constraint, compiled now so that a bad one is a
        400 before any stream starts; the compiled grammar goes on to ``add_request``."""
        spec, param = body.structured_outputs_params()
        if spec is None:
            return None
        try:
            grammar = await self.engine.compile_grammar(spec)
        except GrammarError as e:
            raise OpenAIError(str(e), param=param) from e
        params.structured_outputs = spec
        return grammar

    async def _start(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, body: _SamplingBody,
        grammar: CompiledConstraint | None,
    ) -> list[RequestStream]:
        """Queue ``n`` engine requests; all accepted, or none kept and an HTTP error raised."""
        if body.priority != 0 and self.engine.config.scheduler.policy != "priority":
            raise OpenAIError(
                "priority is only honoured with --scheduling-policy priority", param="priority"
            )
        streams: list[RequestStream] = []
        try:
            for i in range(body.n):
                child = params if body.n == 1 else replace(
                    params, seed=None if params.seed is None else params.seed + i)
                streams.append(await self.engine.add_request(
                    f"{request_id}-{i}" if body.n > 1 else request_id, prompt_ids, child,
                    priority=body.priority, cache_salt=body.cache_salt, grammar=grammar))
        except EngineOverloaded as e:
            close_all(streams)
            raise OpenAIError(str(e), status=503, headers={"Retry-After": "1"}) from e
        except DuplicateRequestId as e:
            close_all(streams)
            raise OpenAIError(str(e), status=400, param="X-Request-Id") from e
        except BaseException:
            close_all(streams)
            raise
        return streams

    def check_token_ids(self, ids: Iterable[int], param: str) -> None:
        """A 400 naming the first id outside the vocabulary, and the vocabulary's size."""
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise OpenAIError(f"{param}: token id {t} is out of vocabulary (the "
                                  f"vocabulary has {self.vocab_size} tokens, ids 0 to "
                                  f"{self.vocab_size - 1})", param=param)

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_token_ids(ids, "prompt")
        if not ids:
            raise OpenAIError("prompt: a prompt must be given and non-empty", param="prompt")
        return ids

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False,
                    kwargs: dict[str, Any] | None = None) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=self.config.chat_template, **(kwargs or {}),
            )
        except Exception as e:  # jinja raises for roles/orders the template rejects
            raise OpenAIError(f"chat template failed: {e}", param="messages") from e

    # -- endpoints ---------------------------------------------------------------------------

    async def chat(self, request: Request):
        body: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest)
        self.check_model(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        prompt = self.chat_prompt(messages, body.add_generation_prompt,
                                  body.continue_final_message, body.chat_template_kwargs)
        prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        max_tokens = body.max_completion_tokens or body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = self._sampling_params(body, len(prompt_ids), max_tokens, "messages", logprobs)
        return await self._respond(request, body, prompt, prompt_ids, params, chat=True)

    async def completion(self, request: Request):
        body: CompletionRequest = await parse_body(request, CompletionRequest)
        self.check_model(body.model)
        prompt_ids = self._prompt_ids(body.prompt)
        params = self._sampling_params(body, len(prompt_ids), body.max_tokens, "prompt",
                                       body.logprobs)
        prompt_text = body.prompt if isinstance(body.prompt, str) else (
            self.tokenizer.decode(prompt_ids))
        return await self._respond(request, body, prompt_text, prompt_ids, params, chat=False,
                                   echo=prompt_text if body.echo else None)

    async def _respond(self, request: Request, body: Any, prompt: str, prompt_ids: list[int],
                       params: SamplingParams, chat: bool, echo: str | None = None):
        request_id = request_id_from(request, "chatcmpl" if chat else "cmpl")
        watch = DisconnectWatch(request)
        try:
            started = await until_disconnect(
                watch, self._compile_and_start(request_id, prompt_ids, params, body),
                request_id)
            if not isinstance(started, list):
                return started  # the client left before its requests were accepted
            streams: list[RequestStream] = started
            if body.stream:
                watch.stop()  # sse-starlette watches from here on
            if watch.gone.is_set():  # left just as they were accepted
                close_all(streams)
                log.info("client_disconnected", request_id=request_id)
                return JSONResponse(error_body("client disconnected", 499), status_code=499)
            return await self._answer(watch, request_id, body, prompt, prompt_ids, streams,
                                      chat, echo)
        finally:
            watch.stop()

    async def _answer(self, watch: DisconnectWatch, request_id: str, body: Any, prompt: str,
                      prompt_ids: list[int], streams: list[RequestStream], chat: bool,
                      echo: str | None):
        """The SSE response, or the whole answer once every choice has finished."""
        builder = ResponseBuilder(
            request_id=request_id, created=int(time.time()),
            model=self.config.served_model_name, chat=chat, tokenizer=self.tokenizer,
            prompt_token_ids=prompt_ids if body.return_token_ids else None,
            num_prompt_tokens=len(prompt_ids), echo=echo,
        )
        on_done = self._logger(request_id, prompt, len(prompt_ids))
        headers = {"X-Request-Id": request_id}
        if body.stream:
            opts = body.stream_options
            events = sse_events(builder, streams, on_done,
                                include_usage=bool(opts and opts.include_usage),
                                continuous_usage=bool(opts and opts.continuous_usage_stats))
            return EventSourceResponse(events, sep="\n", headers=headers)
        answer = await until_disconnect(watch, collect(builder, streams, on_done),
                                        request_id, streams)
        if isinstance(answer, dict):
            return JSONResponse(answer, headers=headers)
        return answer

    async def _compile_and_start(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, body: Any,
    ) -> list[RequestStream]:
        grammar = await self._structured_outputs(body, params)
        return await self._start(request_id, prompt_ids, params, body, grammar)

    def _logger(self, request_id: str, prompt: str, num_prompt: int) -> OnDone:
        start = time.monotonic()
        verbose = self.config.enable_log_requests

        def done(summary: RequestSummary) -> None:
            extra = {"prompt": prompt, "output": summary.texts} if verbose else {}
            ttft = summary.ttft_s
            log.info("request_done", request_id=request_id, prompt_tokens=num_prompt,
                     output_tokens=summary.num_output_tokens,
                     finish_reason=summary.finish_reasons,
                     ttft_s=None if ttft is None else round(ttft, 4),
                     duration_s=round(time.monotonic() - start, 4), **extra)

        return done
