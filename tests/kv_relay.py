"""A TCP hop between a KV consumer and its producer that corrupts, cuts or stalls the
producer's bytes at a chosen offset: a real network fault, at a point that does not depend on
the machine's speed (for ``TCPConnector``'s tests)."""

from __future__ import annotations

import socket
import threading


class Relay:
    """A TCP hop between consumer and producer. Of the producer's bytes it forwards the first
    ``limit`` (then hangs up both sides, as a dead producer does, or with ``close=False`` falls
    silent), with the byte at ``flip_at`` inverted."""

    def __init__(self, upstream_port: int, limit: int | None = None, close: bool = True,
                 flip_at: int | None = None):
        self.upstream_port, self.limit, self.close_on_cut = upstream_port, limit, close
        self.flip_at = flip_at
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        self.cut = threading.Event()  # set when the limit is reached
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        down, _ = self.sock.accept()
        up = socket.create_connection(("127.0.0.1", self.upstream_port))
        self.held += [down, up]
        threading.Thread(target=self._pump, args=(down, up, False), daemon=True).start()
        self._pump(up, down, True)

    def _pump(self, src: socket.socket, dst: socket.socket, from_producer: bool) -> None:
        offset = 0
        while True:
            try:
                chunk = bytearray(src.recv(65536))
            except OSError:
                return
            if not chunk:
                break
            if from_producer and self.flip_at is not None and (
                    offset <= self.flip_at < offset + len(chunk)):
                chunk[self.flip_at - offset] ^= 0xFF
            if from_producer and self.limit is not None and offset + len(chunk) >= self.limit:
                dst.sendall(chunk[: self.limit - offset])
                self.cut.set()
                if not self.close_on_cut:
                    return  # silent: the sockets stay open
                break
            offset += len(chunk)
            dst.sendall(chunk)
        _hang_up(src, dst)

    def close(self) -> None:
        _hang_up(self.sock, *self.held)


def _hang_up(*socks: socket.socket) -> None:
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on it, sends the FIN
        except OSError:
            pass
        s.close()
