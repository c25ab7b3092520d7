"""An engine in another process, as an ``EngineClient`` (what ``server/`` calls).

``EngineCoreClient`` stands for one engine-core process (``actors/engine_core/proc.py``) on
this machine or a ``--headless`` node, through the hub's ROUTER (``actors/engine_core/hub.py``).
The cut is at ``AsyncEngine``'s interface (the core runs a whole ``AsyncEngine``), so the HTTP
layer works unchanged on either, and a list of clients is what a data-parallel front routes
over. Detokenizing and stop strings run in the core, beside its scheduler: the API process's
one core of Python serves many engines' streams, so it should carry as little per token as
it can.

When the engine is lost (``EngineCoreHub.lose``), every request it held ends with
``EngineError`` naming the engine (an error event in the stream, a 500 otherwise), its
pending calls raise the same, ``failure`` says why and ``wait_failed`` returns.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from pagedserve.actors.beam.search import BeamSearchOutput, BeamSearchParams
from pagedserve.actors.engine.config import EngineConfig
from pagedserve.actors.engine.protocol import EngineReplica, GenerateRequest, GenerationDelta
from pagedserve.actors.engine.request_stream import StreamState
from pagedserve.actors.engine_core import messages as m
from pagedserve.actors.engine_core.hub import EngineCoreHub
from pagedserve.actors.errors import EngineError, EngineShuttingDown
from pagedserve.actors.kv.events import KVEventSink
from pagedserve.actors.stats import EngineStats, StatLogger
from pagedserve.gpu.sample.sampling_params import StructuredOutputsParams


@dataclass(slots=True)
class RemoteGrammar:
    """``compile_grammar``'s result: the core compiled ``spec`` and keeps it in its cache;
    ``add_request(grammar=...)`` has the core use that compile."""

    spec: StructuredOutputsParams


class RemoteRequestStream:
    """``RequestStream``'s interface over the wire: ``async for`` the deltas; ``close`` on a
    live stream aborts the request in the core (its blocks are freed before the next step)."""

    __slots__ = ("request_id", "state", "_client", "_rid", "_queue")

    def __init__(self, client: EngineCoreClient, rid: int, request_id: str):
        self.request_id = request_id
        self.state = StreamState.LIVE
        self._client = client
        self._rid = rid
        self._queue: asyncio.Queue[m.StreamItem] = asyncio.Queue()

    def __aiter__(self) -> RemoteRequestStream:
        return self

    async def __anext__(self) -> GenerationDelta:
        if self.state is not StreamState.LIVE:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:
            self.close()
            raise
        if item.done:
            self._end(StreamState.FINISHED)
        if item.error is not None:
            m.raise_wire_error(item.error)
        assert item.delta is not None  # noqa: S101  (the core sends one or the other)
        return item.delta

    def put(self, item: m.StreamItem) -> None:
        self._queue.put_nowait(item)

    def close(self) -> None:
        if self.state is StreamState.LIVE:
            self._end(StreamState.ABORTED)
            self._client.send(m.AbortMsg(self._rid))

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001  (interpreter shutting down)
            pass

    def _end(self, state: StreamState) -> None:
        self.state = state
        self._client.streams.pop(self._rid, None)
        self._client._forget(self._rid)  # noqa: SLF001


class RemoteBeamSearchStream(RemoteRequestStream):
    """``BeamSearchStream``'s interface: ``await result()`` once; ``close()`` aborts."""

    __slots__ = ()

    async def result(self) -> BeamSearchOutput:
        try:
            item = await self._queue.get()
        except BaseException:
            self.close()
            raise
        self._end(StreamState.FINISHED)
        if item.error is not None:
            m.raise_wire_error(item.error)
        assert item.beam is not None  # noqa: S101
        return item.beam


