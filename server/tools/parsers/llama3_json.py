"""``llama3_json``: Llama 3.1 / 3.2 / 3.3 JSON tool calls. The whole answer is the call (or
several, separated by ``;``), optionally after the ``<|python_tag|>`` token::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}

An answer that does not start with ``{`` is content.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pagedserve.server.tools.parsers.base import MalformedCall, Parsed, ToolParser
from pagedserve.server.tools.parsers.call_object import scan_calls
from pagedserve.server.tools.parsers.json_scan import skip_ws
from pagedserve.server.tools.parsers.structural import triggered_calls

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name: ClassVar[str] = "llama3_json"
    special_markers: ClassVar[tuple[str, ...]] = (PYTHON_TAG,)

    def structural_tag(self, tools: list[tuple[str, dict[str, Any]]]) -> str | None:
        return triggered_calls('{"name": ', '{{"name": {name}, "parameters": ', "}", tools,
                               self.max_calls)

    def parse(self, text: str, final: bool) -> Parsed:
        start = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, start):
            start = skip_ws(text, start + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[start:]):
            return Parsed("")  # only whitespace, or the tag still coming
        if start >= len(text) or text[start] != "{":
            if start >= len(text) and not final:
                return Parsed("")
            return Parsed(text)
        calls, _ = scan_calls(text, start, ("parameters", "arguments"), ";", None)
        if final and (not calls or not calls[-1].done):
            raise MalformedCall("the answer ends inside a call")
        return Parsed("", calls)
