"""A stand-in for the data-parallel router: engines taken in turn, skipping dead ones.

``RoundRobinEngines`` holds engines with ``AsyncEngine``'s interface (``EngineCoreClient``s)
and is one itself, so the HTTP layer serves it unchanged. It is the simplest routing that
works, kept in this one file so the real router (``actors/dp_router.py``'s
``DataParallelEngine``: prefix-aware, per-engine stats) replaces it whole.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from pagedserve.actors.errors import EngineError
from pagedserve.actors.stats import EngineStats, StatLogger


class RoundRobinEngines:
    """Each request to the next live engine; ``failure`` once none is left."""

    def __init__(self, engines: list[Any]):
        self.engines = engines
        self.config = engines[0].config
        self.info = engines[0].info
        self.tokenizer = engines[0].tokenizer
        self._next = 0

    def _pick(self) -> Any:
        for _ in range(len(self.engines)):
            engine = self.engines[self._next % len(self.engines)]
            self._next += 1
            if engine.failure is None:
                return engine
        raise EngineError(self.failure or "no engine left")

    def _live(self) -> list[Any]:
        return [e for e in self.engines if e.failure is None]

    async def add_request(self, *args: Any, **kwargs: Any) -> Any:
        return await self._pick().add_request(*args, **kwargs)

    async def beam_search(self, *args: Any, **kwargs: Any) -> Any:
        return await self._pick().beam_search(*args, **kwargs)

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        stream = await self.add_request(*args, **kwargs)
        async with aclosing(stream):
            async for delta in stream:
                yield delta

    async def compile_grammar(self, spec: Any) -> Any:
        return await self._pick().compile_grammar(spec)

    async def get_engine_stats(self) -> list[EngineStats]:
        """Each live engine's own stats, in rank order."""
        return list(await asyncio.gather(*(e.get_stats() for e in self._live())))

    async def get_stats(self) -> EngineStats:
        """The live engines' totals: queues, blocks and counters summed, requests and steps
        listed together."""
        each = await self.get_engine_stats()
        if not each:
            raise EngineError(self.failure or "no engine left")
        kv = _summed(s.kv_cache for s in each)
        return dataclasses.replace(
            each[0], scheduler=_summed(s.scheduler for s in each), kv_cache=kv,
            steps=sorted((st for s in each for st in s.steps), key=lambda st: st.time),
            throughput=_summed(s.throughput for s in each),
            model=dataclasses.replace(each[0].model, num_blocks=kv.num_blocks))

    async def reset_prefix_cache(self) -> int:
        return sum(await asyncio.gather(*(e.reset_prefix_cache() for e in self._live())))

    async def drain(self, timeout: float) -> None:
        await asyncio.gather(*(e.drain(timeout) for e in self._live()))

    async def wait_idle(self) -> None:
        await asyncio.gather(*(e.wait_idle() for e in self._live()))

    def effective_config(self) -> dict[str, Any]:
        return self.engines[0].effective_config()

    def add_stat_logger(self, logger: StatLogger) -> None:
        for engine in self.engines:
            engine.add_stat_logger(logger)

    @property
    def failure(self) -> str | None:
        """``None`` while one engine serves; the reasons once all are gone."""
        if self._live():
            return None
        return "; ".join(e.failure for e in self.engines)

    async def wait_failed(self) -> None:
        await asyncio.gather(*(e.wait_failed() for e in self.engines))

    async def shutdown(self) -> None:
        await asyncio.gather(*(e.shutdown() for e in self.engines))


def _summed(items: Any) -> Any:
    """A dataclass whose numeric fields are the sums of ``items``' (the first's others)."""
    items = list(items)
    out = dataclasses.replace(items[0])
    for f in dataclasses.fields(out):
        if f.name in ("block_size", "window_s"):
            continue
        value = getattr(out, f.name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            setattr(out, f.name, sum(getattr(i, f.name) for i in items))
        elif isinstance(value, list) and f.name == "requests":
            setattr(out, f.name, [r for i in items for r in getattr(i, f.name)])
    if hasattr(out, "usage"):
        out.usage = (out.num_blocks - out.num_free_blocks) / max(1, out.num_blocks)
    return out
