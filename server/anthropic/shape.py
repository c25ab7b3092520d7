"""One engine request's output as Anthropic's ``Message`` and as its stream of server-sent
events.

Shapes follow the ``anthropic`` package's ``types/message.py`` and ``types/raw_*_event.py``;
a stream (vLLM's ``message_stream_converter`` sends the same sequence) is::

    message_start → ping → (content_block_start → content_block_delta × N
      → content_block_stop) per block → message_delta → message_stop

Content blocks are ``text`` (``text_delta`` pieces) and, with tools, ``tool_use`` (its
``input`` as ``input_json_delta`` pieces of JSON text); a block opens when the tool parser first
sees its part of the output and closes when the next opens or the output ends. The SSE
``event:`` line repeats each event's ``type``; a failure after the stream started is an
``error`` event (Anthropic's error shape), and the stream ends there.

``stop_reason``: ``end_turn`` (EOS or a stop token), ``stop_sequence`` (with the
``stop_sequence`` that matched; vLLM reports ``end_turn``), ``max_tokens``, ``tool_use``
(the turn ended by calling tools).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import structlog

from pagedserve.actors.engine.protocol import DeltaStream, GenerationDelta
from pagedserve.actors.errors import EngineError, EngineShuttingDown
from pagedserve.server.anthropic.errors import anthropic_error_body
from pagedserve.server.responses.events import Emit
from pagedserve.server.tools.parsers import ToolCall, ToolParser

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Output:
    """The output so far: text, tokens, how it ended, time to first token (seconds)."""

    start: float = field(default_factory=time.monotonic)
    text: str = ""
    num_output_tokens: int = 0
    finish_reason: str | None = None
    stop_string: str | None = None
    ttft_s: float | None = None

    def add(self, d: GenerationDelta) -> None:
        if self.ttft_s is None and d.token_ids:
            self.ttft_s = time.monotonic() - self.start
        self.text += d.text
        self.num_output_tokens = d.num_output_tokens
        self.finish_reason = d.finish_reason
        self.stop_string = d.stop_reason


def tool_use_id(call_id: str) -> str:
    """Anthropic's ``toolu_`` spelling of a parser's call id."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    """A whole answer's call. Arguments that are not a JSON object (a call cut by
    ``max_tokens``) come back as an empty ``input``, as Anthropic's own cut calls do."""
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        arguments = {}
    return {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name,
            "input": arguments if isinstance(arguments, dict) else {}}


@dataclass(slots=True)
class MessageShape:
    """Builds the JSON objects of one message."""

    message_id: str
    model: str
    num_input_tokens: int
    parser: ToolParser | None = None  # with tools: reads the calls out of the text

    def usage(self, num_output_tokens: int) -> dict[str, int]:
        return {"input_tokens": self.num_input_tokens, "output_tokens": num_output_tokens}

    @staticmethod
    def stop(out: Output, called: bool) -> dict[str, str | None]:
        """``stop_reason`` and ``stop_sequence`` of a finished output."""
        if out.finish_reason == "length":
            return {"stop_reason": "max_tokens", "stop_sequence": None}
        if called:
            return {"stop_reason": "tool_use", "stop_sequence": None}
        if out.stop_string is not None:
            return {"stop_reason": "stop_sequence", "stop_sequence": out.stop_string}
        return {"stop_reason": "end_turn", "stop_sequence": None}

    def message(self, content: list[dict[str, Any]], out: Output | None) -> dict[str, Any]:
        """The ``Message``; ``out`` ``None``: the stream's opening one (no stop yet)."""
        stop = {"stop_reason": None, "stop_sequence": None} if out is None else self.stop(
            out, any(b["type"] == "tool_use" for b in content))
        return {"id": self.message_id, "type": "message", "role": "assistant",
                "model": self.model, "content": content, **stop,
                "usage": self.usage(0 if out is None else out.num_output_tokens)}

    def whole(self, out: Output) -> dict[str, Any]:
        """The non-streamed answer: a text block (when there is text), then the calls."""
        if self.parser is None:
            content, calls = out.text, []
        else:
            extracted = self.parser.extract(out.text)
            content, calls = extracted.content, extracted.calls
        blocks = [{"type": "text", "text": content}] if content else []
        return self.message(blocks + [tool_use_block(c) for c in calls], out)


