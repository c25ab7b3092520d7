"""``hermes``: Hermes 2 Pro / Qwen2 / Qwen2.5 style, each call in its own block::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text before the first block is the message's content (its trailing whitespace dropped); text
between and after blocks is not kept.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pagedserve.server.tools.parsers.base import MalformedCall, Parsed, ToolParser
from pagedserve.server.tools.parsers.call_object import scan_call
from pagedserve.server.tools.parsers.json_scan import skip_ws
from pagedserve.server.tools.parsers.plain_text import text_before
from pagedserve.server.tools.parsers.structural import triggered_calls

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name: ClassVar[str] = "hermes"

    def structural_tag(self, tools: list[tuple[str, dict[str, Any]]]) -> str | None:
        return triggered_calls(OPEN, OPEN + '\n{{"name": {name}, "arguments": ',
                               "}\n" + CLOSE, tools, self.max_calls)

    def parse(self, text: str, final: bool) -> Parsed:
        idx = text.find(OPEN)
        if idx < 0:
            return Parsed(text_before(text, OPEN, final))
        parsed = Parsed(text[:idx].rstrip())
        while idx >= 0:
            # The block ends after its object (a "</tool_call>" inside a string is no end).
            call, end = scan_call(text, idx + len(OPEN), ("arguments",))
            if call is None or end is None:
                if final:
                    raise MalformedCall("the output ends inside a <tool_call> block")
                if call is not None:
                    parsed.calls.append(call)
                return parsed
            parsed.calls.append(call)
            after = skip_ws(text, end)
            if text.startswith(CLOSE, after):
                idx = text.find(OPEN, after + len(CLOSE))
            elif after == len(text) or (not final and CLOSE.startswith(text[after:])):
                return parsed  # the closing tag still coming (or left out at the very end)
            else:
                raise MalformedCall("a <tool_call> block holds more than one call")
        return parsed
