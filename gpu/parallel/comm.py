"""The collectives between ranks, on ``torch.distributed`` (gloo on the CPU, NCCL on CUDA), and
on the CPU the all-reduce and logits gather of one machine's ranks through shared memory
(``gpu/parallel/shm_all_reduce.py``: tens of µs a call where gloo takes about a millisecond).

One world of ``tp × pp`` worker processes; each stage's tensor-parallel ranks also form a
group of their own. The model calls three things per step (vLLM's
``vllm/distributed/communication_op.py`` and ``parallel_state.py`` hold the same):

- ``all_reduce``: the partial sums of a row-parallel layer (``o_proj``, ``down_proj``) and of
  the vocab-parallel embedding, summed over the stage's tensor-parallel ranks;
- ``gather_logits``: each rank's vocabulary columns, concatenated on the stage's first rank
  (the one that samples) and ``None`` elsewhere;
- ``send``/``recv``: hidden states and residuals ``[T, hidden]`` from one stage to the next,
  rank ``t`` of stage ``s`` to rank ``t`` of stage ``s + 1`` (after the all-reduce every
  tensor-parallel rank holds the same values, so each feeds its counterpart), packed as one
  ``[2, T, hidden]`` tensor.

On CUDA the all-reduce and the logits' all-gather run inside a decode step's captured graph
(``gpu/cuda_graph.py``); send/recv never do (the graph runner calls them around ``replay``).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedserve.gpu.parallel.layout import RankLayout
from pagedserve.gpu.parallel.shm_all_reduce import ShmAllReduce

# One tensor per rank into one output tensor: torch 2.13's name, else the older one (the same
# call; torch 2.13 deprecates the older name).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# "gloo" keeps the CPU all-reduce on gloo (the shared-memory one's A/B, and its way out).
TP_ALL_REDUCE_ENV = "PAGEDSERVE_TP_ALL_REDUCE"

# A worker waits for its peers at start-up and inside collectives; idle time between steps is
# spent in the executor's pipe, never in a collective, so this bounds only a hung peer.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def free_port(host: str = "127.0.0.1") -> int:
    """A free TCP port for the process group's rendezvous."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def vocab_columns(gathered: torch.Tensor, num_rows: int, vocab_size: int) -> torch.Tensor:
    """An all-gather's ``[tp * N, V/tp]`` (rank ``r``'s rows at ``r * N``) → the logits
    ``[N, vocab_size]``: rank ``r``'s columns at ``r * V/tp``, the padding columns dropped."""
    per_rank = gathered.shape[1]
    # [tp, N, V/tp] → [N, tp, V/tp] → [N, tp * V/tp]
    parts = gathered.view(-1, num_rows, per_rank).transpose(0, 1)
    return parts.reshape(num_rows, -1)[:, :vocab_size]


@dataclass(slots=True)
class ParallelContext:
    """This rank's layout and its process groups. Build with ``ParallelContext.init``."""

    layout: RankLayout
    tp_group: dist.ProcessGroup | None
    tp_ranks: list[int]
    device: torch.device
    shm: ShmAllReduce | None = None  # the CPU all-reduce of one machine's ranks

    @classmethod
    def init(cls, layout: RankLayout, init_method: str, device: torch.device) -> ParallelContext:
        """Join the world (every rank calls this with the same ``init_method``), then create
        every stage's tensor-parallel group (all ranks create all groups, in the same order, as
        ``torch.distributed.new_group`` requires)."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=layout.rank,
                                world_size=layout.world_size, timeout=COLLECTIVE_TIMEOUT)
        tp, mine, my_ranks = layout.tp_size, None, []
        for stage in range(layout.pp_size):
            ranks = list(range(stage * tp, (stage + 1) * tp))
            group = dist.new_group(ranks, timeout=COLLECTIVE_TIMEOUT) if tp > 1 else None
            if stage == layout.pp_rank:
                mine, my_ranks = group, ranks
        shm = None
        if (device.type == "cpu" and mine is not None
                and os.environ.get(TP_ALL_REDUCE_ENV, "shm") != "gloo"):
            shm = ShmAllReduce.create_for_group(mine, my_ranks)
        return cls(layout, mine, my_ranks, device, shm)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the stage's tensor-parallel ranks, in place; returns it."""
        if self.tp_group is not None and (self.shm is None or not self.shm.all_reduce(x)):
            dist.all_reduce(x, group=self.tp_group)
        return x

    def gather_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """``[N, V/tp]`` per rank → ``[N, vocab_size]`` on the stage's first rank (padding
        columns dropped), ``None`` on the others."""
        if self.tp_group is None:
            return logits[:, :vocab_size]
        if self.device.type == "cuda":
            return self._all_gather_logits(logits, vocab_size)
        if self.shm is not None:
            parts = self.shm.gather(logits.contiguous())
            if parts is not False:
                return None if parts is None else torch.cat(parts, dim=-1)[:, :vocab_size]
        first = self.tp_ranks[0]
        parts = ([torch.empty_like(logits) for _ in self.tp_ranks]
                 if self.layout.tp_rank == 0 else None)
        dist.gather(logits.contiguous(), parts, dst=first, group=self.tp_group)
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    def _all_gather_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """On CUDA: every rank's ``[N, V/tp]`` into one ``[tp * N, V/tp]`` on every rank (one
        collective of fixed shapes, captured in a decode graph like the all-reduces), put in
        order on the first rank. Not ``dist.gather``: NCCL has no gather, and
        ProcessGroupNCCL builds one from grouped point-to-point sends and receives, whose
        capture NCCL's guide ("Using NCCL with CUDA Graphs") names as a special case (a
        pair's first exchange connects lazily, which a capture may not do)."""
        n, per_rank = logits.shape
        out = torch.empty((len(self.tp_ranks) * n, per_rank), dtype=logits.dtype,
                          device=logits.device)
        _all_gather_single(out, logits.contiguous(), group=self.tp_group)
        return None if self.layout.tp_rank != 0 else vocab_columns(out, n, vocab_size)

    def send_packed(self, packed: torch.Tensor) -> None:
        """``[2, T, hidden]`` (hidden, residual) to the same tensor-parallel rank of the next
        stage."""
        dist.send(packed.contiguous(), self.layout.rank + self.layout.tp_size)

    def recv_packed(self, buf: torch.Tensor) -> torch.Tensor:
        """Into ``buf`` ``[2, T, hidden]`` (contiguous; a CUDA graph's persistent input), from
        the same tensor-parallel rank of the previous stage; returns it."""
        dist.recv(buf, self.layout.rank - self.layout.tp_size)
        return buf

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
