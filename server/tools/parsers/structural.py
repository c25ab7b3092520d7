"""Auto-mode calls that are valid too: an xgrammar structural tag that leaves the model free
until it writes a call's opening (the trigger), then holds it to one of the tools' exact call
text, ``begin`` + arguments valid against that tool's schema + ``end``, after which it is free
again (or must end, with at most one call). The constrained text is what the format's parser
reads, so an auto-mode call always parses and its arguments validate.
"""

from __future__ import annotations

import json
from typing import Any

# As for guided JSON: indentation is fine, padding to max_tokens is not.
MAX_WHITESPACE = 16


def triggered_calls(trigger: str, begin: str, end: str, tools: list[tuple[str, dict[str, Any]]],
                    max_calls: int | None) -> str:
    """The structural tag (JSON text) for calls written ``begin.format(name=<JSON string of
    the name>)`` + arguments + ``end``; every ``begin`` starts with ``trigger``."""
    tags = [{
        "type": "tag",
        "begin": begin.format(name=json.dumps(name, ensure_ascii=False)),
        "content": {"type": "json_schema", "json_schema": schema,
                    "max_whitespace_cnt": MAX_WHITESPACE},
        "end": end,
    } for name, schema in tools]
    fmt = {"type": "triggered_tags", "triggers": [trigger], "tags": tags,
           "at_least_one": False, "stop_after_first": max_calls == 1}
    return json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)
