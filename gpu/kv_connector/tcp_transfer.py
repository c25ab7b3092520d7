"""The TCP wire of ``TCPConnector`` (``tcp_connector.py``): a producer rank's block server and a
consumer rank's pull, over plain sockets with a timeout on every read and write.

One pull is one connection (consumer → producer rank at ``remote_port + rank``)::

    consumer: frame {"op": "pull", "request_id", "block_ids", "rank"}
    producer: frame {"ok": true, "num_layers", "block_shape", "dtype"}   (or ok false + error)
    producer: per layer, K then V: the asked blocks' bytes, [n, block_size, kv_heads, head_size]
    producer: n × 8 bytes: xxh3-64 of each block (its K and V bytes in every layer, in order)
    consumer: frame {"op": "done", "request_id", "ok"}  → the producer's ``finished_sending``

A frame is a 4-byte big-endian length and that much UTF-8 JSON. ``release`` (a frame alone)
says "done" for a request whose blocks the consumer did not need (all of them were its own
prefix-cache hits). The consumer writes each layer into its blocks as it arrives (no staging of
the whole prompt) and checks the checksums at the end: a mismatch, a short read, a refused
connection or a timeout is a failed load, never a wrong answer (the blocks are recomputed or
the request fails, as ``kv_load_failure_policy`` says).
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch
import xxhash

log = structlog.get_logger(__name__)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
_LEN = struct.Struct(">I")
_MAX_FRAME = 1 << 24
_REMEMBER_GONE = 4096  # ended offers remembered, so a late pull is refused without waiting


class TransferError(Exception):
    """A pull that did not bring every block intact; the message says why."""


def send_frame(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` (``socket.timeout`` after the socket's timeout of silence)."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise TransferError(f"connection closed after {got} of {len(view)} bytes")
        got += n


def recv_frame(sock: socket.socket) -> dict:
    head = bytearray(_LEN.size)
    recv_exact(sock, memoryview(head))
    (size,) = _LEN.unpack(head)
    if size > _MAX_FRAME:
        raise TransferError(f"frame of {size} bytes: not this protocol")
    body = bytearray(size)
    recv_exact(sock, memoryview(body))
    return json.loads(body)


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy (any dtype: viewed as uint8 first)."""
    return memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())


def block_layout(kv_caches: KVCaches) -> tuple[list[int], str]:
    """``([block_size, kv_heads, head_size], dtype)`` of one block of one layer's K (or V)."""
    key = kv_caches[0][0]
    return list(key.shape[1:]), str(key.dtype).removeprefix("torch.")


@dataclass(slots=True)
class _Servable:
    block_ids: list[int]
    lock: threading.Lock  # held while a pull reads the blocks; ``withdraw`` waits for it


class BlockServer:
    """A producer rank's server thread: serves the blocks of the requests it was told to
    (``offer``), until the consumer says done (``on_done``) or the offer is withdrawn.

    Reads happen on connection threads while the model runner writes other blocks: the offered
    blocks are held by the scheduler (never written, never reused) until ``withdraw`` returns.
    """

    def __init__(self, kv_caches: KVCaches, host: str, port: int, timeout_s: float,
                 on_done: Callable[[str], None]):
        self.kv_caches = kv_caches
        self.timeout_s = timeout_s
        self.on_done = on_done
        self._offers: dict[str, _Servable] = {}
        # Ended offers, remembered: True when the consumer confirmed every block, else False.
        self._outcomes: OrderedDict[str, bool] = OrderedDict()
        self._changed = threading.Condition()
        self._sock = socket.create_server((host, port), reuse_port=False, backlog=128)
        self.address = self._sock.getsockname()[:2]
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="kv-tcp-server",
                                        daemon=True)
        self._thread.start()

    def offer(self, request_id: str, block_ids: list[int]) -> None:
        with self._changed:
            self._offers[request_id] = _Servable(list(block_ids), threading.Lock())
            self._changed.notify_all()

    def withdraw(self, request_id: str) -> None:
        """Stop serving ``request_id`` (its hold timed out); returns once no pull reads it."""
        with self._changed:
            servable = self._offers.pop(request_id, None)
            self._remember(request_id, False)
        if servable is not None:
            with servable.lock:
                pass

    def _remember(self, request_id: str, ok: bool) -> None:
        self._outcomes[request_id] = ok
        while len(self._outcomes) > _REMEMBER_GONE:
            self._outcomes.popitem(last=False)

    def state(self, request_id: str) -> str:
        """``done`` (the consumer confirmed), ``failed`` (withdrawn, or a broken pull),
        ``pending`` (offered, not yet pulled) or ``unknown`` (not offered yet)."""
        with self._changed:
            if request_id in self._outcomes:
                return "done" if self._outcomes[request_id] else "failed"
            return "pending" if request_id in self._offers else "unknown"

    def _take(self, request_id: str) -> _Servable | None:
        """The offer, waiting up to the timeout for it: a consumer can ask before the step that
        tells this rank about the request has run."""
        with self._changed:
            self._changed.wait_for(lambda: request_id in self._offers or self._closed
                                   or request_id in self._outcomes, timeout=self.timeout_s)
            return self._offers.get(request_id)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            conn.settimeout(self.timeout_s)
            threading.Thread(target=self._serve, args=(conn,), name="kv-tcp-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            msg: dict = {}
            try:
                msg = recv_frame(conn)
                rid = str(msg["request_id"])
                if msg["op"] == "release":
                    self._finish(rid, True)
                elif msg["op"] == "status":
                    send_frame(conn, {"state": self.state(rid)})
                elif msg["op"] == "pull":
                    self._serve_pull(conn, rid, [int(b) for b in msg["block_ids"]])
            except (OSError, TransferError, KeyError, ValueError) as e:
                log.warning("kv_serve_failed", error=f"{type(e).__name__}: {e}")
                if msg.get("op") == "pull":  # broken mid-way: no done will come
                    self._finish(str(msg.get("request_id")), False)

    def _serve_pull(self, conn: socket.socket, rid: str, block_ids: list[int]) -> None:
        servable = self._take(rid)
        if servable is None or not set(block_ids) <= set(servable.block_ids):
            send_frame(conn, {"ok": False, "error": f"request {rid!r}: no such blocks held"})
            return
        shape, dtype = block_layout(self.kv_caches)
        with servable.lock:
            send_frame(conn, {"ok": True, "num_layers": len(self.kv_caches),
                              "block_shape": shape, "dtype": dtype})
            index = torch.tensor(block_ids, dtype=torch.long)
            hashers = [xxhash.xxh3_64() for _ in block_ids]
            for key, value in self.kv_caches:  # layer by layer: memory of one layer's blocks
                for cache in (key, value):
                    data = _bytes_of(cache.index_select(0, index.to(cache.device)).cpu())
                    step = len(data) // len(block_ids)
                    for i, h in enumerate(hashers):
                        h.update(data[i * step:(i + 1) * step])
                    conn.sendall(data)
            conn.sendall(b"".join(h.digest() for h in hashers))
        done = recv_frame(conn)
        if done.get("op") == "done":
            self._finish(rid, bool(done.get("ok")))

    def _finish(self, rid: str, ok: bool) -> None:
        with self._changed:
            known = self._offers.pop(rid, None) is not None
            if known or rid not in self._outcomes:
                self._remember(rid, ok)
        if known:
            self.on_done(rid)

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=5)


