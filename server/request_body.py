"""JSON request bodies → pydantic models, or a 400 that names the offending field."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from pagedserve.server.errors import OpenAIError


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    """Parse and validate; ``OpenAIError`` (400) with ``param`` set when a field is at fault."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(f"request body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise OpenAIError("request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        msg = str(err["msg"]).removeprefix("Value error, ")
        param = str(err["loc"][0]) if err["loc"] else None  # the top-level field
        if param is None and ":" in msg:  # our model validators say "field: problem"
            param = msg.split(":", 1)[0]
        elif param is not None:
            msg = f"{param}: {msg}"
        raise OpenAIError(msg, param=param) from e
