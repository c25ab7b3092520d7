"""The engine-core process: one whole ``AsyncEngine`` behind a ZeroMQ socket (data parallelism's
replica, vLLM's ``EngineCoreProc`` in ``vllm/v1/engine/core.py``, read to learn only).

Started by ``actors/dp/launch.py`` (``python -m pagedserve.actors.engine_core.proc``, its
``engine_core_messages.CoreSpec`` in ``$PAGEDSERVE_ENGINE_CORE_SPEC``), on the API server's
machine or on a ``--headless`` node. It loads the model, connects a DEALER socket (identity
``engine-<k>``) to the front's ROUTER (``actors/engine_core/hub.py``), sends ``RegisterMsg``
and then serves ``actors/engine_core/messages.py``'s messages until ``ShutdownMsg``, SIGTERM,
its parent's death (``PR_SET_PDEATHSIG``: no engine outlives the process that started it) or
the front's connection closing.

Each request is one task here that reads the engine's ``RequestStream`` and adds its deltas to
an outbox; the outbox goes out as one ``OutputsMsg`` per engine step: the stream tasks that a
step's outputs wake all run in the same turn of the event loop, and the flush is queued behind
them (``loop.call_soon``).
"""

from __future__ import annotations

import asyncio
import base64
import ctypes
import os
import signal
import sys
from contextlib import aclosing

import structlog
import zmq
import zmq.asyncio

from pagedserve.actors.engine.async_engine import AsyncEngine
from pagedserve.actors.engine_core import messages as m
from pagedserve.actors.kv.events import KVEventBatch
from pagedserve.actors.log_setup import configure_logging
from pagedserve.actors.stats import RequestUpdate, StepStats

log = structlog.get_logger(__name__)

SPEC_ENV = "PAGEDSERVE_ENGINE_CORE_SPEC"
HEARTBEAT_INTERVAL_S = 1.0


def spec_to_env(spec: m.CoreSpec) -> str:
    return base64.b64encode(m.encode(spec)).decode()


class _Forwarder:
    """A stat logger and KV-event sink in the core that queues what it sees for the front."""

    def __init__(self, core: EngineCoreServer):
        self.core = core

    def record_step(self, step: StepStats) -> None:
        self.core.stats.steps.append(step)
        self.core.schedule_flush()

    def record_request(self, update: RequestUpdate) -> None:
        self.core.stats.updates.append(update)
        self.core.schedule_flush()

    def __call__(self, batch: KVEventBatch) -> None:
        self.core.send(m.KVEventsMsg(batch))


