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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import structlog
from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse

from pagedserve.actors.engine.protocol import DeltaStream, EngineClient, Grammar
from pagedserve.actors.engine.request_stream import close_all
from pagedserve.actors.structured_output.manager import GrammarError
from pagedserve.gpu import loader
from pagedserve.gpu.sample.sampling_params import SamplingParams
from pagedserve.server.config import ServingConfig
from pagedserve.server.disconnect import DisconnectWatch, until_disconnect
from pagedserve.server.errors import OpenAIError, error_body
from pagedserve.server.lora_modules import LoRARegistry
from pagedserve.server.openai.admission import ADMISSION_ERRORS, admission_error, check_priority
from pagedserve.server.openai.beam_search import (
    beam_search_response,
    check_beam_search,
    start_beam_searches,
)
from pagedserve.server.openai.chat_prompt import ChatPrompts
from pagedserve.server.openai.logprobs_format import LogprobsFormatter
from pagedserve.server.openai.output import (
    OnDone,
    RequestSummary,
    ResponseBuilder,
    collect,
    sse_events,
)
from pagedserve.server.openai.prompts import (
    PromptInput,
    check_logprob_fields,
    check_logprobs_cap,
    check_token_ids,
    completion_prompts,
    tokenize,
    truncate_ids,
    whole_vocab,
)
from pagedserve.server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    _SamplingBody,
)
from pagedserve.server.request_body import parse_body
from pagedserve.server.tools.calling import (
    ToolPlan,
    check_tool_schemas,
    keeps_special_tokens,
    plan_tools,
)
from pagedserve.server.tools.parser_choice import resolve_auto_tool_choice

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class ChatInputs:
    """A chat request resolved for the engine (``Serving.prepare_chat``).

    Attributes:
        prompt: the rendered prompt's ids (truncated as asked) and text.
        params: its sampling parameters.
        tools: the tool plan, ``None`` without tools.
    """

    prompt: PromptInput
    params: SamplingParams
    tools: ToolPlan | None


def request_id_from(request: Request, prefix: str) -> str:
    """``X-Request-Id`` when the client sent one (echoed back), else a fresh id."""
    given = request.headers.get("x-request-id")
    return given if given else f"{prefix}-{uuid.uuid4().hex}"


