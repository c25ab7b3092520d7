"""Several engines behind one API server (data parallelism: vLLM's ``--data-parallel-size``,
its ``DPAsyncMPClient`` on the front side).

``DataParallelEngine`` is an ``EngineClient`` (``actors/engine/protocol.py``), so the server
does not know it talks to a group: ``add_request`` / ``beam_search`` / ``generate`` go to the
engine ``DPRouter`` picks (``actors/dp/router.py``, fed by each engine's KV events); stats are
each engine's plus totals (``actors/dp/stats.py``); ``reset_prefix_cache``, ``drain``,
``wait_idle`` and ``shutdown`` reach every engine.

The engines are given as a list, index = data-parallel rank: the ``EngineCoreClient``s of the
engine-core processes (``actors/dp/launch.py`` builds the group once every rank, local or on a
``--headless`` node, has registered); any ``EngineReplica`` serves (an ``AsyncEngine`` in tests). An
engine whose ``failure`` is set is never routed to again; the group is ``degraded`` while some
but not all have failed, and failed (``failure``) once none is left.

``n > 1``: the serving layer sends a request's choices as consecutive ``add_request`` calls
with ids ``<base>-<i>``, the first carrying ``SamplingParams.n = n`` and the others ``n = 0``
(``server/openai/serving.py``); the followers go to the first one's engine, where they share its
prompt blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import structlog

from pagedserve.actors.beam.search import BeamSearchParams
from pagedserve.actors.dp.router import DPRouter, NoEngineLeft, RoutingDecision
from pagedserve.actors.dp.stats import DataParallelStats, EngineRouting, total_stats
from pagedserve.actors.engine.config import EngineConfig
from pagedserve.actors.engine.protocol import (
    BeamSearchHandle,
    DeltaStream,
    EngineClient,
    EngineReplica,
    GenerateRequest,
    Grammar,
)
from pagedserve.actors.stats import EngineStats, StatLogger
from pagedserve.gpu.sample.sampling_params import StructuredOutputsParams

log = structlog.get_logger(__name__)


class DataParallelEngine(EngineClient):
    """Args:
    engines: the group, index = data-parallel rank; all serve the same model and settings.
    policy: the routing policy (``DPRouter``).
    """

    def __init__(self, engines: Sequence[EngineReplica], policy: str = "prefix"):
        if not engines:
            raise ValueError("a data-parallel group needs at least one engine")
        self.engines = engines
        first = engines[0]
        self.config: EngineConfig = first.config
        self.info = first.info
        self.tokenizer = first.tokenizer
        self.router = DPRouter(len(engines), policy, first.info.block_size,
                               first.config.cache.prefix_caching_hash_algo)
        for k, engine in enumerate(engines):
            engine.add_kv_event_sink(self.router.on_kv_events, engine_index=k)
        # Choices 1..n-1 of a request with n > 1, by id base: (engine, choices still to come).
        self._pins: dict[str, list[int]] = {}
        self._watchers = [asyncio.ensure_future(self._watch(k)) for k in range(len(engines))]

    # -- failure ------------------------------------------------------------------------------

    async def _watch(self, k: int) -> None:
        await self.engines[k].wait_failed()
        self._mark_failed(k)

    def _mark_failed(self, k: int) -> None:
        if self.router.engines[k].failed is None:
            reason = self.engines[k].failure or "engine failed"
            self.router.mark_failed(k, reason)
            log.error("data_parallel_engine_failed", engine=k, reason=reason,
                      engines_left=len(self._live()))

    def failed_engines(self) -> dict[int, str]:
        """Failed engines by index, with why."""
        for k, engine in enumerate(self.engines):
            if engine.failure is not None:
                self._mark_failed(k)
        return {v.index: v.failed for v in self.router.engines if v.failed is not None}

    @property
    def degraded(self) -> dict[int, str]:
        """The failed engines while some still serve; empty when all serve or none does."""
        failed = self.failed_engines()
        return failed if len(failed) < len(self.engines) else {}

    @property
    def failure(self) -> str | None:
        """Why the group cannot serve any more (every engine failed), else ``None``."""
        failed = self.failed_engines()
        if len(failed) < len(self.engines):
            return None
        return "every data-parallel engine failed: " + "; ".join(
            f"engine {k}: {why}" for k, why in sorted(failed.items()))

    async def wait_failed(self) -> None:
        """Until every engine has failed."""
        await asyncio.gather(*(e.wait_failed() for e in self.engines))

    def _count_from_front(self) -> None:
        """The router's loads from each engine client's own count (``front_load``), exact
        where the engines' pushed counts lag; an in-process engine keeps none."""
        for k, engine in enumerate(self.engines):
            front_load = getattr(engine, "front_load", None)
            if front_load is not None:
                self.router.count_from_front(k, *front_load())

    def _live(self) -> list[EngineReplica]:
        return [e for e, v in zip(self.engines, self.router.engines) if v.failed is None]

    # -- requests -----------------------------------------------------------------------------

    def _route(self, request_id: str, prompt_token_ids: list[int], n: int,
               cache_salt: str | None) -> int:
        """The engine for one engine request (see the module's note on ``n > 1``)."""
        base = request_id.rpartition("-")[0]
        pin = self._pins.get(base) if n == 0 else None
        if pin is not None and self.router.engines[pin[0]].failed is None:
            pin[1] -= 1
            if pin[1] <= 0:
                del self._pins[base]
            log.info("routed", request_id=request_id, engine=pin[0], route_reason="choice of n")
            return pin[0]
        self.failed_engines()  # mark any engine that failed since the last request
        self._count_from_front()
        try:
            decision: RoutingDecision = self.router.route(prompt_token_ids, cache_salt)
        except NoEngineLeft as e:  # a 503, with every engine's reason
            raise NoEngineLeft(self.failure or str(e)) from None
        if n > 1:
            self._pins[base] = [decision.engine, n - 1]
        log.info("routed", request_id=request_id, **decision.log_fields())
        return decision.engine

    async def submit(self, new: GenerateRequest) -> DeltaStream:
        """``add_request`` (``EngineClient``'s) on the routed engine."""
        params = new.params
        k = self._route(new.request_id, new.prompt_token_ids, params.n, new.cache_salt)
        try:
            return await self.engines[k].submit(new)
        except BaseException:
            if params.n > 1:  # its followers will not come
                self._pins.pop(new.request_id.rpartition("-")[0], None)
            raise

    async def beam_search(
        self, request_id: str, prompt_token_ids: list[int], params: BeamSearchParams,
        stop_token_ids: list[int] | None = None, priority: int = 0,
        cache_salt: str | None = None,
    ) -> BeamSearchHandle:
        """``AsyncEngine.beam_search`` on the routed engine (its beams share blocks there)."""
        k = self._route(request_id, prompt_token_ids, 1, cache_salt)
        return await self.engines[k].beam_search(request_id, prompt_token_ids, params,
                                                 stop_token_ids, priority, cache_salt)

    async def compile_grammar(self, spec: StructuredOutputsParams) -> Grammar:
        """Compiled once, on a live engine: a compile serves any engine of the group (same
        tokenizer and vocabulary)."""
        live = self._live()
        return await (live[0] if live else self.engines[0]).compile_grammar(spec)

    # -- operators ----------------------------------------------------------------------------

    def add_stat_logger(self, logger: StatLogger) -> None:
        """``logger`` sees every engine's steps and requests (the totals)."""
        for engine in self.engines:
            engine.add_stat_logger(logger)

    async def get_stats(self) -> DataParallelStats:
        """Each live engine's snapshot (``None`` for a failed one), the router's view, and the
        totals in the ``EngineStats`` fields."""
        failed = self.failed_engines()

        async def one(k: int) -> EngineStats | None:
            return None if k in failed else await self.engines[k].get_stats()

        per_engine = list(await asyncio.gather(*(one(k) for k in range(len(self.engines)))))
        self._count_from_front()
        routing = [EngineRouting(v.index, v.num_routed, len(v.cached), v.load, v.failed)
                   for v in self.router.engines]
        return total_stats(per_engine, routing, self.router.policy, time.time())

    def effective_config(self) -> dict[str, Any]:
        """Engine 0's settings in force (every engine runs the same), with the group's."""
        config = self.engines[0].effective_config()
        config["data_parallel"] = {"size": len(self.engines), "routing": self.router.policy}
        return config

    async def reset_prefix_cache(self) -> int:
        """On every live engine; returns the blocks dropped in all."""
        return sum(await asyncio.gather(*(e.reset_prefix_cache() for e in self._live())))

    async def drain(self, timeout: float) -> None:
        await asyncio.gather(*(e.drain(timeout) for e in self._live()))

    async def wait_idle(self) -> None:
        await asyncio.gather(*(e.wait_idle() for e in self._live()))

    async def shutdown(self) -> None:
        """Stop every engine, failed ones too (their processes must not outlive the server)."""
        for watcher in self._watchers:
            watcher.cancel()
        errors = [r for r in await asyncio.gather(*(e.shutdown() for e in self.engines),
                                                  return_exceptions=True)
                  if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
