"""How ``pagedserve serve`` stops: the first SIGINT/SIGTERM drains, the second ends every
request now, and an engine that dies stops the server on its own.

Draining: the app refuses new requests (503), requests still waiting to start end at once,
running ones may finish for ``--shutdown-timeout`` seconds, then the rest are aborted (their
clients get an error event) and Hypercorn closes, flushing the last stream events."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import structlog

from pagedserve.actors.engine.protocol import EngineClient
from pagedserve.actors.errors import EngineDeadError

log = structlog.get_logger("pagedserve")


class GracefulShutdown:
    """Args:
    engine: what is drained (and watched: its death ends the serving too).
    app: the Starlette app; ``app.draining`` makes it refuse new requests.
    timeout: ``--shutdown-timeout``, the running requests' grace in seconds.
    """

    def __init__(self, engine: EngineClient, app: Any, timeout: float):
        self.engine = engine
        self.app = app
        self.timeout = timeout
        self.stop = asyncio.Event()
        self.forced = asyncio.Event()

    def install(self) -> None:
        """Handle SIGINT and SIGTERM on the running loop."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.on_signal)

    def on_signal(self) -> None:
        """The first SIGINT/SIGTERM drains; the second ends every request now."""
        if self.stop.is_set() and not self.forced.is_set():
            log.warning("shutdown_forced", hint="the requests left are aborted")
            self.forced.set()
        self.stop.set()

    async def trigger(self) -> None:
        """Hypercorn's ``shutdown_trigger``: returns once serving should end. On a signal:
        refuse new requests, let running ones finish for ``timeout`` seconds (a second
        signal: none), abort the rest, then let Hypercorn close (flushing the last stream
        events)."""
        engine = self.engine
        failed = asyncio.ensure_future(engine.wait_failed())
        await asyncio.wait([asyncio.ensure_future(self.stop.wait()), failed],
                           return_when=asyncio.FIRST_COMPLETED)
        if failed.done():  # a worker died: its requests have failed; nothing more can run
            log.error("engine_failed", reason=engine.failure)
            return
        log.info("shutdown_started", timeout_s=self.timeout)
        self.app.draining = True
        drain = asyncio.ensure_future(engine.drain(self.timeout))
        second = asyncio.ensure_future(self.forced.wait())
        try:
            await asyncio.wait([drain, second], return_when=asyncio.FIRST_COMPLETED)
            if drain.done():
                drain.result()
            else:
                drain.cancel()
                await engine.drain(0.0)  # no grace: abort now, as the drain's timeout does
        except EngineDeadError:  # it died meanwhile: its requests have failed already
            log.error("engine_failed", reason=engine.failure)
        finally:
            second.cancel()
