"""Finding where a JSON value ends in text that may still be growing (a stream of tokens).

The tool parsers stream a call's ``arguments`` as the raw text the model wrote, piece by piece;
they need to know, for a prefix of the output, which characters surely belong to the value. A
value that opens with ``{`` or ``[`` owns every character until its bracket closes, so all of
a prefix can be streamed; any other value (a number, a string, a literal) is held until it is
complete. The same scan finds the end of a complete value, so the streamed pieces and the whole
answer slice the text at the same places.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from pagedserve.server.tools.parsers.base import MalformedCall

_WS = re.compile(r"\s*")
# Not strict: control characters inside strings are read (and escaped by ``escape_controls``).
_DECODER = json.JSONDecoder(strict=False)
_CONTROL = re.compile(r"[\x00-\x1f]")


@dataclass(slots=True, frozen=True)
class JsonValue:
    """A JSON value in ``text`` starting at ``start``.

    Attributes:
        start: the value's first character (after any whitespace).
        end: one past its last character; ``None`` while it is incomplete.
        streamable: how far it surely extends now (``end`` once complete).
    """

    start: int
    end: int | None
    streamable: int


def skip_ws(text: str, pos: int) -> int:
    """The first non-whitespace position at or after ``pos``."""
    return _WS.match(text, pos).end()  # type: ignore[union-attr]


def bracket_end(text: str, start: int, quotes: str = '"', opens: str = "{[",
                closes: str = "}]") -> int | None:
    """One past the bracket that closes the one at ``start``, or ``None`` while it is not
    there yet. Strings opened by any of ``quotes`` (backslash escapes) are skipped: JSON's
    defaults, or Python's ``'"`` and ``([{`` for the pythonic parser."""
    depth, quote, escape = 0, "", False
    for i in range(start, len(text)):
        ch = text[i]
        if quote:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == quote:
                quote = ""
        elif ch in quotes:
            quote = ch
        elif ch in opens:
            depth += 1
        elif ch in closes:
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def scan_value(text: str, pos: int) -> JsonValue | None:
    """The JSON value starting at ``pos`` (whitespace skipped); ``None`` when nothing of it is
    there yet. A complete value that does not decode raises ``ValueError``."""
    start = skip_ws(text, pos)
    if start >= len(text):
        return None
    if text[start] in "{[":
        end = bracket_end(text, start)
        if end is None:
            return JsonValue(start, None, len(text))
        try:
            _DECODER.raw_decode(text[start:end])
        except ValueError as e:
            raise MalformedCall(f"invalid JSON: {e}") from e
        return JsonValue(start, end, end)
    try:
        _, n = _DECODER.raw_decode(text, start)
    except ValueError:
        return JsonValue(start, None, start)  # maybe incomplete; the final parse decides
    if n >= len(text) and text[start] not in '"tfn':
        return JsonValue(start, None, start)  # a number may still grow
    return JsonValue(start, n, n)


def loads(text: str):
    """``json.loads`` that also reads control characters inside strings."""
    return _DECODER.decode(text)


def escape_controls(raw: str) -> str:
    """JSON text with the raw control characters inside its strings written as ``\\u00XX``
    (a grammar's string rule may let a model write them; strict JSON readers refuse them). A
    character's escape depends only on what precedes it, so the escaped text of a prefix is a
    prefix of the escaped whole: streamed pieces still add up."""
    if not _CONTROL.search(raw):
        return raw
    out, in_string, escape = [], False, False
    for ch in raw:
        if in_string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
            elif ch < " ":
                out.append(f"\\u{ord(ch):04x}")
                continue
        elif ch == '"':
            in_string = True
        out.append(ch)
    return "".join(out)