class Serving:
    """Request handlers bound to one engine."""

    def __init__(self, engine: EngineClient, config: ServingConfig):
        self.engine = engine
        self.config = config
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.info.max_model_len
        self.vocab_size = engine.info.vocab_size
        self.prompts = ChatPrompts(self.tokenizer, config.chat_template)
        self.auto_tools = resolve_auto_tool_choice(
            self.tokenizer, self.prompts.tool_chat_template, config.tool_call_parser,
            config.enable_auto_tool_choice, config.disable_tool_parser_detection)
        self.loras = self._lora_registry()

    def _lora_registry(self) -> LoRARegistry:
        """The adapters of ``--lora-modules``, checked against the base model. Raises
        ``ValueError`` (a start-up error) for one that cannot be served."""
        lora = self.engine.config.model.lora
        base = loader.load_config(Path(self.engine.info.path))
        names = self.config.served_model_name
        registry = LoRARegistry(lora, base, names[0], names)
        for m in self.config.lora_modules or ():
            try:
                registry.load(m.name, m.path, m.base_model_name)
            except OpenAIError as e:
                raise ValueError(f"--lora-modules {m.name}: {e.message}") from None
        return registry

    # -- shared validation -------------------------------------------------------------------

    def check_generates(self, api: str) -> None:
        """vLLM's 400 for a generation endpoint on a pooling model (``--runner pooling``)."""
        if self.engine.info.runner == "pooling":
            raise OpenAIError(f"The model does not support {api}")

    def check_model(self, model: str | None) -> None:
        """A 404 for a ``model`` that is neither a served name nor a LoRA adapter's."""
        if (model is not None and model not in self.config.served_model_name
                and self.loras.get(model) is None):
            served = ", ".join(f"`{name}`" for name in (*self.config.served_model_name,
                                                        *self.loras.adapters))
            raise OpenAIError(f"The model `{model}` does not exist. Served: {served}.",
                              status=404, param="model")

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
        defaults = self.config.generation_defaults
        max_tokens = defaults.max_tokens_for(max_tokens, room)
        # The generation config's values for the sampling fields the request left out.
        body = body.model_copy(update={k: v for k, v in defaults.sampling.items()
                                       if k not in body.model_fields_set})
        if body.min_tokens > max_tokens:
            raise OpenAIError("min_tokens: must not exceed max_tokens", param="min_tokens")
        check_logprob_fields(body, self.vocab_size, logprobs, self.config.max_logprobs)
        bias = {int(k): v for k, v in (body.logit_bias or {}).items()}
        self.check_token_ids(bias, "logit_bias")
        self.check_token_ids(body.stop_token_ids, "stop_token_ids")
        return SamplingParams(  # top_k past the vocabulary means all of it (no int64 overflow)
            temperature=body.temperature, top_p=body.top_p,
            top_k=min(body.top_k, self.vocab_size), min_p=body.min_p,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty, logit_bias=bias, seed=body.seed,
            max_tokens=max_tokens, min_tokens=body.min_tokens, stop=body.stop_list(),
            include_stop_str_in_output=body.include_stop_str_in_output,
            stop_token_ids=list(body.stop_token_ids), ignore_eos=body.ignore_eos,
            skip_special_tokens=body.skip_special_tokens, logprobs=logprobs,
            logprob_token_ids=body.logprob_token_ids,
            prompt_logprobs=whole_vocab(self._prompt_logprobs(body, logprobs), self.vocab_size),
        )

    def _sample_logprobs(self, k: int | None, param: str) -> int | None:
        """How many top alternatives per sampled token (``-1``: the vocabulary), within
        ``--max-logprobs``; ``None``: no logprobs. Raises ``OpenAIError`` (400)."""
        k = whole_vocab(k, self.vocab_size)
        check_logprobs_cap(k, self.config.max_logprobs, self.vocab_size, "sample", param)
        return k

    @staticmethod
    def _prompt_logprobs(body: _SamplingBody, logprobs: int | None) -> int | None:
        """How many top alternatives per prompt token the engine computes (``None``: it
        computes none): as asked (a stream shows none: only 0 is allowed there, so none is
        computed), or with a completion's ``echo`` and ``logprobs`` that many (vLLM's rule)."""
        echo = isinstance(body, CompletionRequest) and body.echo and logprobs is not None
        if body.prompt_logprobs is not None and (echo or not body.stream):
            return body.prompt_logprobs
        return logprobs if echo else None

    async def _structured_outputs(
        self, body: Any, params: SamplingParams, tools: ToolPlan | None = None,
    ) -> Grammar | None:
        """Attach the request's guided-decoding constraint, compiled now so that a bad one is a
        400 before any stream starts; the compiled grammar goes on to ``add_request``. A
        forced tool call's constraint is one too (and excludes any other)."""
        spec, param = body.structured_outputs_params()
        if tools is not None and tools.constraint is not None:
            if spec is not None and tools.forced:
                raise OpenAIError(f"{param} cannot be combined with a forced tool_choice",
                                  param=param)
            if spec is None:
                spec, param = tools.constraint, "tool_choice"
        if spec is None:
            return None
        try:
            grammar = await self.engine.compile_grammar(spec)
        except GrammarError as e:
            raise OpenAIError(str(e), param=param) from e
        params.structured_outputs = spec
        return grammar

    async def _start(
        self, request_id: str, jobs: list[tuple[list[int], SamplingParams]], body: _SamplingBody,
        grammar: Grammar | None,
    ) -> list[DeltaStream]:
        """Queue ``n`` engine requests per prompt (``jobs``: its ids and parameters), in choice
        order; all accepted, or none kept and an HTTP error raised."""
        check_priority(body, self.engine.config.scheduler.policy)
        streams: list[DeltaStream] = []
        try:
            for p, (prompt_ids, params) in enumerate(jobs):
                base = request_id if len(jobs) == 1 else f"{request_id}-{p}"
                for i in range(body.n):
                    child = params if body.n == 1 else replace(  # n counted on choice 0
                        params, seed=None if params.seed is None else params.seed + i,
                        n=body.n if i == 0 else 0)
                    streams.append(await self.engine.add_request(
                        f"{base}-{i}" if body.n > 1 else base, prompt_ids, child,
                        priority=body.priority, cache_salt=body.cache_salt, grammar=grammar,
                        kv_transfer_params=body.kv_transfer_params,
                        lora_request=self.loras.get(getattr(body, "model", None))))
        except ADMISSION_ERRORS as e:
            close_all(streams)
            raise admission_error(e) from e
        except BaseException:
            close_all(streams)
            raise
        return streams

    def check_token_ids(self, ids: Iterable[int], param: str) -> None:
        """A 400 naming the first id outside the vocabulary, and the vocabulary's size."""
        check_token_ids(ids, self.vocab_size, param)

    # -- endpoints ---------------------------------------------------------------------------

    async def prepare_chat(self, body: ChatCompletionRequest) -> ChatInputs:
        """What a chat request means for the engine: the model checked, the tool plan (its
        schemas compiled), the prompt rendered and the sampling parameters; every 400 of the
        chat path. Also the Messages API's first step (``server/anthropic/serving.py``)."""
        self.check_generates("Messages API")  # chat() has said "Chat Completions API" first
        self.check_model(body.model)
        tools = plan_tools(body, self.auto_tools)
        if tools is not None:
            await check_tool_schemas(body.tools or [], self.engine.compile_grammar)
        rendered = self.prompts.for_messages(
            body.messages, tools.tools if tools else None, body.add_generation_prompt,
            body.continue_final_message, body.chat_template_kwargs)
        prompt_ids = truncate_ids(rendered.token_ids, body.truncate_prompt_tokens,
                                  body.truncation_side, self.max_model_len)
        max_tokens = body.max_completion_tokens or body.max_tokens
        logprobs = self._sample_logprobs((body.top_logprobs or 0) if body.logprobs else None,
                                         "top_logprobs")
        params = self._sampling_params(body, len(prompt_ids), max_tokens, "messages", logprobs)
        if tools is not None and keeps_special_tokens(tools.parser, self.tokenizer):
            params.skip_special_tokens = False
        return ChatInputs(PromptInput(prompt_ids, rendered.text), params, tools)

    async def chat(self, request: Request):
        body: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest)
        self.check_generates("Chat Completions API")
        inputs = await self.prepare_chat(body)
        last = body.messages[-1]
        echo = last.text() if body.echo and last.role == "assistant" else None
        return await self._respond(request, body, [inputs.prompt], [inputs.params],
                                   chat=True, echo=echo, tools=inputs.tools)

    async def completion(self, request: Request):
        body: CompletionRequest = await parse_body(request, CompletionRequest)
        self.check_generates("Completions API")
        self.check_model(body.model)
        prompts = [tokenize(p, self.tokenizer, self.vocab_size, body.truncate_prompt_tokens,
                            body.truncation_side, self.max_model_len)
                   for p in completion_prompts(body.prompt)]
        logprobs = self._sample_logprobs(body.logprobs, "logprobs")
        params = [self._sampling_params(body, len(p.token_ids), body.max_tokens, "prompt",
                                        logprobs) for p in prompts]
        return await self._respond(request, body, prompts, params, chat=False)

    async def _respond(self, request: Request, body: Any, prompts: list[PromptInput],
                       params: list[SamplingParams], chat: bool, echo: str | None = None,
                       tools: ToolPlan | None = None):
        """``prompts`` and their ``params``: one each (chat), or a completion's batch.
        ``echo``: chat's echoed assistant message; ``tools``: chat's tool plan. A client that
        leaves before its requests are accepted never gets them scheduled (``DisconnectWatch``)."""
        if body.use_beam_search:
            check_beam_search(body)
            if tools is not None:
                raise OpenAIError("tools are not supported with use_beam_search", param="tools")
            if self.loras.get(body.model) is not None:
                raise OpenAIError("LoRA adapters are not supported with use_beam_search yet: "
                                  "use the base model or sample without beams", param="model")
        request_id = request_id_from(request, "chatcmpl" if chat else "cmpl")
        watch = DisconnectWatch(request)
        try:
            started = await until_disconnect(
                watch, self._compile_and_start(request_id, prompts, params, body, tools),
                request_id)
            if not isinstance(started, list):
                return started  # the client left before its requests were accepted
            if body.stream and not body.use_beam_search:
                watch.stop()  # sse-starlette watches from here on
            if watch.gone.is_set():  # left just as they were accepted
                close_all(started)
                log.info("client_disconnected", request_id=request_id)
                return JSONResponse(error_body("client disconnected", 499), status_code=499)
            builder = ResponseBuilder(
                request_id=request_id, created=int(time.time()),
                model=self.config.model_name, chat=chat,
                fmt=LogprobsFormatter(self.tokenizer, body.return_tokens_as_token_ids),
                prompts=prompts, n=body.n, return_token_ids=body.return_token_ids,
                echo=not chat and body.echo, chat_echo=echo,
                prompt_logprobs=body.prompt_logprobs is not None,
                want_logprobs=params[0].logprobs is not None,
                tool_parser=tools.parser if tools else None,
                prompt_tokens_details=self.config.enable_prompt_tokens_details,
            )
            on_done = self._logger(request_id, "\n".join(p.text for p in prompts),
                                   sum(len(p.token_ids) for p in prompts))
            if body.use_beam_search:  # never streamed, as vLLM
                return await beam_search_response(watch, started, builder,
                                                  params[0].skip_special_tokens, on_done)
            return await self._answer(watch, builder, body, started, on_done)
        finally:
            watch.stop()

    async def _answer(self, watch: DisconnectWatch, builder: ResponseBuilder, body: Any,
                      streams: list[DeltaStream], on_done: OnDone):
        """The SSE response, or the whole answer once every choice has finished."""
        headers = {"X-Request-Id": builder.request_id}
        if body.stream:
            opts = body.stream_options
            events = sse_events(builder, streams, on_done,
                                include_usage=bool(opts and opts.include_usage),
                                continuous_usage=bool(opts and opts.continuous_usage_stats))
            return EventSourceResponse(events, sep="\n", headers=headers)
        answer = await until_disconnect(watch, collect(builder, streams, on_done),
                                        builder.request_id, streams)
        if isinstance(answer, dict):
            return JSONResponse(answer, headers=headers)
        return answer

    async def _compile_and_start(
        self, request_id: str, prompts: list[PromptInput], params: list[SamplingParams],
        body: Any, tools: ToolPlan | None,
    ) -> list:
        """The constraint compiled, then the engine requests (a beam search: one per prompt)."""
        grammar = await self._structured_outputs(body, params[0], tools)
        for p in params[1:]:  # a batch's prompts share the one compiled constraint
            p.structured_outputs = params[0].structured_outputs
        if body.use_beam_search:
            return await start_beam_searches(self.engine, request_id,
                                             [p.token_ids for p in prompts], body, params)
        return await self._start(request_id, [(p.token_ids, sp) for p, sp in
                                              zip(prompts, params)], body, grammar)

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
