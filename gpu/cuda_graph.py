"""CUDA graphs for decode steps, over a persistent decode batch (CUDA only), on every rank.

A decode step of a small model is a few hundred tiny kernel launches; replaying them as one
captured graph removes the launch overhead (vLLM's ``CUDAGraphRunner``, simplified). A graph
replays fixed addresses and a fixed grid, so:

- each captured batch size has its own graph, and a step of ``n`` decodes runs the smallest
  captured size ``>= n``, its extra rows padded (slot ``-1``: nothing written; length 1);
- the step's inputs live in persistent device tensors (``DecodeBatch``) that the graph reads;
  a step copies into them only what changed: the per-row token, position, slot and length (one
  small copy), and a block-table row only when that row's block ids changed;
- the attention kernels never read host-side maxima (``AttentionMetadata.max_seq_len`` is
  ``None``): the Triton decode kernel's split-KV factor depends on the batch size alone.

Under tensor and pipeline parallelism every worker rank captures its own graphs of its share
(``LlamaForCausalLM.stage_forward``), as vLLM does:

- tensor parallel: the stage's collectives (the all-reduces of ``o_proj``, ``down_proj`` and
  the vocab-parallel embedding, the logits' all-gather; ``gpu/parallel/comm.py``) are NCCL
  kernels inside the graph. A captured collective must be replayed by every rank of its group
  at the same step: every rank gets the same ``SchedulerOutput`` and decides ``can_run`` from it
  alone, and they all capture the same sizes in the same order (``load`` runs on all at once);
- pipeline parallel: the send and receive between stages stay outside the graph. A non-first
  stage's graph reads a persistent ``[2, b, hidden]`` buffer (``StageBuffers``) that the eager
  ``recv`` fills before ``replay``; a non-last stage's graph ends in a persistent ``[2, b,
  hidden]`` output that is sent after it. Point-to-point NCCL calls are the case NCCL's own
  guide singles out for capture (a pair connects on its first exchange), and kept eager they
  need no agreement beyond the padded size, which both stages compute from the same batch.

Prefill and mixed steps run eagerly. Only the Triton backend is captured (the torch backend
syncs with the host). ``--enforce-eager`` turns all of this off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
import torch

from pagedserve.gpu.attention import AttentionMetadata
from pagedserve.gpu.batch import BatchLayout, ScheduledRequest
from pagedserve.gpu.parallel.layout import RankLayout
from pagedserve.gpu.step_inputs import StepInputs

if TYPE_CHECKING:
    from pagedserve.gpu.models.llama import LlamaForCausalLM
    from pagedserve.gpu.parallel.comm import ParallelContext

log = structlog.get_logger(__name__)

# vLLM's default capture sizes, up to 256 sequences.
CAPTURE_SIZES = [1, 2, 4, *range(8, 257, 8)]


class DecodeBatch:
    """Persistent device tensors of a decode step, for batches up to ``max_batch``."""

    def __init__(self, max_batch: int, max_blocks_per_seq: int, device: torch.device):
        # Rows: input_ids, positions, slot_mapping, seq_lens (int64, one copy per step).
        self.step = torch.zeros(4, max_batch, dtype=torch.int64, device=device)
        self.step[2].fill_(-1)
        self.step[3].fill_(1)
        self.block_table = torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32,
                                       device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(max_batch, dtype=torch.int64, device=device)
        self._rows: list[list[int] | None] = [None] * max_batch  # block ids held by each row

    def inputs(self, b: int) -> StepInputs:
        """Views of the first ``b`` rows: a step of ``b`` decodes, every one sampled."""
        attn = AttentionMetadata(
            slot_mapping=self.step[2, :b], query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.step[3, :b], block_table=self.block_table[:b],
            layout=BatchLayout(num_decodes=b),
        )
        return StepInputs(self.step[0, :b], self.step[1, :b], attn, self.logits_indices[:b])

    def update(self, reqs: list[ScheduledRequest], padded: int, block_size: int) -> None:
        """Copy this step's decodes into the first rows; the rows up to ``padded`` pad."""
        host = torch.empty(4, padded, dtype=torch.int64)
        rows = []
        for r in reqs:
            pos = r.num_computed_tokens
            slot = r.block_ids[pos // block_size] * block_size + pos % block_size
            rows.append((r.token_ids[0], pos, slot, pos + 1))
        host[:, : len(reqs)] = torch.tensor(rows, dtype=torch.int64).T
        host[:, len(reqs):] = torch.tensor([[0], [0], [-1], [1]])  # padding: read, never written
        self.step[:, :padded].copy_(host, non_blocking=True)
        for i, r in enumerate(reqs):
            if self._rows[i] != r.block_ids:
                ids = torch.tensor(r.block_ids, dtype=torch.int32)
                self.block_table[i, : len(ids)].copy_(ids, non_blocking=True)
                self._rows[i] = list(r.block_ids)

    def invalidate(self) -> None:
        """Forget which block ids the rows hold (after an eager step: a preempted request may
        come back with other blocks)."""
        self._rows = [None] * len(self._rows)


@dataclass(slots=True)
class StageBuffers:
    """What a rank's decode graphs exchange with the neighbouring pipeline stages.

    ``receives``: a non-first stage's graphs read ``received(b)``, filled by an eager receive
    before each replay; ``sends``: a non-last stage's graphs end in the ``[2, b, hidden]`` it
    sends after the replay. One flat buffer for all sizes: ``received(b)`` is its first
    ``2 b hidden`` elements, contiguous (as ``recv`` wants), at a fixed address per ``b``.
    """

    receives: bool
    sends: bool
    flat: torch.Tensor | None  # [2 * max_batch * hidden] when ``receives``
    hidden_size: int

    @classmethod
    def of(cls, layout: RankLayout | None, max_batch: int, hidden_size: int,
           dtype: torch.dtype, device: torch.device) -> StageBuffers:
        """Without parallelism (``layout`` ``None``) a rank neither receives nor sends."""
        receives = layout is not None and not layout.is_first_stage
        sends = layout is not None and not layout.is_last_stage
        flat = (torch.zeros(2 * max_batch * hidden_size, dtype=dtype, device=device)
                if receives else None)  # zeros: the warm-up reads them (finite, unwritten)
        return cls(receives, sends, flat, hidden_size)

    def received(self, b: int) -> torch.Tensor | None:
        """``[2, b, hidden]`` (hidden, residual) for a batch of ``b``, or ``None``."""
        if self.flat is None:
            return None
        return self.flat[: 2 * b * self.hidden_size].view(2, b, self.hidden_size)


class CudaGraphRunner:
    """One captured decode graph per batch size; ``run`` replays the right one (with the
    stage's receive before it and its send after it under pipeline parallelism)."""

    def __init__(self, model: LlamaForCausalLM, kv_caches, max_num_seqs: int,
                 max_blocks_per_seq: int, block_size: int, device: torch.device):
        self.block_size = block_size
        self.parallel: ParallelContext | None = model.parallel
        self.sizes = [s for s in CAPTURE_SIZES if s <= max_num_seqs] or [1]
        self.batch = DecodeBatch(self.sizes[-1], max_blocks_per_seq, device)
        layout = None if self.parallel is None else self.parallel.layout
        self.stage = StageBuffers.of(layout, self.sizes[-1], model.config.hidden_size,
                                     model.hidden_dtype, device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor | None]] = {}
        # Under parallelism, "thread_local" (NCCL's guide allows it; nccl-tests captures so):
        # the process group's watchdog thread may query the events of collectives run before
        # the capture (the warm-up's), which "global" would count against the capture (torch
        # PRs 104487 and 105182). The capturing thread is still checked as before.
        mode = "global" if self.parallel is None else "thread_local"
        pool = None
        with torch.inference_mode():
            # Largest first: the others fit in its memory pool. Every rank of a group runs
            # this same sequence of warm-ups and captures, so their collectives pair up.
            for b in reversed(self.sizes):
                inputs, received = self.batch.inputs(b), self.stage.received(b)
                model.stage_forward(inputs, kv_caches, received)  # compile, warm up
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode=mode):
                    out = model.stage_forward(inputs, kv_caches, received)
                pool = graph.pool()
                self.graphs[b] = (graph, out)
        log.info("cuda_graphs_captured", batch_sizes=len(self.sizes), largest=self.sizes[-1],
                 rank=None if layout is None else layout.rank)

    def can_run(self, reqs: list[ScheduledRequest]) -> bool:
        """A step of decodes, each sampled, no larger than the largest graph. A function of the
        step alone: every rank, given the same step, decides alike (so replays, and the
        collectives inside them, pair up across ranks)."""
        return len(reqs) <= self.sizes[-1] and all(r.is_decode and r.sample for r in reqs)

    def run(self, reqs: list[ScheduledRequest]) -> torch.Tensor | None:
        """Logits ``[len(reqs), vocab]`` of a decode-only step (every request is sampled), or
        ``None`` on a rank that does not sample (a non-last stage's, after sending on)."""
        padded = next(s for s in self.sizes if s >= len(reqs))
        self.batch.update(reqs, padded, self.block_size)
        graph, out = self.graphs[padded]
        if self.stage.receives:  # all ``padded`` rows: the previous stage replayed ``padded``
            self.parallel.recv_packed(self.stage.received(padded))
        graph.replay()
        if self.stage.sends:
            self.parallel.send_packed(out)
            return None
        return None if out is None else out[: len(reqs)]