class EngineCoreClient(EngineReplica):
    """One engine-core process as an engine. Built by ``actors/dp/launch.py`` once the core
    has registered; ``info``, ``effective_config()`` are what it registered with."""

    def __init__(self, hub: EngineCoreHub, registration: m.RegisterMsg, config: EngineConfig,
                 tokenizer: PreTrainedTokenizerBase,
                 wait_stopped: Callable[[], Awaitable[None]] | None = None):
        """``wait_stopped``: until the core's process has exited (a local one; a headless
        node's own launcher waits for its)."""
        self.engine_index = registration.engine_index
        self.pid = registration.pid
        self.config = config
        self.info = registration.info
        self.tokenizer = tokenizer
        self.stat_loggers: list[StatLogger] = []
        self.kv_event_sinks: list[KVEventSink] = []
        self.streams: dict[int, RemoteRequestStream] = {}
        # The front's own count of this engine's work (``front_load``): per request sent and
        # not finished, its prompt tokens until its first output arrives, then 0.
        self._unfinished: dict[int, int] = {}
        self._unanswered_tokens = 0
        self._hub = hub
        self._wait_stopped = wait_stopped
        self._effective = registration.effective_config
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._failure: str | None = None
        self._closed = False
        self._dead = asyncio.Event()
        hub.on_message[self.engine_index] = self._on_message
        hub.on_lost[self.engine_index] = self._fail
        if self.engine_index in hub.lost:
            self._fail(hub.lost[self.engine_index])

    # -- the wire -----------------------------------------------------------------------------

    def send(self, msg: object) -> None:
        self._hub.send(self.engine_index, msg)

    def _on_message(self, msg: object) -> None:
        if isinstance(msg, m.OutputsMsg):
            for item in msg.items:
                self._answered(item.rid, item.done)
                stream = self.streams.get(item.rid)
                if stream is not None:
                    stream.put(item)
        elif isinstance(msg, (m.AcceptedMsg, m.ReplyMsg)):
            key = msg.rid if isinstance(msg, m.AcceptedMsg) else msg.call_id
            future = self._pending.pop(key, None)
            if future is not None and not future.done():
                future.set_result(msg)
        elif isinstance(msg, m.StatsMsg):
            for logger in self.stat_loggers:
                for step in msg.steps:
                    logger.record_step(step)
                for update in msg.updates:
                    logger.record_request(update)
        elif isinstance(msg, m.KVEventsMsg):
            for sink in self.kv_event_sinks:
                sink(msg.batch)

    def _fail(self, reason: str) -> None:
        """The engine is gone: end its requests and calls with an error that names it."""
        if self._failure is None and not self._closed:
            self._failure = f"data-parallel engine {self.engine_index} failed: {reason}"
            self._end_all(EngineError(self._failure))
            self._dead.set()

    def _end_all(self, error: EngineError) -> None:
        self._unfinished.clear()
        self._unanswered_tokens = 0
        wire = m.wire_error(error)
        for rid, stream in list(self.streams.items()):
            stream.put(m.StreamItem(rid, error=wire, done=True))
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()

    async def _ask(self, key: int, msg: object) -> Any:
        if self._failure is not None or self._closed:
            raise EngineError(self._failure or "the engine was shut down")
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending[key] = future
        self.send(msg)
        return await future

    async def _rpc(self, method: str, args: tuple) -> Any:
        call_id = next(self._ids)
        reply: m.ReplyMsg = await self._ask(call_id, m.CallMsg(call_id, method, list(args)))
        if reply.error is not None:
            m.raise_wire_error(reply.error)
        return reply.value

    # -- the front's count of this engine's work ----------------------------------------------

    def front_load(self) -> tuple[int, int]:
        """``(requests, prompt tokens)``: the requests this front sent the engine that have
        not finished (waiting, running, or on the wire either way), and the prompt tokens of
        those not answered yet (their prefill is still to come). Exact at every moment, unlike
        the engine's pushed ``EngineLoad``, which cannot count what is still on the wire."""
        return len(self._unfinished), self._unanswered_tokens

    def _track(self, rid: int, prompt_tokens: int) -> None:
        self._unfinished[rid] = prompt_tokens
        self._unanswered_tokens += prompt_tokens

    def _answered(self, rid: int, done: bool) -> None:
        """An output of ``rid`` arrived: its prompt is answered; ``done``: it is finished."""
        if done:
            tokens = self._unfinished.pop(rid, 0)
        else:
            tokens = self._unfinished.get(rid, 0)
            if tokens:
                self._unfinished[rid] = 0
        self._unanswered_tokens -= tokens

    def _forget(self, rid: int) -> None:
        self._answered(rid, done=True)

    async def _admit(self, stream: RemoteRequestStream, msg: object, prompt_tokens: int) -> None:
        """Send the add and wait until the core's scheduler accepts it; a refusal raises what
        ``AsyncEngine`` raises, a cancellation aborts it in the core."""
        self.streams[stream._rid] = stream  # noqa: SLF001
        self._track(stream._rid, prompt_tokens)  # noqa: SLF001
        try:
            accepted: m.AcceptedMsg = await self._ask(stream._rid, msg)  # noqa: SLF001
        except BaseException:
            self._pending.pop(stream._rid, None)  # noqa: SLF001
            stream.close()
            raise
        if accepted.error is not None:
            stream._end(StreamState.FINISHED)  # noqa: SLF001
            m.raise_wire_error(accepted.error)

    # -- EngineClient -----------------------------------------------------------------------------

    async def submit(self, new: GenerateRequest) -> RemoteRequestStream:
        """``add_request`` (``EngineClient``'s) in the core; raises ``EngineError`` once the
        engine is lost.

        Raises:
            ValueError: ``lora_request`` is given: adapters are not served across processes
                (``--enable-lora`` with data parallelism is refused at start).
        """
        params, grammar = new.params, new.grammar
        if grammar is not None and grammar.spec != params.structured_outputs:
            raise ValueError("grammar was compiled for another constraint than "
                             "params.structured_outputs")
        if new.lora_request is not None:
            raise ValueError("LoRA adapters are not served by an engine-core process")
        rid = next(self._ids)
        stream = RemoteRequestStream(self, rid, new.request_id)
        await self._admit(stream, m.AddRequestMsg(rid, new.request_id,
                                                  list(new.prompt_token_ids), params,
                                                  new.priority, new.cache_salt,
                                                  grammar is not None, new.kv_transfer_params),
                          len(new.prompt_token_ids))
        return stream

    async def beam_search(
        self, request_id: str, prompt_token_ids: list[int], params: BeamSearchParams,
        stop_token_ids: list[int] | None = None, priority: int = 0,
        cache_salt: str | None = None,
    ) -> RemoteBeamSearchStream:
        rid = next(self._ids)
        stream = RemoteBeamSearchStream(self, rid, request_id)
        await self._admit(stream, m.BeamSearchMsg(rid, request_id, list(prompt_token_ids), params,
                                                  stop_token_ids, priority, cache_salt),
                          len(prompt_token_ids))
        return stream

    async def compile_grammar(self, spec: StructuredOutputsParams) -> RemoteGrammar:
        """Raises ``GrammarError`` as ``AsyncEngine.compile_grammar`` does."""
        await self._rpc("compile_grammar", (spec,))
        return RemoteGrammar(spec)

    async def get_stats(self) -> EngineStats:
        return await self._rpc("get_stats", ())

    async def reset_prefix_cache(self) -> int:
        return await self._rpc("reset_prefix_cache", ())

    async def drain(self, timeout: float) -> None:
        if self._failure is None and not self._closed:
            await self._rpc("drain", (timeout,))

    async def wait_idle(self) -> None:
        if self._failure is None and not self._closed:
            await self._rpc("wait_idle", ())

    def effective_config(self) -> dict[str, Any]:
        return self._effective

    def add_stat_logger(self, logger: StatLogger) -> None:
        """As ``AsyncEngine.add_stat_logger``: the core forwards its steps and request
        updates (``StatsMsg``, batched per step) to ``logger``."""
        self.stat_loggers.append(logger)
        self.send(m.SubscribeMsg(stats=True))

    def add_kv_event_sink(self, sink: KVEventSink, engine_index: int | None = None) -> None:
        """``sink`` gets each ``KVEventBatch`` the core's scheduler emits, stamped with the
        core's rank (``engine_index``, when given, must be that rank: the router's index)."""
        if engine_index is not None and engine_index != self.engine_index:
            raise ValueError(f"engine {self.engine_index}'s KV events asked for as engine "
                             f"{engine_index}")
        self.kv_event_sinks.append(sink)
        self.send(m.SubscribeMsg(kv_events=True))

    @property
    def failure(self) -> str | None:
        return self._failure

    async def wait_failed(self) -> None:
        await self._dead.wait()

    async def shutdown(self) -> None:
        """Tell the core to stop (``actors/dp/launch.py`` waits for local processes)."""
        if self._closed:
            return
        self._hub.stopping.add(self.engine_index)
        self.send(m.ShutdownMsg())
        self._closed = True
        self._end_all(EngineShuttingDown("server shutting down"))
        if self._wait_stopped is not None:
            await self._wait_stopped()
        self._hub.release(self.engine_index)
