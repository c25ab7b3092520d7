"""Shaping one engine request's output into the Responses API's objects: the ``Response``, its
one output ``message`` item, usage, and the stream's server-sent events.

Shapes and event names follow the ``openai`` package's ``types/responses/`` (``Response``,
``ResponseOutputMessage``, ``ResponseOutputText``, ``ResponseUsage`` and the
``Response*Event`` models); vLLM's ``vllm/entrypoints/openai/serving_responses.py`` streams the
same sequence for text::

    response.created → response.in_progress → response.output_item.added
      → response.content_part.added → response.output_text.delta × N
      → response.output_text.done → response.content_part.done → response.output_item.done
      → response.completed (or response.incomplete when max_output_tokens cut it)

Every event carries ``type`` and a ``sequence_number`` counting from 0; the SSE ``event:`` line
repeats the type, as OpenAI sends it. There is no ``[DONE]``: the terminal event ends it.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from pagedserve.actors.errors import EngineError, EngineShuttingDown
from pagedserve.actors.request_stream import GenerationDelta, RequestStream
from pagedserve.server.errors import OpenAIError
from pagedserve.server.responses_protocol import FunctionTool, NamedFunctionChoice, ResponsesRequest

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Progress:
    """The output so far: text, tokens, how it ended, time to first token (seconds)."""

    start: float = field(default_factory=time.monotonic)
    text: str = ""
    num_output_tokens: int = 0
    finish_reason: str | None = None
    ttft_s: float | None = None

    def add(self, d: GenerationDelta) -> None:
        if self.ttft_s is None and d.token_ids:
            self.ttft_s = time.monotonic() - self.start
        self.text += d.text
        self.num_output_tokens = d.num_output_tokens
        self.finish_reason = d.finish_reason


@dataclass(slots=True)
class ResponseShape:
    """Builds the JSON objects of one response; the request's settings are echoed back."""

    response_id: str
    message_id: str
    created_at: int
    model: str
    body: ResponsesRequest
    num_input_tokens: int

    def message(self, text: str | None, status: str) -> dict[str, Any]:
        """The output message item; ``text`` ``None`` = no content part yet."""
        content = [] if text is None else [self.text_part(text)]
        return {"id": self.message_id, "type": "message", "role": "assistant",
                "status": status, "content": content}

    @staticmethod
    def text_part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def usage(self, num_output_tokens: int) -> dict[str, Any]:
        return {"input_tokens": self.num_input_tokens,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": num_output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.num_input_tokens + num_output_tokens}

    def response(self, status: str, output: list[dict[str, Any]],
                 usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The ``Response`` object; ``status`` is in_progress, completed, incomplete or failed."""
        b = self.body
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at,
            "status": status, "model": self.model, "output": output, "error": error,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "previous_response_id": b.previous_response_id, "temperature": b.temperature,
            "top_p": b.top_p, "parallel_tool_calls": b.parallel_tool_calls,
            "tool_choice": (b.tool_choice.model_dump() if isinstance(b.tool_choice,
                                                                     NamedFunctionChoice)
                            else b.tool_choice),
            "tools": [t.model_dump() for t in b.tools if isinstance(t, FunctionTool)],
            "text": {"format": self.text_format()}, "truncation": b.truncation,
            "store": b.store, "metadata": b.metadata or {}, "user": b.user,
            "background": False, "reasoning": None, "usage": usage,
            "completed_at": time.time() if status == "completed" else None,
        }

    def text_format(self) -> dict[str, Any]:
        fmt = self.body.text.format
        if fmt.type != "json_schema":
            return {"type": fmt.type}
        return {"type": "json_schema", "name": fmt.name, "schema": fmt.json_schema,
                "description": fmt.description, "strict": fmt.strict}

    def final(self, progress: Progress) -> dict[str, Any]:
        """The finished ``Response``: completed, or incomplete when cut by length."""
        done = progress.finish_reason != "length"
        status = "completed" if done else "incomplete"
        return self.response(status, [self.message(progress.text, status)],
                             self.usage(progress.num_output_tokens))


def engine_error(e: EngineError) -> OpenAIError:
    """An engine failure before any byte was sent: 503 while shutting down, else 500."""
    return OpenAIError(str(e), status=503 if isinstance(e, EngineShuttingDown) else 500)


async def collect(stream: RequestStream) -> Progress:
    """The whole output of a non-streamed response."""
    progress = Progress()
    try:
        async for d in stream:
            progress.add(d)
    except EngineError as e:
        raise engine_error(e) from e
    finally:
        stream.close()
    return progress


async def events(shape: ResponseShape, stream: RequestStream,
                 on_done: Callable[[dict[str, Any], Progress], None]
                 ) -> AsyncIterator[dict[str, str]]:
    """The SSE events (``{"event", "data"}`` for sse-starlette) of a streamed response.
    ``on_done`` gets the final ``Response`` when the output ended (not when the client went
    away: sse-starlette cancels this generator, which closes the stream and aborts the
    request)."""
    seq = 0

    def event(kind: str, **fields: Any) -> dict[str, str]:
        nonlocal seq
        seq += 1
        return {"event": kind,
                "data": json.dumps({"type": kind, "sequence_number": seq - 1, **fields})}

    where = {"item_id": shape.message_id, "output_index": 0}
    progress = Progress()
    yield event("response.created", response=shape.response("in_progress", []))
    yield event("response.in_progress", response=shape.response("in_progress", []))
    yield event("response.output_item.added", output_index=0,
                item=shape.message(None, "in_progress"))
    yield event("response.content_part.added", **where, content_index=0,
                part=shape.text_part(""))
    try:
        async for d in stream:
            progress.add(d)
            if d.text:
                yield event("response.output_text.delta", **where, content_index=0,
                            delta=d.text, logprobs=[])
    except Exception as e:  # the stream already started: report in-band, then end it
        if isinstance(e, EngineShuttingDown):
            log.info("stream_ended_by_shutdown", response_id=shape.response_id)
        else:
            log.exception("responses_stream_failed", response_id=shape.response_id)
        error = {"code": "server_error", "message": f"{type(e).__name__}: {e}"}
        yield event("response.failed", response=shape.response(
            "failed", [shape.message(progress.text, "incomplete")],
            shape.usage(progress.num_output_tokens), error))
        return
    finally:
        stream.close()
    final = shape.final(progress)
    item = final["output"][0]
    yield event("response.output_text.done", **where, content_index=0, text=progress.text,
                logprobs=[])
    yield event("response.content_part.done", **where, content_index=0,
                part=item["content"][0])
    yield event("response.output_item.done", output_index=0, item=item)
    on_done(final, progress)
    kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
    yield event(kind, response=final)
