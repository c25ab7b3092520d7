"""What stands between a checked request and the engine: the scheduling-policy check and the
HTTP error for a request the engine refused. One place for both the sampled requests
(``Serving._start``) and a beam search (``beam_search.start_beam_searches``)."""

from __future__ import annotations

from typing import Any

from pagedserve.actors.errors import DuplicateRequestId, EngineDeadError, EngineOverloaded
from pagedserve.server.errors import OpenAIError


def check_priority(body: Any, policy: str) -> None:
    """A 400 for a ``priority`` the scheduler would ignore (it is not the priority policy)."""
    if body.priority != 0 and policy != "priority":
        raise OpenAIError("priority is only honoured with --scheduling-policy priority",
                          param="priority")


ADMISSION_ERRORS = (EngineOverloaded, DuplicateRequestId, EngineDeadError)


def admission_error(e: EngineOverloaded | DuplicateRequestId | EngineDeadError) -> OpenAIError:
    """The engine's refusal as HTTP: overloaded → 503 with ``Retry-After``, a dead engine →
    503 (it will not come back: no ``Retry-After``), a request id already in use → 400 on
    ``X-Request-Id``."""
    if isinstance(e, EngineDeadError):
        return OpenAIError(f"the engine is dead: {e}", status=503)
    if isinstance(e, EngineOverloaded):
        return OpenAIError(str(e), status=503, headers={"Retry-After": "1"})
    return OpenAIError(str(e), status=400, param="X-Request-Id")
