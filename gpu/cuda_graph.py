"""CUDA graphs for decode steps, over a persistent decode batch (CUDA only).

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

Prefill and mixed steps run eagerly. Only the Triton backend is captured (the torch backend
syncs with the host). ``--enforce-eager`` turns all of this off.
"""

from __future__ import annotations

import structlog
import torch

from pagedserve.gpu.attention import AttentionMetadata
from pagedserve.gpu.batch import BatchLayout, ScheduledRequest
from pagedserve.gpu.step_inputs import StepInputs

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


class CudaGraphRunner:
    """One captured decode graph per batch size; ``run`` replays the right one."""

    def __init__(self, model: torch.nn.Module, kv_caches, max_num_seqs: int,
                 max_blocks_per_seq: int, block_size: int, device: torch.device):
        self.block_size = block_size
        self.sizes = [s for s in CAPTURE_SIZES if s <= max_num_seqs] or [1]
        self.batch = DecodeBatch(self.sizes[-1], max_blocks_per_seq, device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = None
        with torch.inference_mode():
            for b in reversed(self.sizes):  # largest first: the others fit in its memory pool
                inputs = self.batch.inputs(b)
                model(inputs, kv_caches)  # compile, warm up
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = model(inputs, kv_caches)
                pool = graph.pool()
                self.graphs[b] = (graph, logits)
        log.info("cuda_graphs_captured", batch_sizes=len(self.sizes), largest=self.sizes[-1])

    def can_run(self, reqs: list[ScheduledRequest]) -> bool:
        """A step of decodes, each sampled, no larger than the largest graph."""
        return len(reqs) <= self.sizes[-1] and all(r.is_decode and r.sample for r in reqs)

    def run(self, reqs: list[ScheduledRequest]) -> torch.Tensor:
        """Logits ``[len(reqs), vocab]`` of a decode-only step (every request is sampled)."""
        padded = next(s for s in self.sizes if s >= len(reqs))
        self.batch.update(reqs, padded, self.block_size)
        graph, logits = self.graphs[padded]
        graph.replay()
        return logits[: len(reqs)]
