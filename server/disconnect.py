"""A client that goes away: noticed while its request still waits or runs, and its engine
requests aborted then (every endpoint that answers with one body: chat and completions,
pooling, beam search, the Responses and Messages APIs)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any

import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse

from pagedserve.actors.engine.protocol import BeamSearchHandle, DeltaStream
from pagedserve.actors.engine.request_stream import close_all
from pagedserve.server.errors import error_body

log = structlog.get_logger(__name__)


class DisconnectWatch:
    """Watches one request's ASGI ``receive`` for ``http.disconnect`` from the moment the body
    has been read, so that a client that leaves while its request still waits for the
    scheduler (busy with a step) is noticed then, and its request aborted in the very mailbox
    drain that would have admitted it: no step ever computes for it (issue 16's mass
    cancellation). ``stop`` it before another reader (sse-starlette) takes ``receive`` over."""

    def __init__(self, request: Request):
        self.gone = asyncio.Event()
        self._task = asyncio.ensure_future(self._watch(request))

    async def _watch(self, request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.gone.set()

    def stop(self) -> None:
        self._task.cancel()


async def until_disconnect(watch: DisconnectWatch, work: Awaitable[Any], request_id: str,
                           streams: Sequence[DeltaStream | BeamSearchHandle] | None = None,
                           ) -> Any:
    """Await ``work``; if the client disconnects first, cancel it (which aborts the requests it
    started or was starting: ``EngineClient.add_request`` aborts when cancelled), close
    ``streams``, and answer 499 (nobody reads it)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(watch.gone.wait())
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()  # its own cleanup closes the streams, which aborts the requests
            await asyncio.gather(task, return_exceptions=True)
            close_all(streams or [])
            log.info("client_disconnected", request_id=request_id)
    if task.cancelled():
        return JSONResponse(error_body("client disconnected", 499), status_code=499)
    return task.result()
