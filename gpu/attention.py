"""Attention over paged KV blocks: step metadata, the backends, and how one is chosen.

The batch is ordered decodes first (one query token each), then decodes with drafts, then
prefill chunks (``gpu.batch.Segment``), as vLLM V1's backends expect, so each kind runs as one
call: batched decode attention for the leading sequences that ``BatchLayout.decode_split``
names, variable-length causal attention for the rest.

Three backends share one interface (``name``, ``write_kv``, ``forward``): ``torch`` (the
pure-torch reference kernels), ``cpu`` (the reference with decode attention from our C++ kernel,
which reads K/V in place: the CPU path) and ``triton`` (our Triton kernels; the CUDA path).
``get_attention_backend`` picks by device; ``PAGEDSERVE_ATTENTION_BACKEND=cpu|torch|triton``
forces one, as vLLM's ``VLLM_ATTENTION_BACKEND`` does. Triton on the CPU needs
``TRITON_INTERPRET=1`` (Triton's interpreter: slow, for tests).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import structlog
import torch

from pagedserve.gpu.batch import BatchLayout
from pagedserve.kernels import cpu_ops, reference

log = structlog.get_logger(__name__)

BACKEND_ENV = "PAGEDSERVE_ATTENTION_BACKEND"


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step tensors shared by every layer.

    Attributes:
        slot_mapping: ``[T]`` int64 cache slot of each scheduled token.
        query_start_loc: ``[B+1]`` int32 offsets of each sequence's tokens in the batch.
        seq_lens: ``[B]`` int32 context length of each sequence after this step.
        block_table: ``[B, max_blocks_per_seq]`` int32 block ids (0-padded).
        layout: how many sequences (and tokens) are decodes, decodes with drafts and
            prefill chunks, in that order (host-side ints).
        max_query_len, max_seq_len: host-side maxima of the query lengths and of
            ``seq_lens``, when known (spares the Triton backend a device sync); ``None`` in a
            captured CUDA graph, whose kernels must not depend on them.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    layout: BatchLayout
    max_query_len: int | None = None
    max_seq_len: int | None = None


class AttentionBackend(Protocol):
    name: str

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> None: ...

    def forward(
        self, query: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata, scale: float, *, sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor: ...


def mask_kwargs(sliding_window: int | None, logits_soft_cap: float | None) -> dict:
    """The kernels' keyword arguments for a layer's window and soft cap (semantics:
    ``kernels.reference.paged_decode_attention``): empty when both are ``None``, so a layer
    without them calls the kernels exactly as before.

    Raises:
        ValueError: a window below 1 or a cap that is not positive.
    """
    if sliding_window is None and logits_soft_cap is None:
        return {}
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be > 0, got {logits_soft_cap}")
    return {"sliding_window": sliding_window, "logits_soft_cap": logits_soft_cap}


class TorchAttentionBackend:
    """Pure-torch paged attention (the CPU path, and the reference for the Triton one)."""

    name = "torch"
    decode = staticmethod(reference.paged_decode_attention)
    prefill = staticmethod(reference.paged_prefill_attention)
    reshape_and_cache = staticmethod(reference.reshape_and_cache)
    multi_query_decode = False  # decodes with drafts are prefill chunks here

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> None:
        """Store this step's ``[T, num_kv_heads, head_size]`` K/V at ``meta.slot_mapping``."""
        self.reshape_and_cache(key, value, kv_cache[0], kv_cache[1], meta.slot_mapping)

    def forward(
        self, query: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata, scale: float, *, sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """``[T, num_heads, head_size]`` queries → attention output of the same shape.

        The first sequences go to ``decode``: the decodes, and with ``multi_query_decode`` the
        decodes with drafts too; the rest are prefill chunks. ``sliding_window`` and
        ``logits_soft_cap``: as ``kernels.reference.paged_decode_attention`` (``None``: off).
        """
        key_cache, value_cache = kv_cache
        nd, nt = meta.layout.decode_split(self.multi_query_decode)
        masks = mask_kwargs(sliding_window, logits_soft_cap)
        # Several queries per sequence: the kernel needs their offsets.
        extra = {"query_start_loc": meta.query_start_loc[: nd + 1]} if nt > nd else {}
        extra.update(masks)
        if nd == meta.layout.num_reqs:
            return self.decode(query, key_cache, value_cache, meta.block_table, meta.seq_lens,
                               scale, **extra)
        out = torch.empty_like(query)
        if nd:
            out[:nt] = self.decode(query[:nt], key_cache, value_cache, meta.block_table[:nd],
                                   meta.seq_lens[:nd], scale, **extra)
        out[nt:] = self.prefill(
            query[nt:], key_cache, value_cache, meta.block_table[nd:], meta.seq_lens[nd:],
            meta.query_start_loc[nd:] - nt, scale, **masks,
        )
        return out


class CpuAttentionBackend(TorchAttentionBackend):
    """The torch backend with decode attention and KV writes from ``kernels/cpu_ops`` (C++,
    compiled on first use): no padded K/V copy per layer (``loadtest/RESULTS.md``); one call
    per layer for the KV write instead of four torch ops; prefill chunks from a
    flash-attention-style kernel."""

    name = "cpu"
    decode = staticmethod(cpu_ops.paged_decode_attention)

    @staticmethod
    def prefill(query: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """Our flash-style kernel where it is built for this head size (faster than torch's
        SDPA per sequence: ``loadtest/RESULTS.md``), else the reference."""
        if cpu_ops.prefill_supported(query.shape[2]):
            return cpu_ops.paged_prefill_attention(query, *args, **kwargs)
        return reference.paged_prefill_attention(query, *args, **kwargs)

    multi_query_decode = True  # decodes with drafts go through the kernel, not the prefill path
    reshape_and_cache = staticmethod(cpu_ops.reshape_and_cache)


class TritonAttentionBackend:
    """Our Triton kernels (``kernels/``): the CUDA path. No device syncs in a decode-only step,
    so a decode step can be captured in a CUDA graph."""

    name = "triton"
    multi_query_decode = False  # decodes with drafts are prefill chunks here

    def __init__(self, device: torch.device):
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "the triton attention backend on the CPU needs TRITON_INTERPRET=1 (Triton's "
                f"interpreter, slow: for tests); unset {BACKEND_ENV} to use the torch backend"
            )
        # Imported here so the CPU path never loads triton.
        from pagedserve.kernels import paged_attention, prefill_attention, reshape_and_cache

        self._reshape_and_cache = reshape_and_cache.reshape_and_cache
        self._decode = paged_attention.paged_decode_attention
        self._prefill = prefill_attention.paged_prefill_attention

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> None:
        self._reshape_and_cache(key, value, kv_cache[0], kv_cache[1], meta.slot_mapping)

    def forward(
        self, query: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata, scale: float, *, sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        masks = mask_kwargs(sliding_window, logits_soft_cap)
        key_cache, value_cache = kv_cache
        out = torch.empty_like(query)
        nd, nt = meta.layout.decode_split(self.multi_query_decode)  # nt == nd: one query each
        if nd:
            self._decode(
                query[:nt], key_cache, value_cache, meta.block_table[:nd], meta.seq_lens[:nd],
                scale, max_seq_len=meta.max_seq_len, out=out[:nt], **masks,
            )
        if nd < meta.layout.num_reqs:
            self._prefill(
                query[nt:], key_cache, value_cache, meta.block_table[nd:], meta.seq_lens[nd:],
                meta.query_start_loc[nd:] - nt, scale, max_query_len=meta.max_query_len,
                out=out[nt:], **masks,
            )
        return out


def get_attention_backend(device: torch.device,
                          dtype: torch.dtype = torch.float32) -> AttentionBackend:
    """Triton on CUDA, cpu elsewhere (torch when the C++ kernel cannot be built, or for
    float16, which it does not take), unless ``PAGEDSERVE_ATTENTION_BACKEND`` says which.

    Raises:
        ValueError: an unknown name, or a forced backend that cannot run here.
    """
    name = os.environ.get(BACKEND_ENV, "").strip().lower()
    if not name:
        if device.type == "cuda":
            name = "triton"
        elif dtype not in (torch.float32, torch.bfloat16):
            log.info("cpu_kernels_skipped", reason=f"they take float32 or bfloat16, not {dtype}",
                     fallback="torch")
            name = "torch"
        elif cpu_ops.load() is not None:
            name = "cpu"
        else:
            log.warning("cpu_kernels_unavailable", reason=cpu_ops.error(),
                        fallback="torch")
            name = "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu":
        if device.type != "cpu" or cpu_ops.load() is None:
            raise ValueError(f"{BACKEND_ENV}=cpu needs a CPU device and a C++ compiler "
                             f"({cpu_ops.error() or 'device is ' + device.type})")
        return CpuAttentionBackend()
    if name == "triton":
        return TritonAttentionBackend(device)
    raise ValueError(f"{BACKEND_ENV}={name!r} is not a backend: choose 'cpu', 'torch' or 'triton'")
