"""One guided request's grammar state (vLLM's ``structured_output/request.py`` split): the
compile future, then the request's own matcher. ``Request.structured_output`` holds it; this
module imports nothing of the engine's, so the request type stays a leaf."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import xgrammar as xgr


class StructuredOutputRequest:
    """One request's grammar state: the compile future, then its matcher (scheduler-owned)."""

    __slots__ = ("_future", "_matcher")

    def __init__(self, future: Future[xgr.CompiledGrammar]):
        self._future = future
        self._matcher: xgr.GrammarMatcher | None = None

    @property
    def ready(self) -> bool:
        return self._future.done()

    @property
    def error(self) -> str | None:
        """Why the compile failed, once it is done; ``None`` when it succeeded."""
        e = self._future.exception() if self._future.done() else None
        return None if e is None else str(e)

    def notify_when_ready(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], Any]):
        """Call ``callback`` on ``loop`` once the compile ends (it may end on a pool thread)."""
        self._future.add_done_callback(lambda _: loop.call_soon_threadsafe(callback))

    @property
    def vocab_size(self) -> int:
        return self._future.result().tokenizer_info.vocab_size

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        if self._matcher is None:
            self._matcher = xgr.GrammarMatcher(self._future.result())
        return self._matcher
