"""A step's batch as device tensors: the flattened "super sequence" the model reads.

After vLLM V1's ``gpu_model_runner._prepare_inputs``: every scheduled token of every request,
concatenated in batch order (``gpu.batch.Segment``: decodes, decodes with drafts, prefill
chunks), with where each token's K/V goes and which rows are sampled. Nothing is padded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.gpu.attention import AttentionMetadata
from pagedserve.gpu.batch import BatchLayout, ScheduledRequest
from pagedserve.gpu.sample import prompt_logprobs


@dataclass(slots=True)
class StepInputs:
    """What one forward pass reads.

    Attributes:
        input_ids: ``[T]`` int64 token ids, requests in batch order.
        positions: ``[T]`` int64 position of each token in its sequence.
        attn: the attention metadata (slots, block tables, lengths, the ``BatchLayout``).
        logits_indices: ``[S]`` int64 rows of ``input_ids`` whose logits are sampled: each
            sampling request's last token, and with drafts each draft's too; then, for prefill
            chunks that want prompt logprobs, their prompt rows (``gpu/sample/prompt_logprobs.py``).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    logits_indices: torch.Tensor

    @property
    def layout(self) -> BatchLayout:
        return self.attn.layout


def prepare_inputs(reqs: list[ScheduledRequest], block_size: int,
                   device: torch.device) -> StepInputs:
    """Flatten ``reqs`` (in batch order: ``gpu.batch.order_batch``) into device tensors.

    Raises ``ValueError`` if they are not in batch order (``BatchLayout.of``).
    """
    layout = BatchLayout.of(reqs)
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    qsl = [0]
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    prompt_rows: list[int] = []  # after the sampled rows, so those keep their places
    for r in reqs:
        n, start = r.num_step_tokens, r.num_computed_tokens
        input_ids.extend(r.token_ids)
        input_ids.extend(r.spec_token_ids)
        pos = range(start, start + n)
        positions.extend(pos)
        slots.extend(r.block_ids[p // block_size] * block_size + p % block_size for p in pos)
        qsl.append(qsl[-1] + n)
        seq_lens.append(start + n)
        if r.sample:  # with drafts: the last token's row and each draft's
            logits_indices.extend(range(qsl[-1] - 1 - len(r.spec_token_ids), qsl[-1]))
        if r.prompt_logprobs is not None:
            prompt_rows.extend(prompt_logprobs.row_indices(r, qsl[-2]))
    logits_indices.extend(prompt_rows)
    max_blocks = max(len(r.block_ids) for r in reqs)
    table = [r.block_ids + [0] * (max_blocks - len(r.block_ids)) for r in reqs]
    attn = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=torch.tensor(table, dtype=torch.int32, device=device),
        layout=layout,
        max_query_len=max(r.num_step_tokens for r in reqs),
        max_seq_len=max(seq_lens),
    )
    return StepInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        attn=attn,
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
    )
