"""JSON request bodies → pydantic models, or a 400 that names the offending field.

What the JSON parser accepts but nothing behind it can use is refused here, before validation:
nesting deeper than ``MAX_JSON_DEPTH`` (the parser itself would hit Python's recursion limit a
little further on), integer literals past Python's digit limit, and lone UTF-16 surrogates
(``"\\ud800"`` escaped, or the raw bytes ED A0 80, which ``json.loads`` lets through): no
tokenizer takes them and no response holding one can be encoded as UTF-8.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from pagedserve.server.errors import OpenAIError

MAX_JSON_DEPTH = 64  # arrays/objects inside each other; OpenAI's own bodies need about 6

_SURROGATE = re.compile("[\ud800-\udfff]")


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    """Parse and validate; ``OpenAIError`` (400) with ``param`` set when a field is at fault."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except RecursionError as e:
        raise OpenAIError(f"request body is nested deeper than {MAX_JSON_DEPTH} levels") from e
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, or a too-long integer
        raise OpenAIError(f"request body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise OpenAIError("request body must be a JSON object")
    check_json_values(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from e


def validation_error(e: ValidationError) -> OpenAIError:
    """A 400 for pydantic's first complaint, ``param`` the top-level field it sits in."""
    err = e.errors()[0]
    msg = str(err["msg"]).removeprefix("Value error, ")
    if err["type"] != "value_error":  # pydantic's own check: name it, as vLLM's message does
        msg = f"{msg} [type={err['type']}]"
    param = str(err["loc"][0]) if err["loc"] else None  # the top-level field
    if param is None and ":" in msg:  # our model validators say "field: problem"
        param = msg.split(":", 1)[0]
    elif param is not None:
        msg = f"{param}: {msg}"
    return OpenAIError(msg, param=param)


def check_json_values(body: dict[str, Any]) -> None:
    """Refuse nesting past ``MAX_JSON_DEPTH`` and strings (values or keys) with a lone
    surrogate, naming the top-level field they sit in. Iterative: depth costs no stack.

    Raises:
        OpenAIError: 400, ``param`` = the top-level field.
    """
    stack: list[tuple[str, Any, int]] = [(key, value, 1) for key, value in body.items()]
    for key in body:
        _check_string(key, key)
    while stack:
        param, value, depth = stack.pop()
        if isinstance(value, str):
            _check_string(value, param)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise OpenAIError(f"{param}: nested deeper than {MAX_JSON_DEPTH} levels",
                              param=param)
        if isinstance(value, dict):
            for k in value:
                _check_string(k, param)
            stack.extend((param, v, depth + 1) for v in value.values())
        else:
            stack.extend((param, v, depth + 1) for v in value)


def _check_string(text: str, param: str) -> None:
    match = _SURROGATE.search(text)
    if match is not None:
        code = f"U+{ord(match.group()):04X}"
        raise OpenAIError(f"{ascii(param)[1:-1]}: text holds a lone surrogate ({code}), which "
                          "is not valid Unicode; send UTF-8 text", param=ascii(param)[1:-1])
