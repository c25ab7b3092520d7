"""``POST /v1/responses`` and ``GET /v1/responses/{id}``: OpenAI's Responses API on the chat
path.

A response is a chat completion underneath: ``instructions`` become a system message, the
conversation of ``previous_response_id`` (from the in-memory ``ResponseStore``) comes before
this turn's ``input``, the chat template renders them, and ``Serving`` validates the sampling
fields, compiles ``text.format`` into a guided-decoding grammar and starts the one engine
request, so greedy output equals ``/v1/chat/completions`` for the same messages. Function
``tools`` and ``tool_choice`` are planned as on the chat path (``responses_tools``); calls come
back as ``function_call`` items, and ``function_call``/``function_call_output`` input items
are the conversation's assistant tool calls and ``tool`` turns. As on the chat path,
everything that can be wrong is found before a stream starts. (vLLM's
``vllm/entrypoints/openai/serving_responses.py`` is the reference for the flow.)
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pagedserve.actors.engine.protocol import DeltaStream
from pagedserve.server.disconnect import DisconnectWatch, until_disconnect
from pagedserve.server.errors import OpenAIError
from pagedserve.server.openai.output import OnDone, RequestSummary
from pagedserve.server.openai.serving import Serving
from pagedserve.server.request_body import parse_body
from pagedserve.server.responses.events import Progress, ResponseShape, collect, events
from pagedserve.server.responses.protocol import ResponsesRequest
from pagedserve.server.responses.store import ResponseStore, StoredResponse
from pagedserve.server.responses.tools import assistant_turn, plan_response_tools
from pagedserve.server.tools.calling import ToolPlan, keeps_special_tokens


@dataclass(slots=True)
class _Turn:
    """One request, resolved and started.

    Attributes:
        conversation: every turn's messages, without instructions, ending with this input.
        log_done: writes the request log line (its clock starts when the request does).
    """

    shape: ResponseShape
    engine_id: str
    conversation: list[dict[str, Any]]
    stream: DeltaStream
    log_done: OnDone


class ResponsesServing:
    """The Responses API handlers over one ``Serving`` and one ``ResponseStore``."""

    def __init__(self, serving: Serving, store: ResponseStore):
        self.serving = serving
        self.store = store

    def routes(self) -> list[Route]:
        return [Route("/v1/responses", self.create, methods=["POST"]),
                Route("/v1/responses/{response_id}", self.retrieve, methods=["GET"])]

    async def retrieve(self, request: Request) -> JSONResponse:
        response_id = request.path_params["response_id"]
        entry = self.store.get(response_id)
        if entry is None:
            raise OpenAIError(f"Response with id '{response_id}' not found.", status=404,
                              param="response_id")
        return JSONResponse(entry.body)

    async def create(self, request: Request) -> Response:
        body: ResponsesRequest = await parse_body(request, ResponsesRequest)
        self.serving.check_generates("Responses API")
        self.serving.check_model(body.model)
        turn = await self._start(request, body)
        headers = {"X-Request-Id": turn.engine_id}
        if body.stream:
            return EventSourceResponse(events(turn.shape, turn.stream, self._on_done(turn)),
                                       sep="\n", headers=headers)
        watch = DisconnectWatch(request)
        try:
            progress = await until_disconnect(watch, collect(turn.stream, Progress()), turn.engine_id,
                                              [turn.stream])
        finally:
            watch.stop()
        if not isinstance(progress, Progress):
            return progress  # the client went away: the 499 that until_disconnect made
        final = turn.shape.final(progress)
        self._on_done(turn)(final, progress)
        return JSONResponse(final, headers=headers)

    def _conversation(self, body: ResponsesRequest) -> list[dict[str, Any]]:
        """The previous response's conversation, then this input."""
        previous: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            entry = self.store.get(body.previous_response_id)
            if entry is None:
                raise OpenAIError(
                    f"Previous response with id '{body.previous_response_id}' not found.",
                    status=404, param="previous_response_id")
            previous = entry.conversation
        return [*previous, *body.messages()]

    def _prompt_ids(self, body: ResponsesRequest, conversation: list[dict[str, Any]],
                    tools: ToolPlan | None) -> tuple[str, list[int]]:
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        try:
            rendered = self.serving.prompts.render([*system, *conversation],
                                                   tools.tools if tools else None)
        except OpenAIError as e:
            raise OpenAIError(e.message, param="input") from e
        prompt, ids = rendered.text, rendered.token_ids
        limit = self.serving.max_model_len
        if body.max_output_tokens is not None and len(ids) + body.max_output_tokens > limit:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {len(ids) + body.max_output_tokens} tokens ({len(ids)} in the "
                f"input, {body.max_output_tokens} for the output).", param="max_output_tokens")
        return prompt, ids

    async def _start(self, request: Request, body: ResponsesRequest) -> _Turn:
        """Everything that can fail before a stream starts: the conversation, the prompt's
        length, the tools, sampling fields, the grammar, the scheduler's admission."""
        conversation = self._conversation(body)
        tools = await plan_response_tools(body, self.serving)
        prompt, ids = self._prompt_ids(body, conversation, tools)
        sampling = body.sampling_body()
        params = self.serving._sampling_params(sampling, len(ids), body.max_output_tokens,
                                               "input", None)
        if tools is not None and keeps_special_tokens(tools.parser, self.serving.tokenizer):
            params.skip_special_tokens = False
        grammar = await self.serving._structured_outputs(body, params, tools)
        response_id = f"resp_{uuid.uuid4().hex}"
        engine_id = request.headers.get("x-request-id") or response_id
        streams = await self.serving._start(engine_id, [(ids, params)], sampling, grammar)
        shape = ResponseShape(
            response_id=response_id, message_id=f"msg_{uuid.uuid4().hex}",
            created_at=int(time.time()), model=self.serving.config.model_name,
            body=body, num_input_tokens=len(ids), parser=tools.parser if tools else None)
        log_done = self.serving._logger(engine_id, prompt, len(ids))
        return _Turn(shape, engine_id, conversation, streams[0], log_done)

    def _on_done(self, turn: _Turn) -> Callable[[dict[str, Any], Progress], None]:
        """Stores the finished response (when ``store``) and logs it."""

        def done(final: dict[str, Any], progress: Progress) -> None:
            if turn.shape.body.store:
                answer = assistant_turn(final["output"])
                self.store.put(turn.shape.response_id,
                               StoredResponse([*turn.conversation, answer], final))
            turn.log_done(RequestSummary(progress.num_output_tokens,
                                         [progress.finish_reason], progress.ttft_s,
                                         [progress.text]))

        return done
