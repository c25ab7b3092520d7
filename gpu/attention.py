"""Attention over paged KV blocks: step metadata and the pure-torch backend.

The batch is ordered decodes first (one query token each), then prefill chunks, as vLLM V1's
backends expect, so each kind runs as one call: batched decode attention for the first
``num_decodes`` sequences, variable-length causal attention for the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import reference


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step tensors shared by every layer.

    Attributes:
        slot_mapping: ``[T]`` int64 cache slot of each scheduled token.
        query_start_loc: ``[B+1]`` int32 offsets of each sequence's tokens in the batch.
        seq_lens: ``[B]`` int32 context length of each sequence after this step.
        block_table: ``[B, max_blocks_per_seq]`` int32 block ids (0-padded).
        num_decodes: the first ``num_decodes`` sequences have exactly one query token.
        num_decode_tokens: equals ``num_decodes``.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    num_decodes: int
    num_decode_tokens: int


class TorchAttentionBackend:
    """Pure-torch paged attention (the CPU path, and the reference for the Triton one)."""

    name = "torch"

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> None:
        """Store this step's ``[T, num_kv_heads, head_size]`` K/V at ``meta.slot_mapping``."""
        reference.reshape_and_cache(key, value, kv_cache[0], kv_cache[1], meta.slot_mapping)

    def forward(
        self, query: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata, scale: float,
    ) -> torch.Tensor:
        """``[T, num_heads, head_size]`` queries → attention output of the same shape."""
        key_cache, value_cache = kv_cache
        nd = meta.num_decodes
        if nd == meta.seq_lens.shape[0]:
            return reference.paged_decode_attention(
                query, key_cache, value_cache, meta.block_table, meta.seq_lens, scale
            )
        out = torch.empty_like(query)
        if nd:
            out[:nd] = reference.paged_decode_attention(
                query[:nd], key_cache, value_cache, meta.block_table[:nd], meta.seq_lens[:nd], scale
            )
        out[nd:] = reference.paged_prefill_attention(
            query[nd:], key_cache, value_cache, meta.block_table[nd:], meta.seq_lens[nd:],
            meta.query_start_loc[nd:] - nd, scale,
        )
        return out
