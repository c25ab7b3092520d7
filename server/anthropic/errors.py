"""Anthropic's error shape, ``{"type": "error", "error": {"type", "message"}}``, for every
error answered under ``/v1/messages`` (the handlers', the guard's and Starlette's alike).

The ``type`` follows the status as Anthropic's API documents it (``invalid_request_error`` for
400 and the other 4xx, ``authentication_error`` 401, ``permission_error`` 403,
``not_found_error`` 404, ``request_too_large`` 413, ``rate_limit_error`` 429, ``api_error``
500, ``overloaded_error`` for a server that cannot take the request now: our 503, Anthropic's
529). The status itself is the one pagedserve answers every API with.
"""

from __future__ import annotations

from typing import Any

MESSAGES_PATH = "/v1/messages"

_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def is_messages_path(path: str) -> bool:
    """Whether ``path`` belongs to the Messages API (its errors are Anthropic's)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_error_body(message: str, status: int) -> dict[str, Any]:
    """The error object for ``status``; also the ``data`` of a stream's ``error`` event."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}
