"""Shaping one engine request's output into the Responses API's objects: the ``Response``, its
output items (a ``message``; with tools, ``function_call`` items too), usage, and the stream's
server-sent events.

Shapes and event names follow the ``openai`` package's ``types/responses/`` (``Response``,
``ResponseOutputMessage``, ``ResponseOutputText``, ``ResponseUsage`` and the
``Response*Event`` models); vLLM's ``vllm/entrypoints/openai/serving_responses.py`` streams the
same sequence for text::

    response.created → response.in_progress → response.output_item.added
      → response.content_part.added → response.output_text.delta × N
      → response.output_text.done → response.content_part.done → response.output_item.done
      → response.completed (or response.incomplete when max_output_tokens cut it)

With a tool parser, each item opens when the parser first sees its part of the text (content:
a message; a call: ``response.output_item.added`` → ``response.function_call_arguments.delta``
× N → ``response.function_call_arguments.done`` → ``response.output_item.done``), and an item
closes when the next one opens or the output ends.

Every event carries ``type`` and a ``sequence_number`` counting from 0; the SSE ``event:`` line
repeats the type, as OpenAI sends it. There is no ``[DONE]``: the terminal event ends it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import structlog

from pagedserve.actors.engine.protocol import DeltaStream, GenerationDelta
from pagedserve.actors.errors import EngineError, EngineShuttingDown
from pagedserve.server.errors import OpenAIError
from pagedserve.server.responses.protocol import FunctionTool, NamedFunctionChoice, ResponsesRequest
from pagedserve.server.responses.tools import call_items, function_call_item
from pagedserve.server.tools.parsers import ToolParser

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

    @property
    def status(self) -> str:
        """The finished response's status: incomplete when cut by length."""
        return "incomplete" if self.finish_reason == "length" else "completed"


@dataclass(slots=True)
class ResponseShape:
    """Builds the JSON objects of one response; the request's settings are echoed back."""

    response_id: str
    message_id: str
    created_at: int
    model: str
    body: ResponsesRequest
    num_input_tokens: int
    parser: ToolParser | None = None  # with tools: reads the calls out of the text

    def message(self, text: str | None, status: str,
                item_id: str | None = None) -> dict[str, Any]:
        """An output message item (``item_id`` ``None``: the first message's id); ``text``
        ``None`` = no content part yet."""
        content = [] if text is None else [self.text_part(text)]
        return {"id": item_id or self.message_id, "type": "message", "role": "assistant",
                "status": status, "content": content}

    def output(self, text: str, status: str) -> list[dict[str, Any]]:
        """A whole output's items: its message, or with tools the content's message (none
        when there are only calls) and then one ``function_call`` item per call."""
        if self.parser is None:
            return [self.message(text, status)]
        out = self.parser.extract(text)
        content = [] if out.content is None else [self.message(out.content, status)]
        return content + call_items(out.calls, status)

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

    def final(self, progress: Progress,
              output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The finished ``Response``: completed, or incomplete when cut by length; ``output``
        the items as streamed, else made from the text."""
        status = progress.status
        if output is None:
            output = self.output(progress.text, status)
        return self.response(status, output, self.usage(progress.num_output_tokens))


class _Accumulator(Protocol):
    def add(self, delta: GenerationDelta) -> None: ...


_Acc = TypeVar("_Acc", bound=_Accumulator)


def engine_error(e: EngineError) -> OpenAIError:
    """An engine failure before any byte was sent: 503 while shutting down, else 500."""
    return OpenAIError(str(e), status=503 if isinstance(e, EngineShuttingDown) else 500)


async def collect(stream: DeltaStream, into: _Acc) -> _Acc:
    """The whole output of a non-streamed answer, added delta by delta to ``into`` (the
    Responses API's ``Progress``, the Messages API's ``Output``), which is returned; an engine
    failure becomes ``engine_error``'s OpenAIError."""
    try:
        async for d in stream:
            into.add(d)
    except EngineError as e:
        raise engine_error(e) from e
    finally:
        stream.close()
    return into


Emit = Callable[..., dict[str, str]]  # event(kind, **fields) -> one SSE event


@dataclass(slots=True)
class _Items:
    """A stream's output items as they open and close (one open at a time), and the events
    that say so; ``items`` is the response's ``output`` so far."""

    shape: ResponseShape
    event: Emit
    items: list[dict[str, Any]] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)  # by the parser's call index
    open: dict[str, Any] | None = None
    index: dict[str, int] = field(default_factory=dict)  # output_index by item id

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.index[item["id"]]}

    def _add(self, item: dict[str, Any], shown: dict[str, Any]) -> Iterator[dict[str, str]]:
        yield from self.close("completed")
        self.index[item["id"]] = len(self.items)
        self.items.append(item)
        self.open = item
        yield self.event("response.output_item.added", output_index=len(self.items) - 1,
                         item=shown)

    def text(self, piece: str) -> Iterator[dict[str, str]]:
        """Content: into the open message, or a new one (the first has ``message_id``)."""
        item = self.open
        if item is None or item["type"] != "message":
            item_id = None if not self.items else f"msg_{uuid.uuid4().hex}"
            item = self.shape.message("", "in_progress", item_id)
            yield from self._add(item, self.shape.message(None, "in_progress", item_id))
            yield self.event("response.content_part.added", **self._where(item),
                             content_index=0, part=self.shape.text_part(""))
        item["content"][0]["text"] += piece
        if piece:
            yield self.event("response.output_text.delta", **self._where(item),
                             content_index=0, delta=piece, logprobs=[])

    def tool_calls(self, pieces: list[dict[str, Any]]) -> Iterator[dict[str, str]]:
        """The streamer's ``delta.tool_calls`` pieces: a new call opens its item, arguments
        go to their call's item."""
        for piece in pieces:
            if "id" in piece:
                item = function_call_item(piece["id"], piece["function"]["name"], "",
                                          "in_progress")
                self.calls.append(item)
                yield from self._add(item, item)
            arguments = piece["function"].get("arguments", "")
            if arguments:
                item = self.calls[piece["index"]]
                item["arguments"] += arguments
                yield self.event("response.function_call_arguments.delta",
                                 **self._where(item), delta=arguments)

    def close(self, status: str) -> Iterator[dict[str, str]]:
        """The open item's done events, with its final ``status``."""
        item, self.open = self.open, None
        if item is None:
            return
        item["status"] = status
        where = self._where(item)
        if item["type"] == "message":
            part = item["content"][0]
            yield self.event("response.output_text.done", **where, content_index=0,
                             text=part["text"], logprobs=[])
            yield self.event("response.content_part.done", **where, content_index=0,
                             part=part)
        else:
            yield self.event("response.function_call_arguments.done", **where,
                             arguments=item["arguments"])
        yield self.event("response.output_item.done", output_index=where["output_index"],
                         item=item)

    def failed(self) -> list[dict[str, Any]]:
        """The output when the stream failed: the open item is incomplete."""
        return [dict(i, status="incomplete") if i is self.open else i for i in self.items]


