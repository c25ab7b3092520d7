"""Engine-side errors the HTTP layer maps to statuses."""


class EngineError(RuntimeError):
    """A request failed inside the engine (its step raised); other requests carry on. → 500"""


class EngineOverloaded(RuntimeError):
    """The waiting queue is full (``--max-waiting-requests``). → 503 with Retry-After"""


class DuplicateRequestId(ValueError):
    """A live request already has this id. → 400"""


class EngineShuttingDown(EngineError):
    """The server ended the request while shutting down. → 503"""


class EngineDeadError(EngineError):
    """The engine cannot serve any more (an actor crashed, a worker died); every request it
    held failed with this (vLLM's name). → 503 for a new request, 500 for one it held"""
