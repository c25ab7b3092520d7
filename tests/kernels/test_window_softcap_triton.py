"""Sliding window and soft cap in the Triton decode and prefill kernels equal the torch
reference (under Triton's interpreter without CUDA). The kernel's caches are NaN before each
query's window (whole blocks pointed at a NaN block, as released ones are, and the slots
before the window in a part-used block): a kernel that read there would fail."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import paged_attention, prefill_attention, reference
from tests.kernels.test_triton_kernels import Paged, assert_matches
from tests.triton_interpreter import KERNEL_DEVICE as DEVICE

CASES = [(None, 20.0), (8, None), (8, 5.0), (1, None), (37, 2.0)]


def poison_before(p: Paged, first_seen: list[int], block_size: int) -> None:
    """NaN in the kernel's caches for sequence ``i``'s tokens before ``first_seen[i]``; its
    block-table entries wholly before point at a new all-NaN block (a released one's stand-in)."""
    p.kc = torch.cat([p.kc, torch.full_like(p.kc[:1], float("nan"))])
    p.vc = torch.cat([p.vc, torch.full_like(p.vc[:1], float("nan"))])
    for i, first in enumerate(first_seen):
        for pos in range(first):
            b = p.table[i, pos // block_size]
            p.kc[b, pos % block_size] = p.vc[b, pos % block_size] = float("nan")
        p.table[i, : first // block_size] = p.kc.shape[0] - 1


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window,cap", CASES)
def test_decode_matches_reference(window, cap, num_splits):
    bs, seq_lens, kv_heads, heads, d = 4, [1, 8, 13, 70], 2, 6, 16
    p = Paged(seq_lens, bs, kv_heads, d, torch.float32, seed=7)
    q = torch.randn(len(seq_lens), heads, d, generator=p.gen)
    want = reference.paged_decode_attention(q, p.clean_kc, p.clean_vc, p.table, p.seq_lens,
                                            0.25, sliding_window=window, logits_soft_cap=cap)
    if window is not None:
        poison_before(p, [max(0, s - window) for s in seq_lens], bs)
    kc, vc, table, lens = p.to_device()
    out = torch.full_like(q, float("nan"), device=DEVICE)
    paged_attention.paged_decode_attention(q.to(DEVICE), kc, vc, table, lens, 0.25,
                                           num_splits=num_splits, out=out,
                                           sliding_window=window, logits_soft_cap=cap)
    assert_matches(out, want, torch.float32)


@pytest.mark.parametrize("window,cap", CASES)
@pytest.mark.parametrize("case", [
    # block_size, seq_lens, q_lens (whole prompts, chunks after context, 1 token, a chunk of
    # several query tiles), kv_heads, heads, head_size
    (4, [20, 7, 33, 90], [20, 3, 11, 70], 2, 4, 16),
    (16, [21, 35], [21, 10], 1, 4, 64),
], ids=["bs4-d16", "bs16-d64"])
def test_prefill_matches_reference(case, window, cap):
    bs, seq_lens, q_lens, kv_heads, heads, d = case
    p = Paged(seq_lens, bs, kv_heads, d, torch.float32, seed=sum(q_lens))
    q = torch.randn(sum(q_lens), heads, d, generator=p.gen)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    want = reference.paged_prefill_attention(q, p.clean_kc, p.clean_vc, p.table, p.seq_lens,
                                             qsl, 0.2, sliding_window=window,
                                             logits_soft_cap=cap)
    if window is not None:
        poison_before(p, [max(0, s - n - window + 1) for s, n in zip(seq_lens, q_lens,
                                                                     strict=True)], bs)
    kc, vc, table, lens = p.to_device()
    out = torch.full_like(q, float("nan"), device=DEVICE)
    prefill_attention.paged_prefill_attention(q.to(DEVICE), kc, vc, table, lens,
                                              qsl.to(DEVICE), 0.2, out=out,
                                              sliding_window=window, logits_soft_cap=cap)
    assert_matches(out, want, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_with_window_and_cap(dtype):
    p = Paged([45, 30], 16, 2, 64, dtype, seed=3)
    q = torch.randn(2, 6, 64, generator=p.gen).to(dtype)
    want = reference.paged_decode_attention(q, p.clean_kc, p.clean_vc, p.table, p.seq_lens,
                                            0.125, sliding_window=20, logits_soft_cap=10.0)
    kc, vc, table, lens = p.to_device()
    out = paged_attention.paged_decode_attention(q.to(DEVICE), kc, vc, table, lens, 0.125,
                                                 sliding_window=20, logits_soft_cap=10.0)
    assert_matches(out, want, dtype)
