"""Tool-call parsers, one per output format, chosen with ``--tool-call-parser`` (vLLM's names).

Each turns a model's output into content and ``tool_calls``, whole (``extract``) or as it
streams (``streamer``); see ``base``.
"""

from __future__ import annotations

from pagedserve.server.tools.parsers.base import (
    Extracted,
    StreamDelta,
    ToolCall,
    ToolCallStreamer,
    ToolParser,
)
from pagedserve.server.tools.parsers.hermes import HermesToolParser
from pagedserve.server.tools.parsers.llama3_json import Llama3JsonToolParser
from pagedserve.server.tools.parsers.mistral import JsonArrayToolParser, MistralToolParser
from pagedserve.server.tools.parsers.phi4_mini import Phi4MiniJsonToolParser
from pagedserve.server.tools.parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                        Phi4MiniJsonToolParser, PythonicToolParser)
}

__all__ = ["TOOL_PARSERS", "Extracted", "JsonArrayToolParser", "StreamDelta", "ToolCall",
           "ToolCallStreamer", "ToolParser"]
