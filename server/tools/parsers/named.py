"""The output of a named ``tool_choice``: the grammar makes the whole output the arguments of
that one function (a JSON object), so every character streams as arguments."""

from __future__ import annotations

from typing import ClassVar

from pagedserve.server.tools.parsers.base import Parsed, PartialCall, ToolParser
from pagedserve.server.tools.parsers.json_scan import escape_controls


class NamedCallParser(ToolParser):
    name: ClassVar[str] = "named"

    def __init__(self, function: str):
        super().__init__(max_calls=1)
        self.function = function

    def parse(self, text: str, final: bool) -> Parsed:
        return Parsed("", [PartialCall(self.function, escape_controls(text), done=final)])
