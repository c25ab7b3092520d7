"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Types follow vLLM's server (``BadRequestError``, ``NotFoundError``, ...), with the HTTP status
as ``code``. Under ``/v1/messages`` the same errors take Anthropic's shape instead
(``error_body_for``; ``server/anthropic/errors.py``).
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from pagedserve.server.anthropic.errors import anthropic_error_body, is_messages_path

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    431: "RequestHeaderFieldsTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    """Raised anywhere in a handler; turned into an error response with ``status``."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.status, self.param)

    def response(self, path: str = "") -> JSONResponse:
        """The error answer to a request for ``path`` (its API decides the shape)."""
        return JSONResponse(error_body_for(path, self.message, self.status, self.param),
                            status_code=self.status, headers=self.headers)


def error_body(message: str, status: int, param: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError"),
            "param": param,
            "code": status,
        }
    }


def error_body_for(path: str, message: str, status: int, param: str | None = None) -> dict:
    """The error object a client of ``path`` reads: Anthropic's under ``/v1/messages`` (which
    has no ``param``: the message names the field), else OpenAI's."""
    if is_messages_path(path):
        return anthropic_error_body(message, status)
    return error_body(message, status, param)
