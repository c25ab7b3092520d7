"""The tensor-parallel all-reduce of one CPU machine's ranks, through shared memory.

Why: gloo's all-reduce goes through its TCP transport and I/O threads. Between two CPU ranks
of one machine, a ``[32, 576]`` float32 all-reduce cost 440-480 µs alone and 0.9-1.4 ms inside
a loaded tp=2 step, 25 of them a step (``loadtest/bench_parallel.py``): a third of the step.
Here each rank copies its partial sum into its own slot of a shared region, raises its flag,
waits for the others' flags, and adds the slots, in rank order, into its tensor: every rank
gets the same bits, and the cost is two passes over the tensor. vLLM's CPU communicator does
the same with its shared-memory ops (``vllm/distributed/device_communicators/
cpu_communicator.py``; read to learn only).

Layout of the region (a ``/dev/shm`` file the group's first rank creates, unlinked once all
have mapped it): per rank, one 64-byte header line (``[epoch, pid]``, int64; a line each, so
two ranks never write one cache line), then two buffer sets (even and odd epochs), each one
``MAX_BYTES`` slot per rank. A rank reuses a set two calls later, by which time every peer has
raised its flag for the call between, which it does only after it finished reading that set:
no second barrier is needed.

Ordering: a flag is stored after the slot's bytes, and x86's total store order shows them to
the other cores in that order; elsewhere ``available`` says no and gloo serves. A peer that
exits while another waits for it is noticed (its pid is gone, or a zombie): ``PeerGone``.
"""

from __future__ import annotations

import mmap
import os
import platform
import socket
import uuid
from pathlib import Path

import structlog
import torch
import torch.distributed as dist

log = structlog.get_logger(__name__)

# Per rank and buffer set: a decode's hidden states and a step's sampled logits; a long
# prefill chunk's larger all-reduces go to gloo. tp=4 maps 32 MiB of /dev/shm (Docker gives
# 64 MiB unless --shm-size or --ipc=host), reserved at creation.
MAX_BYTES = 4 << 20
_LINE = 64  # bytes per rank's header line
_SPIN = 256  # flag reads before each sched_yield (a peer usually arrives within µs)
_CHECK_EVERY = 20000  # waiting turns between two looks at a peer's pid


class PeerGone(RuntimeError):
    """A tensor-parallel peer exited while this rank waited for its partial sum."""


