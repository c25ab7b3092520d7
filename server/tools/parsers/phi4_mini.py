"""``phi4_mini_json``: Phi-4-mini-instruct, one JSON list of calls after a ``functools``
marker (vLLM's parser of that name, for its Phi-4-mini tool template)::

    functools[{"name": "get_weather", "arguments": {"city": "Paris"}}]

A call's arguments may come as ``parameters`` too, as vLLM reads them. Text before the marker
is the message's content (vLLM drops it); a ``functools`` not followed by a list makes the
whole answer content, as any malformed call does. The calls stream as they are written (vLLM's
parser does not stream them).
"""

from __future__ import annotations

from typing import ClassVar

from pagedserve.server.tools.parsers.mistral import JsonArrayToolParser


class Phi4MiniJsonToolParser(JsonArrayToolParser):
    name: ClassVar[str] = "phi4_mini_json"
    marker: ClassVar[str] = "functools"
    arg_keys: ClassVar[tuple[str, ...]] = ("arguments", "parameters")
