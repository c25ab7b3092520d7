"""The messages between the API process and an engine-core process, and their codec.

One typed dataclass per message, each serialized once with msgpack (mini-sglang's one message
type per hop; vLLM's ``vllm/v1/engine/__init__.py`` + ``serial_utils.py``, read to learn only).
The cut is at ``AsyncEngine``'s interface: the core process runs a whole ``AsyncEngine``
(scheduler, executor, detokenizer, stop strings, grammars, beam search), so what crosses the
socket is what the HTTP layer already gets back from an engine: ``GenerationDelta``s, a
``BeamSearchOutput``, stats records, KV events.

Codec: any dataclass of the allow-list below (the messages and the types they carry) travels
as an array ``[marker, type name, *init fields]`` (the marker a msgpack extension no plain value
can be), nested as deep as it goes, all in one ``packb`` pass; enums and sets as extensions.
Decoding builds only allow-listed types, never arbitrary classes (no pickle). Tuples come
back as lists.

Front → core: ``AddRequestMsg``, ``BeamSearchMsg``, ``AbortMsg``, ``CallMsg``, ``SubscribeMsg``,
``ShutdownMsg``. Core → front: ``RegisterMsg`` / ``StartFailedMsg`` (once), ``AcceptedMsg`` (per
request), ``OutputsMsg`` (all streams' items of one step, batched), ``ReplyMsg``, ``StatsMsg``,
``KVEventsMsg``, ``HeartbeatMsg``.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

import msgpack

from pagedserve.actors.beam.search import BeamHypothesis, BeamSearchOutput, BeamSearchParams
from pagedserve.actors.core.config import SchedulerConfig
from pagedserve.actors.engine.config import EngineConfig
from pagedserve.actors.engine.protocol import GenerationDelta
from pagedserve.actors.errors import (
    DuplicateRequestId,
    EngineError,
    EngineOverloaded,
    EngineShuttingDown,
)
from pagedserve.actors.kv import events as kv_events
from pagedserve.actors.spec_decode.config import SpeculativeConfig
from pagedserve.actors.stats import (
    EngineStats,
    FinishedRequest,
    KVCacheStats,
    RequestStats,
    RequestUpdate,
    SchedulerStats,
    SpecDecodeStats,
    StepStats,
    Throughput,
)
from pagedserve.actors.structured_output.config import StructuredOutputConfig
from pagedserve.actors.structured_output.manager import GrammarError
from pagedserve.gpu.config import CacheConfig, ModelConfig, ParallelConfig
from pagedserve.gpu.model_info import ModelInfo
from pagedserve.gpu.pooling.pooling_params import PoolerConfig, PoolingType
from pagedserve.gpu.pooling.pooling_runner import PoolingInfo
from pagedserve.gpu.sample.sampler import TokenLogprobs
from pagedserve.gpu.sample.sampling_params import SamplingParams, StructuredOutputsParams


@dataclass(slots=True)
class WireError:
    """An exception raised on the other side: its class name (one of ``ERROR_TYPES``, else
    ``EngineError``) and message."""

    type: str
    message: str


@dataclass(slots=True)
class CoreSpec:
    """What one engine-core process starts from (``actors/dp/launch.py`` writes it into the
    process's environment): its settings, its data-parallel rank, the front's ROUTER address
    (``tcp://host:port``), the log level."""

    config: EngineConfig
    engine_index: int
    address: str
    log_level: str = "info"


# -- front → core -----------------------------------------------------------------------------


@dataclass(slots=True)
class AddRequestMsg:
    """``AsyncEngine.add_request``. ``rid``: the client's number for this request on the wire
    (request ids may repeat once a request ended; ``rid`` never does). ``compiled``: the
    front checked ``params.structured_outputs`` with ``compile_grammar`` (the core's compile
    cache holds it)."""

    rid: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    compiled: bool = False
    kv_transfer_params: dict[str, Any] | None = None  # P/D: for the core's KV connector


@dataclass(slots=True)
class BeamSearchMsg:
    rid: int
    request_id: str
    prompt_token_ids: list[int]
    params: BeamSearchParams
    stop_token_ids: list[int] | None = None
    priority: int = 0
    cache_salt: str | None = None


@dataclass(slots=True)
class AbortMsg:
    """The reader stopped (client gone): the core aborts the request and frees its blocks."""

    rid: int


@dataclass(slots=True)
class CallMsg:
    """One of ``CALLS`` on the core's engine; answered by a ``ReplyMsg`` with ``call_id``."""

    call_id: int
    method: str
    args: list[Any] = field(default_factory=list)


@dataclass(slots=True)
class SubscribeMsg:
    """Start forwarding stat-logger records (``stats``) and/or KV events (``kv_events``)."""

    stats: bool = False
    kv_events: bool = False


@dataclass(slots=True)
class ShutdownMsg:
    """Stop the engine and exit (the front is shutting down)."""


# -- core → front -----------------------------------------------------------------------------


@dataclass(slots=True)
class RegisterMsg:
    """The engine is loaded and serving: what ``AsyncEngine.info`` / ``effective_config`` say."""

    engine_index: int
    pid: int
    info: ModelInfo
    effective_config: dict[str, Any]


@dataclass(slots=True)
class StartFailedMsg:
    """The engine could not start (model not found, settings that cannot work)."""

    engine_index: int
    error: str


@dataclass(slots=True)
class AcceptedMsg:
    """The scheduler accepted request ``rid`` (``error`` is None), or refused it."""

    rid: int
    error: WireError | None = None


@dataclass(slots=True)
class StreamItem:
    """One output of one request: a delta, a beam search's result, or its failure; ``done``
    marks its last item (the core holds nothing for it any more)."""

    rid: int
    delta: GenerationDelta | None = None
    beam: BeamSearchOutput | None = None
    error: WireError | None = None
    done: bool = False


@dataclass(slots=True)
class OutputsMsg:
    """The items of every stream that had output in one engine step."""

    items: list[StreamItem]


@dataclass(slots=True)
class ReplyMsg:
    call_id: int
    value: Any = None
    error: WireError | None = None


@dataclass(slots=True)
class StatsMsg:
    """What the core's stat loggers saw since the last one (``actors/stats.py``)."""

    steps: list[StepStats] = field(default_factory=list)
    updates: list[RequestUpdate] = field(default_factory=list)


@dataclass(slots=True)
class KVEventsMsg:
    batch: kv_events.KVEventBatch


@dataclass(slots=True)
class HeartbeatMsg:
    """Sent every ``HEARTBEAT_INTERVAL_S`` seconds: a node that stops sending is dead."""


# The engine methods a CallMsg may name.
CALLS = frozenset({"get_stats", "reset_prefix_cache", "drain", "wait_idle", "compile_grammar"})

ERROR_TYPES: dict[str, type[Exception]] = {
    cls.__name__: cls for cls in (EngineError, EngineShuttingDown, EngineOverloaded,
                                  DuplicateRequestId, GrammarError, ValueError)
}


def wire_error(e: BaseException) -> WireError:
    name = type(e).__name__
    return WireError(name if name in ERROR_TYPES else "EngineError",
                     str(e) if name in ERROR_TYPES else f"{name}: {e}")


def raise_wire_error(error: WireError) -> None:
    raise ERROR_TYPES.get(error.type, EngineError)(error.message)


# -- codec ------------------------------------------------------------------------------------

_DATACLASS, _ENUM, _SET = 1, 2, 3

_ALLOWED: tuple[type, ...] = (
    WireError, CoreSpec, AddRequestMsg, BeamSearchMsg, AbortMsg, CallMsg, SubscribeMsg,
    ShutdownMsg,
    RegisterMsg, StartFailedMsg, AcceptedMsg, StreamItem, OutputsMsg, ReplyMsg, StatsMsg,
    KVEventsMsg, HeartbeatMsg,
    SamplingParams, StructuredOutputsParams, BeamSearchParams, GenerationDelta, TokenLogprobs,
    BeamSearchOutput, BeamHypothesis, StepStats, RequestUpdate, FinishedRequest, EngineStats,
    SchedulerStats, KVCacheStats, RequestStats, SpecDecodeStats, Throughput, ModelInfo,
    ModelConfig, CacheConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig,
    StructuredOutputConfig, EngineConfig, PoolerConfig, PoolingInfo,
    kv_events.KVEventBatch, kv_events.BlockStored, kv_events.BlockRemoved,
    kv_events.AllBlocksCleared, kv_events.EngineLoad,
)
_TYPES: dict[str, type] = {cls.__name__: cls for cls in _ALLOWED}
_FIELDS: dict[type, tuple[str, ...]] = {
    cls: tuple(f.name for f in dataclasses.fields(cls) if f.init) for cls in _ALLOWED}
_ENUMS: dict[str, type[enum.Enum]] = {"PoolingType": PoolingType}  # add an enum's class here


_MARK = object()  # what the marker extension decodes to, at the head of a dataclass's array
_MARKER = msgpack.ExtType(_DATACLASS, b"")


def _default(obj: Any) -> Any:
    """A dataclass becomes ``[marker, type name, *init fields]``, packed in the same pass (no
    nested ``packb``): ``_list_hook`` turns such arrays back into the dataclass."""
    names = _FIELDS.get(type(obj))
    if names is not None:
        return [_MARKER, type(obj).__name__, *(getattr(obj, n) for n in names)]
    if isinstance(obj, enum.Enum) and type(obj).__name__ in _ENUMS:
        return msgpack.ExtType(_ENUM, msgpack.packb([type(obj).__name__, obj.value]))
    if isinstance(obj, (set, frozenset)):
        return msgpack.ExtType(_SET, msgpack.packb(list(obj), default=_default))
    raise TypeError(f"{type(obj).__name__} cannot cross to an engine-core process")


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _DATACLASS:
        return _MARK
    values = msgpack.unpackb(data, ext_hook=_ext_hook, list_hook=_list_hook,
                             strict_map_key=False)
    if code == _ENUM:
        return _ENUMS[values[0]](values[1])
    if code == _SET:
        return set(values)
    return msgpack.ExtType(code, data)


def _list_hook(values: list) -> Any:
    if not values or values[0] is not _MARK:
        return values
    cls = _TYPES[values[1]]  # KeyError: not allow-listed
    return cls(*values[2:])  # the init fields, in order


def encode(msg: Any) -> bytes:
    """One message as bytes (a dataclass of the allow-list)."""
    return msgpack.packb(msg, default=_default)


def decode(data: bytes) -> Any:
    """The message ``encode`` made."""
    return msgpack.unpackb(data, ext_hook=_ext_hook, list_hook=_list_hook, strict_map_key=False)