def available() -> bool:
    """Whether this machine's memory ordering lets a flag follow the data (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64") and Path("/dev/shm").is_dir()


class ShmAllReduce:
    """Args: the region's path, this rank's index in the group, the group's size."""

    def __init__(self, path: str, index: int, world: int):
        self.index = index
        self.world = world
        self.epoch = 0
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), _region_bytes(world))
        self._flags = memoryview(self._map)[: world * _LINE].cast("q")
        self._data = torch.frombuffer(self._map, dtype=torch.uint8, offset=world * _LINE,
                                      count=2 * world * MAX_BYTES)
        self._flags[index * _LINE // 8 + 1] = os.getpid()
        self._pids: dict[int, int] = {}

    @classmethod
    def create_for_group(cls, group: dist.ProcessGroup, ranks: list[int]) -> ShmAllReduce | None:
        """Collective over ``group`` (every rank calls it): the region when all its ranks run
        on this machine and ``available()``, else ``None`` on every rank (gloo serves)."""
        me = dist.get_rank()
        index = ranks.index(me)
        key = (socket.gethostname(), _boot_id(), available())
        keys: list = [None] * len(ranks)
        dist.all_gather_object(keys, key, group=group)
        if not all(k == keys[0] for k in keys) or not keys[0][2]:
            log.info("tp_all_reduce", transport="gloo", reason="ranks on several machines"
                     if keys[0][2] else "not x86-64")
            return None
        name: list[str | None] = [None]
        if index == 0:
            name[0] = _create_region(len(ranks))
        dist.broadcast_object_list(name, src=ranks[0], group=group)
        if name[0] is None:  # no room in /dev/shm: every rank stays on gloo
            return None
        try:
            comm = cls(name[0], index, len(ranks))
        finally:
            dist.barrier(group=group)  # all have mapped it (or failed): the name can go
            if index == 0:
                os.unlink(name[0])
        log.info("tp_all_reduce", transport="shared memory", ranks=len(ranks))
        return comm

    def all_reduce(self, x: torch.Tensor) -> bool:
        """Sum ``x`` over the group, in place, in rank order (the same bits on every rank).
        ``False`` (nothing done) when ``x`` is larger than a slot or not contiguous: the
        caller uses gloo; every rank decides alike (their tensors have the same shape).

        Raises:
            PeerGone: a peer exited while this rank waited for it.
        """
        slots = self._exchange(x)
        if slots is None:
            return False
        flat = x.view(-1)
        torch.add(slots[0], slots[1], out=flat)
        for slot in slots[2:]:
            flat.add_(slot)
        return True

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None | bool:
        """Every rank's ``x`` (same shape and dtype on all), in rank order, on the group's
        first rank (views of the region: valid until the group's next-but-one call, so copy
        them out at once); ``None`` on the others; ``False`` (nothing done) when ``x`` is
        larger than a slot or not contiguous, as ``all_reduce``.

        Raises:
            PeerGone: a peer exited while this rank waited for it.
        """
        slots = self._exchange(x)
        if slots is None:
            return False
        if self.index != 0:
            return None
        return [slot.view(x.shape) for slot in slots]

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Publish ``x`` in this rank's slot of the next buffer set, raise the flag, wait for
        every peer's: every rank's ``x``, flat, in rank order (views of the set). Every rank
        waits for every flag, for a gather too, so a set is never rewritten before all have
        read it. ``None`` (nothing done) for a tensor too large for a slot or not contiguous."""
        nbytes = x.numel() * x.element_size()
        if nbytes > MAX_BYTES or not x.is_contiguous():
            return None
        self.epoch += 1
        base = (self.epoch & 1) * self.world * MAX_BYTES
        self._slot(base, self.index, nbytes, x.dtype).copy_(x.view(-1))
        self._flags[self.index * _LINE // 8] = self.epoch  # after the bytes (x86 TSO)
        for peer in range(self.world):
            if peer != self.index:
                self._wait(peer)
        return [self._slot(base, r, nbytes, x.dtype) for r in range(self.world)]

    def _slot(self, base: int, rank: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        start = base + rank * MAX_BYTES
        return self._data[start:start + nbytes].view(dtype)

    def _wait(self, peer: int) -> None:
        flag = peer * _LINE // 8
        turns = 0
        while self._flags[flag] < self.epoch:
            turns += 1
            if turns % _SPIN == 0:
                os.sched_yield()  # two cores, three busy processes: let the others run
            if turns % _CHECK_EVERY == 0:
                self._check_alive(peer)

    def _check_alive(self, peer: int) -> None:
        pid = int(self._flags[peer * _LINE // 8 + 1])
        if process_exited(pid):
            raise PeerGone(f"tensor-parallel rank {peer} (pid {pid}) exited during an "
                           "all-reduce")


def process_exited(pid: int | None) -> bool:
    """Whether the process has ended, a zombie not yet reaped included: its ``/proc`` state.
    Its parent's ``is_alive()`` and sentinel were seen to lag it; every rank reads it alike."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def _create_region(world: int) -> str | None:
    """A fresh region's path, its pages reserved (a full ``/dev/shm`` would otherwise show up
    as SIGBUS on a later write); ``None`` when there is no room."""
    path = f"/dev/shm/pagedserve-tp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    size = _region_bytes(world)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        os.unlink(path)
        log.warning("tp_all_reduce", transport="gloo", reason=f"/dev/shm: {e}", bytes=size)
        return None
    finally:
        os.close(fd)
    return path


def _region_bytes(world: int) -> int:
    """The header lines, then two buffer sets of one slot per rank."""
    return world * _LINE + 2 * world * MAX_BYTES


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
