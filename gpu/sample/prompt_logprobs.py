"""Prompt logprobs: the log-probability of every prompt token given the tokens before it,
computed during prefill, chunk by chunk (vLLM V1's ``_get_prompt_logprobs_dict`` in
``vllm/v1/worker/gpu_model_runner.py``).

A prefill chunk of a request that asks computes its K/V at positions ``start .. start + n``;
the logits at position ``p`` predict the prompt token at ``p + 1``. So the chunk's rows give the
logprobs of the prompt tokens ``start + 1 .. min(start + n, P - 1)`` (``P`` prompt tokens; the
logits at ``P - 1`` predict the first output token, which the sampler picks). The last row's
target, the token right after the chunk, is not in the chunk: the scheduler passes it
(``PromptLogprobsWanted.next_token_id``).

Only requests that ask add rows: ``prepare_inputs`` appends their row indices after the
sampled rows of ``logits_indices`` (so the model's ``lm_head`` runs on them too), and
``split_logits`` takes them back off; a step without such a request is unchanged.

Values are ``log_softmax`` of the model's float32 logits, unprocessed (no temperature, bias or
penalties apply to a prompt), which is what transformers' forward pass gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedserve.gpu.sample.sampler import TokenLogprobs

if TYPE_CHECKING:
    from pagedserve.gpu.batch import ScheduledRequest

# Rows per log_softmax slice: caps the float32 scratch at _SLICE x vocab per step.
_SLICE = 256


@dataclass(slots=True)
class PromptLogprobsWanted:
    """Scheduler → runner, on a prefill chunk whose request wants prompt logprobs.

    Attributes:
        num_top: top alternatives per token (0: only the prompt token's own entry).
        next_token_id: the prompt token right after the chunk; ``None`` when the chunk
            reaches the end of the prompt.
    """

    num_top: int
    next_token_id: int | None


@dataclass(slots=True)
class PromptLogprobsChunk:
    """Runner → scheduler: one chunk's prompt logprobs.

    Attributes:
        start: prompt position of ``entries[0]``'s token (>= 1: the first token has none).
        entries: one per prompt token from ``start`` on, in order.
    """

    start: int
    entries: list[TokenLogprobs]


def targets(r: ScheduledRequest) -> list[int]:
    """The prompt tokens whose logprobs ``r``'s chunk rows give, in row order (empty when it
    asks for none or the chunk holds no prompt position before the last)."""
    want = r.prompt_logprobs
    if want is None:
        return []
    start = r.num_computed_tokens
    n = min(start + len(r.token_ids), r.num_prompt_tokens - 1) - start
    if n <= 0:
        return []
    out = list(r.token_ids[1 : n + 1])
    if len(out) < n:
        if want.next_token_id is None:
            raise ValueError(f"request {r.req_id!r}: a prompt-logprobs chunk that stops short "
                             "of the prompt's end needs next_token_id")
        out.append(want.next_token_id)
    return out


def row_indices(r: ScheduledRequest, first_row: int) -> list[int]:
    """Rows of the flattened batch (``r``'s tokens start at ``first_row``) to take logits of."""
    return list(range(first_row, first_row + len(targets(r))))


def split_logits(
    logits: torch.Tensor, reqs: list[ScheduledRequest], num_sample_rows: int,
) -> tuple[torch.Tensor, dict[str, PromptLogprobsChunk]]:
    """Split the model's logits ``[S + R, V]`` into the sampled rows ``[S, V]`` and the
    prompt logprobs of the ``R`` rows ``prepare_inputs`` appended (in batch order)."""
    chunks: dict[str, PromptLogprobsChunk] = {}
    row = num_sample_rows
    for r in reqs:
        ids = targets(r)
        if not ids:
            continue
        entries = _entries(logits[row : row + len(ids)], ids, r.prompt_logprobs.num_top)
        chunks[r.req_id] = PromptLogprobsChunk(r.num_computed_tokens + 1, entries)
        row += len(ids)
    return logits[:num_sample_rows], chunks


def _entries(logits: torch.Tensor, ids: list[int], k: int) -> list[TokenLogprobs]:
    """Per row of ``logits`` ``[R, V]`` (float32): the target token's logprob and 1-based rank,
    and the top ``k``; sliced so the ``log_softmax`` scratch stays small."""
    out: list[TokenLogprobs] = []
    target = torch.tensor(ids, dtype=torch.int64, device=logits.device)
    for lo in range(0, len(ids), _SLICE):
        lp = logits[lo : lo + _SLICE].float().log_softmax(dim=-1)
        t = target[lo : lo + _SLICE]
        value = lp.gather(1, t[:, None])  # [r, 1]
        rank = ((lp > value).sum(dim=-1) + 1).tolist()
        top = lp.topk(k, dim=-1) if k > 0 else None
        top_ids = top.indices.tolist() if top is not None else [[] for _ in rank]
        top_lps = top.values.tolist() if top is not None else [[] for _ in rank]
        for v, rk, ti, tl in zip(value[:, 0].tolist(), rank, top_ids, top_lps):
            out.append(TokenLogprobs(v, rk, ti, tl))
    return out