class EngineCoreServer:
    """Serves one ``AsyncEngine`` over a connected DEALER socket."""

    def __init__(self, engine: AsyncEngine, sock: zmq.asyncio.Socket, engine_index: int):
        self.engine = engine
        self.sock = sock
        self.engine_index = engine_index
        self.tasks: dict[int, asyncio.Task] = {}
        self.outbox: list[m.StreamItem] = []
        self.stats = m.StatsMsg()
        self.stopped = asyncio.Event()
        self.num_requests = 0  # accepted since start (logged when the core stops)
        self._flush_pending = False
        self._forwarder = _Forwarder(self)
        self._subscribed = m.SubscribeMsg()

    def send(self, msg: object) -> None:
        """Queued by ZeroMQ's I/O thread at once (no high-water mark): never waits."""
        self.sock.send(m.encode(msg))

    def emit(self, item: m.StreamItem) -> None:
        self.outbox.append(item)
        self.schedule_flush()

    def schedule_flush(self) -> None:
        if not self._flush_pending:
            self._flush_pending = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        if self.outbox:
            items, self.outbox = self.outbox, []
            self.send(m.OutputsMsg(items))
        if self.stats.steps or self.stats.updates:
            stats, self.stats = self.stats, m.StatsMsg()
            self.send(stats)

    async def run(self) -> None:
        """Serve until ``ShutdownMsg`` (or ``stopped`` is set from outside).

        Raises:
            RuntimeError: the engine died (an actor crashed): the process exits non-zero and
                the front fails this engine's requests, as for any dead engine process.
        """
        beat = asyncio.create_task(self._heartbeat())
        recv = asyncio.create_task(self._receive())
        stop = asyncio.create_task(self.stopped.wait())
        gone = asyncio.create_task(self._front_gone())
        failed = asyncio.create_task(self.engine.wait_failed())
        try:
            await asyncio.wait([recv, stop, gone, failed], return_when=asyncio.FIRST_COMPLETED)
            if recv.done():
                recv.result()  # a receive loop that raised says why here
            if failed.done():
                raise RuntimeError(f"the engine failed: {self.engine.failure}")
        finally:
            for task in (beat, recv, stop, gone, failed, *self.tasks.values()):
                task.cancel()
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    async def _front_gone(self) -> None:
        """Until the connection to the front closes (it exited or was killed): then this
        engine's work is over, and a headless node's engine stops rather than queue outputs
        for a front that will not read them."""
        monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            await monitor.recv_multipart()
            log.warning("engine_core_front_gone", hint="the API server's connection closed")
        finally:
            self.sock.disable_monitor()
            monitor.close(linger=0)

    async def _heartbeat(self) -> None:
        while True:
            self.send(m.HeartbeatMsg())
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def _receive(self) -> None:
        while True:
            msg = m.decode(await self.sock.recv())
            if isinstance(msg, m.ShutdownMsg):
                return
            self._dispatch(msg)

    def _dispatch(self, msg: object) -> None:
        if isinstance(msg, m.AddRequestMsg):
            self._start(msg.rid, self._run_request(msg))
        elif isinstance(msg, m.BeamSearchMsg):
            self._start(msg.rid, self._run_beam_search(msg))
        elif isinstance(msg, m.AbortMsg):
            task = self.tasks.get(msg.rid)
            if task is not None:
                task.cancel()  # the stream aborts the request: blocks freed before next step
        elif isinstance(msg, m.CallMsg):
            asyncio.create_task(self._run_call(msg))
        elif isinstance(msg, m.SubscribeMsg):
            self._subscribe(msg)
        else:
            log.warning("engine_core_unknown_message", type=type(msg).__name__)

    def _subscribe(self, msg: m.SubscribeMsg) -> None:
        if msg.stats and not self._subscribed.stats:
            self._subscribed.stats = True
            self.engine.add_stat_logger(self._forwarder)
        if msg.kv_events and not self._subscribed.kv_events:
            self._subscribed.kv_events = True
            self.engine.add_kv_event_sink(self._forwarder, engine_index=self.engine_index)

    def _start(self, rid: int, coro) -> None:
        task = asyncio.create_task(coro)
        self.tasks[rid] = task
        task.add_done_callback(lambda _: self.tasks.pop(rid, None))

    async def _run_request(self, msg: m.AddRequestMsg) -> None:
        try:
            spec = msg.params.structured_outputs
            grammar = (await self.engine.compile_grammar(spec)
                       if msg.compiled and spec is not None else None)
            stream = await self.engine.add_request(
                msg.request_id, msg.prompt_token_ids, msg.params, msg.priority, msg.cache_salt,
                grammar, msg.kv_transfer_params)
        except Exception as e:  # noqa: BLE001  (refused: the front raises it)
            self.send(m.AcceptedMsg(msg.rid, m.wire_error(e)))
            return
        self.send(m.AcceptedMsg(msg.rid))
        self.num_requests += 1
        try:
            async with aclosing(stream):
                async for delta in stream:
                    self.emit(m.StreamItem(msg.rid, delta, done=delta.finish_reason is not None))
        except Exception as e:  # noqa: BLE001  (the request failed: only it)
            self.emit(m.StreamItem(msg.rid, error=m.wire_error(e), done=True))

    async def _run_beam_search(self, msg: m.BeamSearchMsg) -> None:
        try:
            stream = await self.engine.beam_search(
                msg.request_id, msg.prompt_token_ids, msg.params, msg.stop_token_ids,
                msg.priority, msg.cache_salt)
        except Exception as e:  # noqa: BLE001
            self.send(m.AcceptedMsg(msg.rid, m.wire_error(e)))
            return
        self.send(m.AcceptedMsg(msg.rid))
        self.num_requests += 1
        try:
            self.emit(m.StreamItem(msg.rid, beam=await stream.result(), done=True))
        except Exception as e:  # noqa: BLE001
            self.emit(m.StreamItem(msg.rid, error=m.wire_error(e), done=True))
        finally:
            stream.close()

    async def _run_call(self, msg: m.CallMsg) -> None:
        try:
            if msg.method not in m.CALLS:
                raise ValueError(f"unknown engine call {msg.method!r}")
            value = await getattr(self.engine, msg.method)(*msg.args)
            if msg.method == "compile_grammar":
                value = None  # the compiled grammar stays in the core's cache
            self.send(m.ReplyMsg(msg.call_id, value))
        except Exception as e:  # noqa: BLE001
            self.send(m.ReplyMsg(msg.call_id, error=m.wire_error(e)))


def _die_with_parent() -> None:
    """SIGKILL this process when the process that started it exits, however it exits."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the front's ShutdownMsg still ends it


async def serve_core(spec: m.CoreSpec) -> None:
    """Start the engine, register with the front, serve until told to stop."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"engine-{spec.engine_index}".encode())
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 2000)  # the last replies still leave on shutdown
    sock.connect(spec.address)
    try:
        try:
            engine = await AsyncEngine.start(spec.config)
        except Exception as e:  # noqa: BLE001  (the front reports it and exits)
            sock.send(m.encode(m.StartFailedMsg(spec.engine_index, f"{type(e).__name__}: {e}")))
            raise
        core = EngineCoreServer(engine, sock, spec.engine_index)
        try:
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGTERM, core.stopped.set)
            core.send(m.RegisterMsg(spec.engine_index, os.getpid(), engine.info,
                                    engine.effective_config()))
            await core.run()
        finally:
            await engine.shutdown()
            log.info("engine_core_stopped", num_requests=core.num_requests)
    finally:
        sock.close()
        ctx.term()


def main() -> None:
    _die_with_parent()
    # Ctrl-C reaches the whole process group: the API server drains, then stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec: m.CoreSpec = m.decode(base64.b64decode(os.environ.pop(SPEC_ENV)))
    configure_logging(spec.log_level, engine=spec.engine_index)
    try:
        asyncio.run(serve_core(spec))
    except Exception:  # noqa: BLE001  (logged; the front sees the exit)
        log.exception("engine_core_failed")
        sys.exit(1)
    # Stopped cleanly (engine shut down, socket closed after its linger): skip the
    # interpreter's finalization, seconds of garbage-collecting torch's and transformers'
    # modules that the API server would wait for (server/cli.py's _exit_now).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