def pull_blocks(kv_caches: KVCaches, host: str, port: int, request_id: str,
                remote_ids: list[int], local_ids: list[int], rank: int,
                timeout_s: float) -> None:
    """Pull ``remote_ids`` of the producer's request into this rank's ``local_ids``; raises
    ``TransferError`` (or ``OSError``: refused, reset, timed out) unless every block arrived
    with its checksum. Always tells the producer it is done when it can (it frees the blocks)."""
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        send_frame(sock, {"op": "pull", "request_id": request_id, "block_ids": remote_ids,
                          "rank": rank})
        bad = _receive_blocks(sock, kv_caches, local_ids)
        # The stream was whole (a broken one has no one left to tell): the producer may free.
        send_frame(sock, {"op": "done", "request_id": request_id, "ok": not bad})
    if bad:
        raise TransferError(f"checksum mismatch in {len(bad)} of {len(local_ids)} blocks "
                            f"(local ids {bad})")


def _receive_blocks(sock: socket.socket, kv_caches: KVCaches, local_ids: list[int]) -> list[int]:
    """Receive every layer into ``local_ids``; returns the local ids whose checksum failed."""
    head = recv_frame(sock)
    if not head.get("ok"):
        raise TransferError(f"producer refused: {head.get('error')}")
    shape, dtype = block_layout(kv_caches)
    if head["block_shape"] != shape or head["dtype"] != dtype or head["num_layers"] != len(
            kv_caches):
        raise TransferError(f"producer's blocks are {head['num_layers']} layers × "
                            f"{head['block_shape']} {head['dtype']}, ours {len(kv_caches)} × "
                            f"{shape} {dtype}: not the same model and dtype")
    n = len(local_ids)
    key0 = kv_caches[0][0]
    staged = torch.empty((n, *key0.shape[1:]), dtype=key0.dtype)  # one layer's K (or V)
    view = _bytes_of(staged)
    step = len(view) // n
    index = torch.tensor(local_ids, dtype=torch.long, device=key0.device)
    hashers = [xxhash.xxh3_64() for _ in local_ids]
    for key, value in kv_caches:
        for cache in (key, value):
            recv_exact(sock, view)
            for i, h in enumerate(hashers):
                h.update(view[i * step:(i + 1) * step])
            # As bytes: index_copy_ has no float8 kernel (--kv-cache-dtype fp8).
            cache.view(torch.uint8).index_copy_(0, index, staged.to(cache.device).view(torch.uint8))
    sums = bytearray(8 * n)
    recv_exact(sock, memoryview(sums))
    return [local_ids[i] for i, h in enumerate(hashers) if h.digest() != sums[8 * i:8 * i + 8]]


def peer_state(host: str, port: int, request_id: str, timeout_s: float) -> str:
    """A producer rank's ``BlockServer.state`` of ``request_id`` (``failed`` if unreachable)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            send_frame(sock, {"op": "status", "request_id": request_id})
            return str(recv_frame(sock).get("state"))
    except (OSError, TransferError, ValueError):
        return "failed"


def send_release(host: str, port: int, request_id: str, timeout_s: float) -> None:
    """Tell a producer rank its blocks for ``request_id`` are not needed."""
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        send_frame(sock, {"op": "release", "request_id": request_id})
