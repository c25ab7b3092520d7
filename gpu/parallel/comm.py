"""The collectives between ranks, on ``torch.distributed`` (gloo on the CPU, NCCL on CUDA).

One world of ``tp × pp`` worker processes; each stage's tensor-parallel ranks also form a
group of their own. The model calls three things per step (vLLM's
``vllm/distributed/communication_op.py`` and ``parallel_state.py`` hold the same):

- ``all_reduce``: the partial sums of a row-parallel layer (``o_proj``, ``down_proj``) and of
  the vocab-parallel embedding, summed over the stage's tensor-parallel ranks;
- ``gather_logits``: each rank's vocabulary columns, concatenated on the stage's first rank
  (the one that samples) and ``None`` elsewhere;
- ``send``/``recv``: hidden states and residuals ``[T, hidden]`` from one stage to the next,
  rank ``t`` of stage ``s`` to rank ``t`` of stage ``s + 1`` (after the all-reduce every
  tensor-parallel rank holds the same values, so each feeds its counterpart).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedserve.gpu.parallel.layout import RankLayout

# A worker waits for its peers at start-up and inside collectives; idle time between steps is
# spent in the executor's pipe, never in a collective, so this bounds only a hung peer.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def free_port(host: str = "127.0.0.1") -> int:
    """A free TCP port for the process group's rendezvous."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(slots=True)
class ParallelContext:
    """This rank's layout and its process groups. Build with ``ParallelContext.init``."""

    layout: RankLayout
    tp_group: dist.ProcessGroup | None
    tp_ranks: list[int]
    device: torch.device

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
        return cls(layout, mine, my_ranks, device)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the stage's tensor-parallel ranks, in place; returns it."""
        if self.tp_group is not None:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def gather_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """``[N, V/tp]`` per rank → ``[N, vocab_size]`` on the stage's first rank (padding
        columns dropped), ``None`` on the others."""
        if self.tp_group is None:
            return logits[:, :vocab_size]
        first = self.tp_ranks[0]
        parts = ([torch.empty_like(logits) for _ in self.tp_ranks]
                 if self.layout.tp_rank == 0 else None)
        dist.gather(logits.contiguous(), parts, dst=first, group=self.tp_group)
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    def send_next(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """To the same tensor-parallel rank of the next stage."""
        dst = self.layout.rank + self.layout.tp_size
        dist.send(torch.stack((hidden, residual)).contiguous(), dst)

    def recv_prev(self, num_tokens: int, hidden_size: int,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """From the same tensor-parallel rank of the previous stage: ``(hidden, residual)``,
        each ``[num_tokens, hidden_size]``."""
        buf = torch.empty((2, num_tokens, hidden_size), dtype=dtype, device=self.device)
        dist.recv(buf, self.layout.rank - self.layout.tp_size)
        return buf[0], buf[1]

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
