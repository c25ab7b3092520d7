"""The engine side of KV events (``actors/kv/events.py``): record what the block pool does to
the prefix cache during a step and hand one ``KVEventBatch`` per step to the sinks (vLLM's
``KVEventPublisher`` in ``vllm/distributed/kv_events.py`` and the ``kv_event_queue`` its
``BlockPool`` fills, reduced to an in-process list).

Who calls what:

- ``BlockPool`` calls ``stored`` / ``removed`` / ``cleared`` as a block gains a hash, loses it
  (evicted for other tokens, or dropped by a prefix-cache reset), or the whole cache is reset.
  It does so only while ``BlockPool.kv_events`` is set, which ``add_sink`` does: an engine
  nobody listens to (a single-engine server) pays one ``is None`` test per hashed block and
  one call per step, nothing more.
- The scheduler calls ``flush(num_running, num_waiting)`` at the top of each loop turn (after
  a step, and before it waits idle for its mailbox) and once it has drained its mailbox
  (before the step): the events since go out as one batch, with an ``EngineLoad`` first when
  either count changed since the last one pushed. So the router's loads are pushed on change,
  never polled, and a request that arrives and ends within one step is seen arriving (in the
  drain's flush) and leaving (in the step's), which the router needs to drop the count it
  added when it sent the request.

Consecutive events of one kind are merged (``BlockStored([a]), BlockStored([b])`` goes out as
``BlockStored([a, b])``); order across kinds is kept, so a hash removed then stored again in
one step ends up stored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from pagedserve.actors.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineLoad,
    KVEvent,
    KVEventBatch,
    KVEventSink,
)

if TYPE_CHECKING:
    from pagedserve.actors.kv.block_pool import BlockPool

log = structlog.get_logger(__name__)


class KVEventPublisher:
    """Per engine: the events recorded since the last ``flush`` and the sinks they go to.

    Attributes:
        engine_index: stamped on every batch (the data-parallel rank; 0 for a lone engine).
        sinks: called with each non-empty batch, on the scheduler's task; they must not block.
    """

    def __init__(self, block_pool: BlockPool, engine_index: int = 0):
        self.block_pool = block_pool
        self.engine_index = engine_index
        self.sinks: list[KVEventSink] = []
        self._events: list[KVEvent] = []
        self._load: tuple[int, int] | None = None  # the last EngineLoad pushed

    @property
    def enabled(self) -> bool:
        return bool(self.sinks)

    def add_sink(self, sink: KVEventSink) -> None:
        """Start recording (the pool calls back from now on) and send to ``sink`` too. A sink
        added after blocks were cached first hears of them as they are stored again or
        evicted; add sinks at start-up, before requests arrive."""
        self.sinks.append(sink)
        self.block_pool.kv_events = self
        self._load = None  # a new listener hears the current load at the next flush

    # -- from the block pool ------------------------------------------------------------------

    def stored(self, block_hash: bytes) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockStored):
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockStored([block_hash]))

    def removed(self, block_hash: bytes) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockRemoved([block_hash]))

    def cleared(self) -> None:
        """Every cached hash is gone: what came before in this batch no longer matters."""
        self._events = [AllBlocksCleared()]

    # -- from the scheduler -------------------------------------------------------------------

    def flush(self, num_running: int, num_waiting: int) -> None:
        """Send the turn's events (and the load, when it changed) as one batch."""
        if not self.sinks:
            return
        load = (num_running, num_waiting)
        if load != self._load:
            self._events.insert(0, EngineLoad(num_running, num_waiting))
            self._load = load
        if not self._events:
            return
        batch = KVEventBatch(self.engine_index, self._events)
        self._events = []
        for sink in self.sinks:
            try:
                sink(batch)
            except Exception:  # a broken listener must not stop the engine
                log.exception("kv_event_sink_failed", engine_index=self.engine_index)
