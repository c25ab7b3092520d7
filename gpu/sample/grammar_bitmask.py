"""Guided decoding on the device side: mask the logits of guided rows with their grammar
bitmask before sampling, so only tokens the grammar allows can be drawn.

The bitmask is filled on the CPU by the scheduler (one row per guided request); unguided rows
of the batch are left untouched.
"""

from __future__ import annotations

import torch
import xgrammar as xgr


def apply_grammar_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: dict[str, int], req_ids: list[str]
) -> None:
    """Set to ``-inf``, in place, the logits of tokens each guided row's grammar forbids.

    Args:
        logits: ``[B, V]``, row ``i`` samples for ``req_ids[i]``.
        bitmask: int32 ``[G, ceil(V' / 32)]`` (``V'`` the grammar's vocab size, which may be
            smaller than ``V`` when the model pads its vocabulary: the padding is masked).
        rows: request id → its row of ``bitmask``.
        req_ids: the request id of each logits row.
    """
    indices = [i for i, rid in enumerate(req_ids) if rid in rows]
    if not indices:
        return
    # xgrammar indexes logits and bitmask with the same row ids: lay the rows out as logits.
    full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
    full[indices] = bitmask[[rows[req_ids[i]] for i in indices]]
    vocab = logits.shape[-1]
    if full.shape[1] * 32 < vocab:  # grammar vocab shorter than the model's: ban the padding
        logits[indices, full.shape[1] * 32 :] = float("-inf")
    xgr.apply_token_bitmask_inplace(
        logits, full.to(logits.device, non_blocking=True),
        vocab_size=min(vocab, full.shape[1] * 32), indices=indices,
    )
