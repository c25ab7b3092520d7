"""One call written as a JSON object, ``{"name": "f", "arguments": {...}}`` (the key of the
arguments varies by format: ``arguments``, or ``parameters`` for Llama 3), read from text that
may still be growing. Shared by the hermes, llama3_json and mistral parsers and by the output
of ``tool_choice: "required"``.
"""

from __future__ import annotations

import json
import re

from pagedserve.server.tools.parsers.base import MalformedCall, PartialCall
from pagedserve.server.tools.parsers.json_scan import (
    bracket_end,
    escape_controls,
    loads,
    scan_value,
    skip_ws,
)

# The name first, then the arguments' key: the order models write (and the constrained output
# always has), which lets the arguments stream before the object is complete.
_NAME_FIRST = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(\w+)"\s*:')


def scan_call(text: str, pos: int, arg_keys: tuple[str, ...],
              ) -> tuple[PartialCall | None, int | None]:
    """The call object starting at ``pos`` (whitespace skipped) and one past its end.

    Returns ``(None, None)`` when too little is there to name the call, ``(call, None)`` while
    it is incomplete (``call.arguments`` is the part surely written), ``(call, end)`` once
    complete (``call.done``). Raises ``MalformedCall`` when it cannot be a call.
    """
    start = skip_ws(text, pos)
    if start >= len(text):
        return None, None
    if text[start] != "{":
        raise MalformedCall(f"a call starts with '{{', not {text[start]!r}")
    end = bracket_end(text, start)
    if end is not None:
        return _complete(text, start, end, arg_keys), end
    m = _NAME_FIRST.match(text, start)
    if m is None or m.group(2) not in arg_keys:
        return None, None  # the name is still coming (or comes later: wait for the whole)
    name = json.loads(f'"{m.group(1)}"')
    value = scan_value(text, m.end())
    if value is None or text[value.start] not in "{[":
        return PartialCall(name, ""), None  # a non-object value is checked once complete
    return PartialCall(name, escape_controls(text[value.start:value.streamable])), None


def _complete(text: str, start: int, end: int, arg_keys: tuple[str, ...]) -> PartialCall:
    try:
        obj = loads(text[start:end])
    except ValueError as e:
        raise MalformedCall(f"a call is not valid JSON: {e}") from e
    name = obj.get("name") if isinstance(obj, dict) else None
    keys = [k for k in arg_keys if k in obj] if isinstance(obj, dict) else []
    if not isinstance(name, str) or not name or len(keys) != 1:
        raise MalformedCall("a call needs a string 'name' and its arguments")
    args = obj[keys[0]]
    if isinstance(args, str):  # arguments sent as JSON text
        try:
            args = loads(args)
        except ValueError as e:
            raise MalformedCall("the arguments text is not JSON") from e
    if not isinstance(args, dict):
        raise MalformedCall("the arguments must be a JSON object")
    m = _NAME_FIRST.match(text, start)
    if m is not None and m.group(2) == keys[0]:
        value = scan_value(text, m.end())
        if value is not None and value.end is not None and text[value.start] == "{":
            return PartialCall(name, escape_controls(text[value.start:value.end]), done=True)
    return PartialCall(name, json.dumps(args, ensure_ascii=False), done=True)


def scan_calls(text: str, pos: int, arg_keys: tuple[str, ...], separator: str,
               closer: str | None) -> tuple[list[PartialCall], int | None]:
    """Calls separated by ``separator`` from ``pos``, up to ``closer`` (``None``: up to the end
    of the text). Returns the calls so far and one past the closer once it is there."""
    calls: list[PartialCall] = []
    while True:
        pos = skip_ws(text, pos)
        if closer is not None and not calls and text.startswith(closer, pos):
            return calls, pos + len(closer)  # an empty list
        call, end = scan_call(text, pos, arg_keys)
        if call is None:
            return calls, None
        calls.append(call)
        if end is None:
            return calls, None
        pos = skip_ws(text, end)
        if pos >= len(text):
            return calls, None
        if text.startswith(separator, pos):
            pos += len(separator)
        elif closer is not None and text.startswith(closer, pos):
            return calls, pos + len(closer)
        else:
            raise MalformedCall(f"unexpected {text[pos]!r} after a call")
