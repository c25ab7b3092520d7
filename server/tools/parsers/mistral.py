"""``mistral``: Mistral 7B Instruct v0.3 / Mixtral / Mistral Nemo style, a JSON array after the
``[TOOL_CALLS]`` token::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

``JsonArrayToolParser`` is the same array without the marker: the output of
``tool_choice: "required"``, whatever the model's format (the grammar forces it).
"""

from __future__ import annotations

import random
import string
from typing import ClassVar

from pagedserve.server.tools.parsers.base import MalformedCall, Parsed, ToolParser
from pagedserve.server.tools.parsers.call_object import scan_calls
from pagedserve.server.tools.parsers.json_scan import skip_ws
from pagedserve.server.tools.parsers.plain_text import text_before


class JsonArrayToolParser(ToolParser):
    """``[{"name": ..., "arguments": {...}}, ...]``, after ``marker`` when it has one."""

    name: ClassVar[str] = "json_array"
    marker: ClassVar[str] = ""
    arg_keys: ClassVar[tuple[str, ...]] = ("arguments",)  # the key of a call's arguments

    def __init__(self, max_calls: int | None = None, lenient: bool = False):
        super().__init__(max_calls)
        # Lenient: an output cut short (max_tokens) keeps the calls begun, as they streamed;
        # for forced calls, where the grammar leaves no other reading.
        self.lenient = lenient

    def parse(self, text: str, final: bool) -> Parsed:
        idx = text.find(self.marker) if self.marker else 0
        if idx < 0:
            return Parsed(text_before(text, self.marker, final))
        parsed = Parsed(text[:idx].rstrip())
        pos = skip_ws(text, idx + len(self.marker))
        if pos >= len(text):
            if final:
                raise MalformedCall("nothing after the call marker")
            return parsed
        if text[pos] != "[":
            raise MalformedCall("the calls are not a JSON array")
        parsed.calls, end = scan_calls(text, pos + 1, self.arg_keys, ",", "]")
        if final and end is None and not self.lenient:
            raise MalformedCall("the array of calls is not closed")
        return parsed


class MistralToolParser(JsonArrayToolParser):
    name: ClassVar[str] = "mistral"
    marker: ClassVar[str] = "[TOOL_CALLS]"
    special_markers: ClassVar[tuple[str, ...]] = ("[TOOL_CALLS]",)

    def new_call_id(self) -> str:
        # Mistral's chat templates refuse tool call ids other than 9 letters and digits.
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))
