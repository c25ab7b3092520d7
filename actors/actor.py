"""A minimal asyncio actor: one mailbox, one task, state touched only by that task.

Other tasks talk to an actor only by ``send``-ing messages; replies travel in futures carried by
the messages. No locks are needed because nothing outside the actor's task reads its state.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

log = structlog.get_logger(__name__)


class Actor:
    """Subclasses implement ``run()``: a loop that reads ``self.mailbox``."""

    name = "actor"

    def __init__(self) -> None:
        self.mailbox: asyncio.Queue[Any] = asyncio.Queue()
        self._task: asyncio.Task | None = None

    def send(self, msg: Any) -> None:
        """Post a message; never blocks (the mailbox is unbounded)."""
        self.mailbox.put_nowait(msg)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._main(), name=self.name)

    async def _main(self) -> None:
        try:
            await self.run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("actor_crashed", actor=self.name)
            raise

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
