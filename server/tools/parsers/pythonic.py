"""``pythonic``: Llama 3.2 (1B/3B) and Llama 4 style, a Python list of calls with keyword
arguments::

    [get_weather(city="Paris", unit="celsius"), get_time(tz="Europe/Paris")]

Argument values are Python literals (JSON's ``true``/``false``/``null`` accepted too) and come
out as JSON. A call streams whole, once its closing parenthesis is there.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any, ClassVar

from pagedserve.server.tools.parsers.base import MalformedCall, Parsed, PartialCall, ToolParser
from pagedserve.server.tools.parsers.json_scan import bracket_end, skip_ws

_CALL_START = re.compile(r"[A-Za-z_][\w.]*\s*\(")
_IDENT_PREFIX = re.compile(r"[A-Za-z_][\w.]*\s*")
_JSON_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False,
               "None": None}


class PythonicToolParser(ToolParser):
    name: ClassVar[str] = "pythonic"

    def parse(self, text: str, final: bool) -> Parsed:
        start = skip_ws(text, 0)
        if start >= len(text):
            return Parsed(text if final else "")
        if text[start] != "[":
            return Parsed(text)
        calls: list[PartialCall] = []
        pos = start + 1
        while True:
            pos = skip_ws(text, pos)
            if pos >= len(text):
                break
            m = _CALL_START.match(text, pos)
            if m is None:
                if _IDENT_PREFIX.fullmatch(text, pos) and not final:
                    break  # a name still being written
                raise MalformedCall("the list does not hold a call")
            end = _paren_end(text, m.end() - 1)
            if end is None:
                break
            calls.append(_call(text[pos:end]))
            pos = skip_ws(text, end)
            if text.startswith(",", pos):
                pos += 1
            elif text.startswith("]", pos):
                return Parsed("", calls)
            elif pos < len(text):
                raise MalformedCall(f"unexpected {text[pos]!r} after a call")
        if final:
            raise MalformedCall("the list of calls is not closed")
        return Parsed("", calls)


def _paren_end(text: str, start: int) -> int | None:
    """One past the parenthesis closing the one at ``start`` (Python strings skipped)."""
    return bracket_end(text, start, quotes="'\"", opens="([{", closes=")]}")


def _call(source: str) -> PartialCall:
    try:
        node = ast.parse(source, mode="eval").body
    except SyntaxError as e:
        raise MalformedCall(f"not a Python call: {e.msg}") from e
    if not isinstance(node, ast.Call) or node.args:
        raise MalformedCall("a call takes keyword arguments only")
    args = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise MalformedCall("**kwargs in a call")
        args[kw.arg] = _literal(kw.value)
    return PartialCall(ast.unparse(node.func), json.dumps(args, ensure_ascii=False), done=True)


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant) and not isinstance(node.value, bytes | complex):
        return node.value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(not isinstance(k, ast.Constant) or not isinstance(k.value, str)
               for k in node.keys):
            raise MalformedCall("dict keys must be strings")
        pairs = zip(node.keys, node.values, strict=True)
        return {k.value: _literal(v) for k, v in pairs}  # type: ignore[union-attr]
    if (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
            and isinstance(node.operand, ast.Constant)
            and isinstance(node.operand.value, int | float)):
        return -node.operand.value
    raise MalformedCall("argument values must be literals")
