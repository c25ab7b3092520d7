"""What every tool-call parser shares: the parsed shape, the base class, and the streamer that
turns successive parses of a growing output into OpenAI's ``delta.tool_calls`` pieces.

A parser implements one method, ``parse(text, final)``: from the output so far, the content
that is surely content and the calls seen so far (name, and the part of the arguments that
surely belongs to them). Parses of a growing text only ever grow (content and arguments
extend, names never change), so the streamer can send the difference each step and the pieces
concatenate to the whole answer's ``extract(text)`` (the idea of vLLM's
``vllm/entrypoints/openai/tool_parsers/abstract_tool_parser.py``, with one parse function
instead of a streaming and a non-streaming one that can disagree).

Malformed output (a call that does not parse) comes back as plain content, never an error.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar


class MalformedCall(ValueError):
    """The output opened a call that is not a valid one; the caller falls back to content."""


@dataclass(slots=True)
class PartialCall:
    """A call as far as it is known: ``arguments`` is raw JSON text, complete once ``done``."""

    name: str
    arguments: str
    done: bool = False


@dataclass(slots=True)
class Parsed:
    """One parse of the output: content text and the calls (in order)."""

    content: str
    calls: list[PartialCall] = field(default_factory=list)


@dataclass(slots=True)
class ToolCall:
    """One finished call, as it goes into ``message.tool_calls``."""

    id: str
    name: str
    arguments: str  # JSON text

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class Extracted:
    """A whole output: its content (``None`` when only calls) and its calls."""

    content: str | None
    calls: list[ToolCall]


def hold_back_prefix(text: str, marker: str) -> int:
    """Length of ``text`` that cannot be the start of ``marker`` (which may still be coming)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k
    return len(text)


class ToolParser:
    """Base of the parsers. ``name`` is the ``--tool-call-parser`` value; ``special_markers``
    are tokens the format uses that tokenizers often mark special (the detokenizer must then
    keep special tokens, or the marker never reaches the parser)."""

    name: ClassVar[str] = ""
    special_markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, max_calls: int | None = None):
        self.max_calls = max_calls  # 1 for parallel_tool_calls: false; later calls dropped

    def parse(self, text: str, final: bool) -> Parsed:
        """The output ``text`` so far (``final``: it is all). Raises ``MalformedCall``."""
        raise NotImplementedError

    def parse_limited(self, text: str, final: bool) -> Parsed:
        parsed = self.parse(text, final)
        if self.max_calls is not None:
            del parsed.calls[self.max_calls:]
        return parsed

    def new_call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def structural_tag(self, tools: list[tuple[str, dict[str, Any]]]) -> str | None:
        """An xgrammar structural tag (JSON text) that constrains each call once the model
        starts one (see ``structural``), for ``tools`` as ``(name, parameters schema)``;
        ``None`` when the format has none (the calls are then only parsed)."""
        return None

    def extract(self, text: str) -> Extracted:
        """The whole output as content and calls; a malformed call makes it all content."""
        try:
            parsed = self.parse_limited(text, final=True)
        except MalformedCall:
            return Extracted(text, [])
        if not parsed.calls:
            return Extracted(text, [])
        calls = [ToolCall(self.new_call_id(), c.name, c.arguments) for c in parsed.calls]
        return Extracted(parsed.content or None, calls)

    def streamer(self) -> ToolCallStreamer:
        return ToolCallStreamer(self)


@dataclass(slots=True)
class StreamDelta:
    """What one step adds: a content piece and ``delta.tool_calls`` entries."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class ToolCallStreamer:
    """One choice's stream: feed the text as it grows, get what to send (see the module doc)."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.sent_content = 0  # characters of content sent
        self.sent: list[tuple[str, int]] = []  # per call: (id, characters of arguments sent)
        self.failed = False  # a call turned out malformed: the rest goes out as content

    @property
    def num_calls(self) -> int:
        return len(self.sent)

    def feed(self, piece: str, final: bool = False) -> StreamDelta:
        self.text += piece
        if self.failed:
            return self._as_content()
        try:
            parsed = self.parser.parse_limited(self.text, final)
        except MalformedCall:
            self.failed = True
            return self._as_content()
        if final and not parsed.calls:
            parsed.content = self.text
        out = StreamDelta(content=parsed.content[self.sent_content:])
        self.sent_content = max(self.sent_content, len(parsed.content))
        for i, call in enumerate(parsed.calls):
            if i == len(self.sent):
                self.sent.append((self.parser.new_call_id(), 0))
                out.tool_calls.append({"index": i, "id": self.sent[i][0], "type": "function",
                                       "function": {"name": call.name, "arguments": ""}})
            call_id, n = self.sent[i]
            if len(call.arguments) > n:
                out.tool_calls.append({"index": i,
                                       "function": {"arguments": call.arguments[n:]}})
                self.sent[i] = (call_id, len(call.arguments))
        return out

    def _as_content(self) -> StreamDelta:
        """After a failure: everything not yet sent, as content (calls already sent stay)."""
        if self.sent:
            return StreamDelta()
        piece = self.text[self.sent_content:]
        self.sent_content = len(self.text)
        return StreamDelta(content=piece)
