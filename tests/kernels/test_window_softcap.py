"""Sliding-window attention and attention-logit soft-capping in the C++ CPU kernels equal the
torch reference (transformers' rule: a query at position ``i`` sees keys ``i - W < j <= i``;
Gemma 2's ``cap * tanh(s / cap)`` after scaling), on every ISA tier the CPU runs: decodes
(long ones split across threads too), decodes with drafts, prefill chunks after cached
context, GQA. Every slot before a query's window is NaN and the blocks wholly before it point
at a NaN block (what a freed block's placeholder may hold): reading one would poison the
output, so the kernels provably skip them."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_ops, reference
from tests.kernels.test_cpu_ops import _setup

pytestmark = pytest.mark.usefixtures("isa")


def poison_before(kc, vc, table, first_seen: list[int], block_size: int):
    """NaN every slot of sequence ``i`` before ``first_seen[i]``, and point its blocks wholly
    before it at a new last block full of NaN (a released block's placeholder). Returns the
    caches with that block."""
    kc = torch.cat([kc, torch.full_like(kc[:1], float("nan"))])
    vc = torch.cat([vc, torch.full_like(vc[:1], float("nan"))])
    for i, first in enumerate(first_seen):
        for pos in range(first):
            b = table[i, pos // block_size]
            kc[b, pos % block_size] = vc[b, pos % block_size] = float("nan")
        table[i, : first // block_size] = kc.shape[0] - 1
    return kc, vc


def clean(kc, vc):
    return kc.nan_to_num(0.0), vc.nan_to_num(0.0)


CASES = [(None, 30.0), (8, None), (8, 5.0), (1, None), (37, 2.0)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_size", [(4, 4, 8), (9, 3, 64)])
@pytest.mark.parametrize("window,cap", CASES)
def test_decode_matches_reference(dtype, tol, heads, kv_heads, head_size, window, cap):
    bs = 4
    seq_lens = [1, 7, 9, 30, 70]
    q, kc, vc, table, lens = _setup(seq_lens, heads, kv_heads, head_size, bs, dtype)
    want = reference.paged_decode_attention(q, *clean(kc, vc), table, lens, 0.2,
                                            sliding_window=window, logits_soft_cap=cap)
    if window is not None:
        kc, vc = poison_before(kc, vc, table, [max(0, s - window) for s in seq_lens], bs)
    got = cpu_ops.paged_decode_attention(q, kc, vc, table, lens, 0.2, sliding_window=window,
                                         logits_soft_cap=cap)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("window,cap", [(600, None), (100, 20.0)])
def test_long_decodes_split_inside_the_window(window, cap):
    """Few long contexts: the split (flash-decoding) parts cut the window, not the context."""
    seq_lens = [2100, 1030]
    q, kc, vc, table, lens = _setup(seq_lens, 9, 3, 64, 16, torch.float32)
    want = reference.paged_decode_attention(q, *clean(kc, vc), table, lens, 0.125,
                                            sliding_window=window, logits_soft_cap=cap)
    got = cpu_ops.paged_decode_attention(q, kc, vc, table, lens, 0.125, sliding_window=window,
                                         logits_soft_cap=cap)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,cap", CASES)
def test_decodes_with_drafts_are_windowed_causal_decodes(window, cap):
    seq_lens, q_lens = [9, 1, 20], [3, 1, 4]
    _, kc, vc, table, lens = _setup(seq_lens, 6, 2, 64, 4, torch.float32)
    query = torch.randn(sum(q_lens), 6, 64, generator=torch.Generator().manual_seed(5))
    qsl = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    got = cpu_ops.paged_decode_attention(query, kc, vc, table, lens, 0.125, query_start_loc=qsl,
                                         sliding_window=window, logits_soft_cap=cap)
    rows, row_lens = [], []
    for i, (s, n) in enumerate(zip(seq_lens, q_lens, strict=True)):
        rows += [i] * n
        row_lens += [s - (n - 1 - j) for j in range(n)]
    want = reference.paged_decode_attention(
        query, *clean(kc, vc), table[rows], torch.tensor(row_lens, dtype=torch.int32), 0.125,
        sliding_window=window, logits_soft_cap=cap)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_size", [(9, 3, 64), (8, 2, 128)])
@pytest.mark.parametrize("window,cap", CASES)
def test_prefill_chunks_match_reference(dtype, tol, heads, kv_heads, head_size, window, cap):
    if not cpu_ops.prefill_supported(head_size):
        pytest.skip("this tier has no prefill kernel")
    q_lens, seq_lens = [37, 5, 1, 16, 40], [37, 5, 1, 100, 60]  # fresh prompts, later chunks
    bs = 4
    _, kc, vc, table, lens = _setup(seq_lens, heads, kv_heads, head_size, bs, dtype)
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(sum(q_lens), (heads + 2 * kv_heads) * head_size, generator=g).to(dtype)
    q = qkv[:, : heads * head_size].view(-1, heads, head_size)  # strided rows, as the model's
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    want = reference.paged_prefill_attention(q, *clean(kc, vc), table, lens, qsl, 0.11,
                                             sliding_window=window, logits_soft_cap=cap)
    if window is not None:  # nothing before the first query's window is read
        first = [max(0, s - n - window + 1) for s, n in zip(seq_lens, q_lens, strict=True)]
        kc, vc = poison_before(kc, vc, table, first, bs)
    got = cpu_ops.paged_prefill_attention(q, kc, vc, table, lens, qsl, 0.11,
                                          sliding_window=window, logits_soft_cap=cap)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_8bit_caches_with_window_and_cap(isa, dtype):
    """--kv-cache-dtype int8/fp8 caches read through the same windowed, capped paths."""
    from tests.kernels.test_kv_quant import D, H, NB, filled_caches

    torch.manual_seed(2)
    kc, vc = filled_caches(dtype, torch.float32)
    bt = torch.arange(NB, dtype=torch.int32).view(4, 5)
    sl = torch.tensor([70, 1, 33, 80], dtype=torch.int32)
    kw = {"sliding_window": 20, "logits_soft_cap": 3.0}
    q = torch.randn(4, H, D)
    want = reference.paged_decode_attention(q, kc, vc, bt, sl, 0.125, **kw)
    got = cpu_ops.paged_decode_attention(q, kc, vc, bt, sl, 0.125, **kw)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if not cpu_ops.prefill_supported(D):
        return
    qsl = torch.tensor([0, 10, 11, 20, 50], dtype=torch.int32)
    qp = torch.randn(50, H, D)
    want = reference.paged_prefill_attention(qp, kc, vc, bt, sl, qsl, 0.125, **kw)
    got = cpu_ops.paged_prefill_attention(qp, kc, vc, bt, sl, qsl, 0.125, **kw)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