async def events(shape: ResponseShape, stream: DeltaStream,
                 on_done: Callable[[dict[str, Any], Progress], None]
                 ) -> AsyncIterator[dict[str, str]]:
    """The SSE events (``{"event", "data"}`` for sse-starlette) of a streamed response.
    ``on_done`` gets the final ``Response`` when the output ended (not when the client went
    away: sse-starlette cancels this generator, which closes the stream and aborts the
    request). Without tools the message opens at once; with them, when content appears."""
    seq = 0

    def event(kind: str, **fields: Any) -> dict[str, str]:
        nonlocal seq
        seq += 1
        return {"event": kind,
                "data": json.dumps({"type": kind, "sequence_number": seq - 1, **fields})}

    items, progress = _Items(shape, event), Progress()
    streamer = shape.parser.streamer() if shape.parser is not None else None
    yield event("response.created", response=shape.response("in_progress", []))
    yield event("response.in_progress", response=shape.response("in_progress", []))
    if streamer is None:
        for e in items.text(""):
            yield e
    try:
        async for d in stream:
            progress.add(d)
            if streamer is None:
                pieces = items.text(d.text)
            else:
                step = streamer.feed(d.text, final=d.finish_reason is not None)
                pieces = [*(items.text(step.content) if step.content else ()),
                          *items.tool_calls(step.tool_calls)]
            for e in pieces:
                yield e
    except Exception as e:  # the stream already started: report in-band, then end it
        if isinstance(e, EngineShuttingDown):
            log.info("stream_ended_by_shutdown", response_id=shape.response_id)
        else:
            log.exception("responses_stream_failed", response_id=shape.response_id)
        error = {"code": "server_error", "message": f"{type(e).__name__}: {e}"}
        yield event("response.failed", response=shape.response(
            "failed", items.failed(), shape.usage(progress.num_output_tokens), error))
        return
    finally:
        stream.close()
    for e in [*(items.text("") if not items.items else ()), *items.close(progress.status)]:
        yield e
    final = shape.final(progress, items.items)
    on_done(final, progress)
    kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
    yield event(kind, response=final)
