"""The vocab-parallel embedding (Megatron-LM's ``VocabParallelEmbedding``, as in vLLM's
``vllm/model_executor/layers/vocab_parallel_embedding.py``).

Each rank holds rows ``[start, start + V/tp)`` of the table (zero padding past the vocabulary);
a token outside its range looks up a zero row, and the all-reduce over the tensor-parallel
ranks leaves every rank with the full embedding of every token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.gpu.parallel.comm import ParallelContext


class VocabParallelEmbedding(nn.Module):
    """``weight`` ``[V/tp, hidden]``, named as ``nn.Embedding``'s so checkpoints load."""

    def __init__(self, rows: int, hidden: int, start: int, parallel: ParallelContext):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden))
        self.start, self.rows, self.parallel = start, rows, parallel

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` int64 token ids → ``[T, hidden]``, identical on every rank."""
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside[:, None], 0)
        return self.parallel.all_reduce(x)


class PPMissingLayer(nn.Identity):
    """Stands where a module lives on another pipeline stage, so the global layer indices (and
    the checkpoint names) stay as they are (vLLM's ``PPMissingLayer``)."""
