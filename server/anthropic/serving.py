"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API on
the chat path.

A message is a chat completion underneath (vLLM's ``vllm/entrypoints/anthropic/serving.py``
is the reference for the flow): the body becomes a ``ChatCompletionRequest``
(``convert``), ``Serving.prepare_chat`` checks the model, plans the tools, renders the prompt
with the chat template and builds the sampling parameters, and ``Serving`` compiles the
constraint (a forced call's, ``output_config``'s) and starts the one engine request; so greedy
output equals ``/v1/chat/completions`` for the same conversation, and ``count_tokens`` is the
prompt's length as ``/v1/messages`` would compute it. Everything that can be wrong is found
before a stream starts; errors have Anthropic's shape (``errors``), which the app's handlers
and the guard give every path under ``/v1/messages``.
"""

from __future__ import annotations

import uuid

from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pagedserve.actors.engine.protocol import DeltaStream
from pagedserve.actors.engine.request_stream import close_all
from pagedserve.server.anthropic.convert import chat_request
from pagedserve.server.anthropic.errors import anthropic_error_body
from pagedserve.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from pagedserve.server.anthropic.shape import MessageShape, Output, events
from pagedserve.server.disconnect import DisconnectWatch, until_disconnect
from pagedserve.server.openai.output import RequestSummary
from pagedserve.server.openai.serving import ChatInputs, Serving
from pagedserve.server.request_body import parse_body
from pagedserve.server.responses.events import collect
from pagedserve.server.tools.calling import tool_dicts


def _ping() -> ServerSentEvent:
    """The keep-alive sse-starlette sends while a stream is quiet: Anthropic's ``ping``."""
    return ServerSentEvent(event="ping", data='{"type": "ping"}')


class MessagesServing:
    """The Messages API handlers over one ``Serving``."""

    def __init__(self, serving: Serving):
        self.serving = serving

    def routes(self) -> list[Route]:
        return [Route("/v1/messages", self.create, methods=["POST"]),
                Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"])]

    async def count_tokens(self, request: Request) -> JSONResponse:
        """Prompt tokens of a conversation, as ``/v1/messages`` renders it."""
        body: CountTokensRequest = await parse_body(request, CountTokensRequest)
        self.serving.check_model(body.model)
        chat = chat_request(body)
        ids = self.serving.prompts.for_messages(
            chat.messages, tool_dicts(chat.tools) if chat.tools else None,
            chat.add_generation_prompt, chat.continue_final_message,
            chat.chat_template_kwargs).token_ids
        return JSONResponse({"input_tokens": len(ids)})

    async def create(self, request: Request) -> Response:
        """A message, whole or as Anthropic's SSE events."""
        body: MessagesRequest = await parse_body(request, MessagesRequest)
        chat = chat_request(body)
        inputs = await self.serving.prepare_chat(chat)
        message_id = f"msg_{uuid.uuid4().hex}"
        engine_id = request.headers.get("x-request-id") or message_id
        watch = DisconnectWatch(request)
        try:
            started = await until_disconnect(watch, self.serving._compile_and_start(
                engine_id, [inputs.prompt], [inputs.params], chat, inputs.tools), engine_id)
            if not isinstance(started, list):
                return started  # the client left before its request was accepted
            if body.stream:
                watch.stop()  # sse-starlette watches from here on
            if watch.gone.is_set():  # left just as it was accepted
                close_all(started)
                return JSONResponse(anthropic_error_body("client disconnected", 499), 499)
            return await self._answer(watch, body, inputs, message_id, engine_id, started[0])
        finally:
            watch.stop()

    async def _answer(self, watch: DisconnectWatch, body: MessagesRequest, inputs: ChatInputs,
                      message_id: str, engine_id: str, stream: DeltaStream) -> Response:
        shape = MessageShape(message_id, self.serving.config.model_name,
                             len(inputs.prompt.token_ids),
                             inputs.tools.parser if inputs.tools else None)
        log_done = self.serving._logger(engine_id, inputs.prompt.text,
                                        len(inputs.prompt.token_ids))

        def done(out: Output) -> None:
            log_done(RequestSummary(out.num_output_tokens, [out.finish_reason], out.ttft_s,
                                    [out.text]))

        headers = {"X-Request-Id": engine_id, "request-id": engine_id}
        if body.stream:
            return EventSourceResponse(events(shape, stream, done), sep="\n", headers=headers,
                                       ping_message_factory=_ping)
        out = await until_disconnect(watch, collect(stream, Output()), engine_id, [stream])
        if not isinstance(out, Output):
            return out  # the client went away: the 499 that until_disconnect made
        done(out)
        return JSONResponse(shape.whole(out), headers=headers)
