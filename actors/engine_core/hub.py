"""The API process's end of the engine-core sockets: one ROUTER that every engine connects to.

Local engine-core processes and ``--headless`` nodes' engines alike connect a DEALER (identity
``engine-<k>``) to this ROUTER at ``--data-parallel-address:--data-parallel-rpc-port`` and
send ``RegisterMsg``; the front serves once every rank has registered (``wait_for_engines``).
Afterwards the hub hands each message to its engine's ``EngineCoreClient``.

How a dead engine is noticed, without a duration where none is needed:

- its process exits or its node's connection drops: the kernel closes a dead process's TCP
  connection at once (SIGKILL included), and the ROUTER's socket monitor reports
  ``EVENT_DISCONNECTED`` with the connection's file descriptor, which the hub matched to the
  engine when its ``RegisterMsg`` came in on it (the frame's ``SRCFD``), so the engine is
  failed at once (a local engine's process exit is watched directly as well);
- it stops answering while connected (a stopped, ``SIGSTOP``-ed or hung node): each core sends
  a ``HeartbeatMsg`` every second; none for ``PAGEDSERVE_DP_HEARTBEAT_TIMEOUT_S`` seconds
  (default 30) fails it.

A failed engine stays failed: a node that comes back is a new server's business.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pagedserve.actors.engine_core import messages as m

log = structlog.get_logger(__name__)

HEARTBEAT_TIMEOUT_ENV = "PAGEDSERVE_DP_HEARTBEAT_TIMEOUT_S"
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0


def heartbeat_timeout() -> float:
    text = os.environ.get(HEARTBEAT_TIMEOUT_ENV)
    try:
        value = float(text) if text else DEFAULT_HEARTBEAT_TIMEOUT_S
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{HEARTBEAT_TIMEOUT_ENV}={text!r}: give a positive number of seconds")
    return value


class EngineCoreHub:
    """Binds the ROUTER; ``port=0`` picks a free one (one machine, no headless nodes).

    ``on_message[k]`` receives engine ``k``'s messages once it is registered; ``on_lost[k]``
    is called once, with the reason, when it is gone.
    """

    def __init__(self, host: str, port: int):
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a gone peer is an error, not a drop
        for opt in (zmq.SNDHWM, zmq.RCVHWM, zmq.LINGER):
            self.sock.setsockopt(opt, 0)
        bind_host = f"[{host}]" if ":" in host else host
        if ":" in host:
            self.sock.setsockopt(zmq.IPV6, 1)
        if port == 0:
            port = self.sock.bind_to_random_port(f"tcp://{bind_host}")
        else:
            self.sock.bind(f"tcp://{bind_host}:{port}")
        self.address = f"tcp://{bind_host}:{port}"
        self.registered: dict[int, m.RegisterMsg] = {}
        self.start_failures: dict[int, str] = {}
        self.lost: dict[int, str] = {}
        self.on_message: dict[int, Callable[[object], None]] = {}
        self.on_lost: dict[int, Callable[[str], None]] = {}
        self.released: set[int] = set()
        self.stopping: set[int] = set()  # told to shut down: their connection closing is no fault
        self._last_seen: dict[int, float] = {}
        self._changed = asyncio.Event()
        self._timeout = heartbeat_timeout()
        self._fds: dict[int, int] = {}  # connection's file descriptor -> engine index
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._watch()),
                       asyncio.create_task(self._watch_connections())]

    def send(self, index: int, msg: object) -> None:
        """Queued at once (no high-water mark); a peer already gone fails its engine."""
        if index in self.lost:
            return
        sent = self.sock.send_multipart([f"engine-{index}".encode(), m.encode(msg)])
        if sent.done() and sent.exception() is not None:
            self.lose(index, f"cannot reach it ({sent.exception()})")

    def lose(self, index: int, reason: str) -> None:
        """Engine ``index`` is gone for good (its process died, its node left)."""
        if index in self.lost or index in self.released:
            return
        self.lost[index] = reason
        if index in self.stopping:
            log.info("engine_exited", engine=index, reason=reason)
        else:
            log.error("engine_lost", engine=index, reason=reason)
        self._changed.set()
        callback = self.on_lost.get(index)
        if callback is not None:
            callback(reason)

    async def _receive(self) -> None:
        while True:
            identity, payload = await self.sock.recv_multipart(copy=False)
            try:
                index = int(identity.bytes.decode().removeprefix("engine-"))
            except ValueError:
                log.warning("engine_core_unknown_peer", identity=identity.bytes[:40])
                continue
            self._last_seen[index] = time.monotonic()
            msg = m.decode(payload.buffer)
            if isinstance(msg, m.RegisterMsg):
                self._fds[payload.get(zmq.SRCFD)] = index  # which connection is whose
                self._register(msg)
            elif isinstance(msg, m.StartFailedMsg):
                self.start_failures[msg.engine_index] = msg.error
                self._changed.set()
            elif (handler := self.on_message.get(index)) is not None:
                handler(msg)

    def _register(self, msg: m.RegisterMsg) -> None:
        if msg.engine_index in self.registered:
            log.warning("engine_registered_twice", engine=msg.engine_index)
            return
        self.registered[msg.engine_index] = msg
        log.info("engine_registered", engine=msg.engine_index, pid=msg.pid,
                 num_blocks=msg.info.num_blocks)
        self._changed.set()

    async def _watch_connections(self) -> None:
        """Fail the engine whose connection closed (its process died or its node left)."""
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            index = self._fds.pop(int(event["value"]), None)
            if index is not None:
                self.lose(index, "its connection closed (its process exited or its node left)")

    async def _watch(self) -> None:
        """Fail an engine whose heartbeats stopped (a stopped or hung node)."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for index in set(self.registered) - self.released:
                silent = now - self._last_seen.get(index, now)
                if index not in self.lost and silent > self._timeout:
                    self.lose(index, f"no heartbeat for {silent:.0f} s")

    async def wait_for_engines(self, size: int) -> dict[int, m.RegisterMsg]:
        """Until ranks ``0..size-1`` have all registered, logging who is awaited.

        Raises:
            ValueError: an engine failed to start or was lost before all registered.
        """
        logged: set[int] | None = None
        while True:
            missing = set(range(size)) - set(self.registered)
            failed = {**self.start_failures, **self.lost}
            if failed:
                index, reason = min(failed.items())
                raise ValueError(f"data-parallel engine {index} failed to start: {reason}")
            if not missing:
                log.info("all_engines_registered", data_parallel_size=size, address=self.address)
                return {i: self.registered[i] for i in range(size)}
            if missing != logged:
                log.info("waiting_for_engines", missing_ranks=sorted(missing),
                         address=self.address,
                         hint="start the other nodes with --headless --data-parallel-start-rank")
                logged = missing
            self._changed.clear()
            await self._changed.wait()

    def release(self, index: int) -> None:
        """Engine ``index``'s client has shut down; the socket closes after the last one."""
        self.released.add(index)
        self.on_message.pop(index, None)
        self.on_lost.pop(index, None)
        if not self.on_message:
            self.close()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close(linger=1000)  # a last ShutdownMsg to a live peer still leaves
        self.ctx.term()
