"""A minimal asyncio actor: one mailbox, one task, state touched only by that task.

Other tasks talk to an actor only by ``send``-ing messages; replies travel in futures carried by
the messages. No locks are needed because nothing outside the actor's task reads its state.

An exception that escapes ``run()`` kills the actor, never silently: it is logged with its
traceback, ``failure`` says why and ``dead`` is set (the engine is then dead: ``/health`` 503,
the server exits non-zero), ``on_crash`` fails whatever the actor held, and every message sent
to it from then on is refused at once (``refuse``), so no caller waits on a reply that cannot
come (vLLM's ``EngineDeadError``).
"""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar

import structlog

from pagedserve.actors.errors import EngineDeadError

log = structlog.get_logger(__name__)

M = TypeVar("M")  # the messages an actor takes: one union per actor (actors/messages.py)


class Actor(Generic[M]):
    """Subclasses implement ``run()``: a loop that reads ``self.mailbox``; ``refuse`` and
    ``on_crash`` when their messages carry replies or they hold requests.

    ``M`` is the actor's message type (``Actor[SchedulerMessage]``): sending anything else is a
    type error, and a handler that ``match``es on it ends in ``assert_never``, so a message
    added to the union and not handled is one too (``tests/test_typecheck.py`` runs mypy)."""

    name = "actor"

    def __init__(self) -> None:
        self.mailbox: asyncio.Queue[M] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self.failure: str | None = None  # why the actor died; None while it lives
        self.dead = asyncio.Event()

    def send(self, msg: M) -> None:
        """Post a message; never blocks (the mailbox is unbounded). To a dead actor, the
        message is refused at once (its reply, if any, fails with ``EngineDeadError``)."""
        if self.failure is not None:
            self.refuse(msg, EngineDeadError(self.failure))
        else:
            self.mailbox.put_nowait(msg)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._main(), name=self.name)

    async def _main(self) -> None:
        try:
            await self.run()
        except asyncio.CancelledError:
            raise
        except EngineDeadError as e:  # an actor it depends on died (and logged why)
            log.error("actor_dead", actor=self.name, reason=str(e))
            self.die(str(e))
        except Exception as e:
            log.exception("actor_crashed", actor=self.name)
            self.die(f"the {self.name} crashed: {type(e).__name__}: {e}")

    def die(self, reason: str) -> None:
        """Mark the actor dead: fail what it held (``on_crash``) and what waits in its
        mailbox (``refuse``). Idempotent."""
        if self.failure is not None:
            return
        self.failure = reason
        self.dead.set()
        error = EngineDeadError(reason)
        try:
            self.on_crash(error)
        except Exception:  # the state may be what broke; the mailbox must still be answered
            log.exception("actor_crash_cleanup_failed", actor=self.name)
        while not self.mailbox.empty():
            self.refuse(self.mailbox.get_nowait(), error)

    def refuse(self, msg: M, error: EngineDeadError) -> None:
        """Answer ``msg`` with ``error`` instead of handling it: fail the futures it carries
        (``reply``, ``accepted``) that nobody answered yet."""
        for name in ("reply", "accepted"):
            fut = getattr(msg, name, None)
            if isinstance(fut, asyncio.Future) and not fut.done():
                fut.set_exception(error)

    def on_crash(self, error: EngineDeadError) -> None:
        """Fail what the actor holds (its requests); the base actor holds nothing."""

    async def run(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
