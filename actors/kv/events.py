"""KV events: what an engine tells the data-parallel router about its prefix cache and load
(vLLM's ``vllm/distributed/kv_events.py``: BlockStored / BlockRemoved / AllBlocksCleared).

Contract shared by the engine side (the scheduler emits, an engine-core process forwards) and
the router (``actors/dp/router.py``), so both are written against these types only. Every
field is a primitive (int, bytes, list of bytes), so a batch serializes with msgpack as
``[type_name, *fields]`` without a custom codec.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class BlockStored:
    """Full blocks that became prefix-cache hits on this engine, in prompt order.

    Attributes:
        block_hashes: the blocks' chained hashes (``actors/kv/hashing.py``), bytes each.
    """

    block_hashes: list[bytes]


@dataclass(slots=True)
class BlockRemoved:
    """Blocks evicted from the prefix cache (re-used for other tokens)."""

    block_hashes: list[bytes]


@dataclass(slots=True)
class AllBlocksCleared:
    """The prefix cache was reset (``/admin/reset_prefix_cache``)."""


@dataclass(slots=True)
class EngineLoad:
    """Requests on this engine; pushed when either count changes, not polled."""

    num_running: int
    num_waiting: int


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared | EngineLoad


@dataclass(slots=True)
class KVEventBatch:
    """One step's events from one engine, in the order they happened.

    Attributes:
        engine_index: the data-parallel rank that emitted them (0 for a lone engine).
        events: BlockStored / BlockRemoved / AllBlocksCleared / EngineLoad, oldest first.
    """

    engine_index: int
    events: list[KVEvent] = field(default_factory=list)


# A sink receives each non-empty batch, on the engine's event loop; it must not block.
KVEventSink = Callable[[KVEventBatch], None]