@dataclass(slots=True)
class _Blocks:
    """A stream's content blocks as they open and close (one open at a time)."""

    event: Emit
    count: int = 0  # blocks opened so far; the open one is count - 1
    open: str | None = None  # its type
    calls: list[int] = field(default_factory=list)  # block index by the parser's call index

    def _start(self, block: dict[str, Any]) -> Iterator[dict[str, str]]:
        yield from self.close()
        self.open = block["type"]
        self.count += 1
        yield self.event("content_block_start", index=self.count - 1, content_block=block)

    def text(self, piece: str) -> Iterator[dict[str, str]]:
        if not piece:
            return
        if self.open != "text":
            yield from self._start({"type": "text", "text": ""})
        yield self.event("content_block_delta", index=self.count - 1,
                         delta={"type": "text_delta", "text": piece})

    def tool_calls(self, pieces: list[dict[str, Any]]) -> Iterator[dict[str, str]]:
        """The streamer's ``delta.tool_calls`` pieces: a new call opens its ``tool_use``
        block, arguments go to their call's block as JSON pieces."""
        for piece in pieces:
            if "id" in piece:
                yield from self._start({"type": "tool_use", "id": tool_use_id(piece["id"]),
                                        "name": piece["function"]["name"], "input": {}})
                self.calls.append(self.count - 1)
            arguments = piece["function"].get("arguments", "")
            if arguments:
                yield self.event("content_block_delta", index=self.calls[piece["index"]],
                                 delta={"type": "input_json_delta", "partial_json": arguments})

    def close(self) -> Iterator[dict[str, str]]:
        if self.open is not None:
            self.open = None
            yield self.event("content_block_stop", index=self.count - 1)


def _event(kind: str, **fields: Any) -> dict[str, str]:
    return {"event": kind, "data": json.dumps({"type": kind, **fields})}


async def events(shape: MessageShape, stream: DeltaStream,
                 on_done: Callable[[Output], None]) -> AsyncIterator[dict[str, str]]:
    """The SSE events (``{"event", "data"}`` for sse-starlette) of a streamed message.
    ``on_done`` gets the output once it ended (not when the client went away: sse-starlette
    cancels this generator, which closes the stream and so aborts the request)."""
    blocks, out = _Blocks(_event), Output()
    streamer = shape.parser.streamer() if shape.parser is not None else None
    yield _event("message_start", message=shape.message([], None))
    yield _event("ping")
    try:
        async for d in stream:
            out.add(d)
            if streamer is None:
                pieces = list(blocks.text(d.text))
            else:
                step = streamer.feed(d.text, final=d.finish_reason is not None)
                pieces = [*blocks.text(step.content), *blocks.tool_calls(step.tool_calls)]
            for e in pieces:
                yield e
    except (asyncio.CancelledError, GeneratorExit):  # sse-starlette: the client went away
        log.info("client_disconnected", request_id=stream.request_id)
        raise
    except Exception as e:  # the stream already started: report in-band, then end it
        if isinstance(e, EngineShuttingDown):
            log.info("stream_ended_by_shutdown", request_id=stream.request_id)
        else:
            log.exception("messages_stream_failed", request_id=stream.request_id)
        status = 503 if isinstance(e, EngineShuttingDown) else 500
        message = str(e) if isinstance(e, EngineError) else f"{type(e).__name__}: {e}"
        yield _event("error", error=anthropic_error_body(message, status)["error"])
        return
    finally:
        stream.close()
    for e in blocks.close():
        yield e
    yield _event("message_delta", delta=MessageShape.stop(out, bool(blocks.calls)),
                 usage=shape.usage(out.num_output_tokens))
    on_done(out)
    yield _event("message_stop")
