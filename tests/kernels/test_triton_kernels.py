"""The Triton kernels equal their pure-torch references (``kernels/reference.py``).

Without CUDA they run in Triton's interpreter (see ``tests/triton_interpreter.py``), so shapes
are small. Every output starts as NaN, and every cache slot that no sequence owns (the tail of a
last block, blocks of no sequence, block-table padding) holds NaN for the kernel, so an element
left unwritten, or a read outside a sequence's own tokens, fails the comparison.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import paged_attention, prefill_attention, reference, reshape_and_cache
from tests.triton_interpreter import KERNEL_DEVICE as DEVICE

# Max abs error against the float32-softmax reference, per dtype (outputs are O(1)).
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


class Paged:
    """Sequences' K/V in a paged cache with a scattered, out-of-order block table.

    ``kc``/``vc`` are the kernel's caches (NaN wherever no sequence has a token) and
    ``clean_kc``/``clean_vc`` the reference's (random there instead: the reference reads whole
    blocks and masks scores, so NaN would reach it through ``0 * NaN``).
    """

    def __init__(self, seq_lens, block_size, kv_heads, head_size, dtype, seed):
        g = torch.Generator().manual_seed(seed)
        blocks_per_seq = [-(-s // block_size) for s in seq_lens]
        max_blocks = max(blocks_per_seq)
        num_blocks = sum(blocks_per_seq) + 5  # some blocks belong to no sequence
        perm = torch.randperm(num_blocks, generator=g).tolist()
        shape = (num_blocks, block_size, kv_heads, head_size)
        self.clean_kc = torch.randn(shape, generator=g).to(dtype)
        self.clean_vc = torch.randn(shape, generator=g).to(dtype)
        self.kc = torch.full(shape, float("nan"), dtype=dtype)
        self.vc = torch.full(shape, float("nan"), dtype=dtype)
        poison_block = perm.pop()  # table padding points here: all NaN for the kernel
        table = torch.full((len(seq_lens), max_blocks), poison_block, dtype=torch.int32)
        for i, (s, nb) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
            table[i, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
            k = torch.randn(s, kv_heads, head_size, generator=g).to(dtype)
            v = torch.randn(s, kv_heads, head_size, generator=g).to(dtype)
            pos = torch.arange(s)
            slots = table[i, pos // block_size].long() * block_size + pos % block_size
            for kc, vc in ((self.kc, self.vc), (self.clean_kc, self.clean_vc)):
                reference.reshape_and_cache(k, v, kc, vc, slots)
        self.table = table
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        self.gen = g

    def to_device(self):
        return [t.to(DEVICE) for t in (self.kc, self.vc, self.table, self.seq_lens)]


def assert_matches(out: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == want.dtype == dtype
    out = out.cpu().float()
    assert torch.isfinite(out).all(), "unwritten (NaN) or non-finite output"
    err = (out - want.float()).abs().max().item()
    assert err <= TOL[dtype], f"max abs error {err} > {TOL[dtype]}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [4, 16])
def test_reshape_and_cache_writes_only_its_slots(block_size, dtype):
    g = torch.Generator().manual_seed(block_size)
    num_blocks, kv_heads, head_size = 6, 3, 16
    shape = (num_blocks, block_size, kv_heads, head_size)
    kc = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    vc = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:9]
    slots[[2, 5]] = -1  # padded tokens
    key = torch.randn(9, kv_heads, head_size, generator=g).to(dtype)
    value = torch.randn(9, kv_heads, head_size, generator=g).to(dtype)
    reshape_and_cache.reshape_and_cache(
        key.to(DEVICE), value.to(DEVICE), kc, vc, slots.to(DEVICE)
    )
    want_k = torch.full(shape, float("nan"), dtype=dtype)
    want_v = torch.full(shape, float("nan"), dtype=dtype)
    reference.reshape_and_cache(key, value, want_k, want_v, slots)
    # Written slots hold exactly the new K/V; every other slot (incl. the -1 ones) is untouched.
    torch.testing.assert_close(kc.cpu(), want_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(vc.cpu(), want_v, atol=0, rtol=0, equal_nan=True)
    assert int(torch.isfinite(kc.cpu()).all(-1).all(-1).sum()) == 7


def test_reshape_and_cache_strided_rows():
    """K/V sliced out of a fused projection (row stride > heads * head_size) still land right."""
    kv = torch.randn(5, 2, 2, 16)  # [T, K|V, Hkv, D]
    key, value = kv[:, 0], kv[:, 1]
    kc = torch.full((4, 4, 2, 16), float("nan"), device=DEVICE)
    vc = kc.clone()
    slots = torch.tensor([0, 7, -1, 12, 3])
    reshape_and_cache.reshape_and_cache(
        key.to(DEVICE), value.to(DEVICE), kc, vc, slots.to(DEVICE)
    )
    flat_k, flat_v = kc.cpu().view(-1, 2, 16), vc.cpu().view(-1, 2, 16)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat_k[s], key[t]) and torch.equal(flat_v[s], value[t])
    assert int(torch.isfinite(flat_k).all(-1).all(-1).sum()) == 4


DECODE_CASES = [
    # block_size, seq_lens (fill / do not fill the last block, 1 token, several tiles),
    # kv_heads, heads (GQA 1, 3, 4), head_size
    (4, [1, 8, 13, 70], 2, 2, 16),
    (16, [16, 33, 5, 100], 2, 6, 16),
    (8, [24, 3, 41], 1, 4, 64),
    (16, [17, 32], 2, 8, 128),
]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"bs{c[0]}-g{c[3] // c[2]}-d{c[4]}")
def test_decode_matches_reference(case, num_splits):
    block_size, seq_lens, kv_heads, heads, head_size = case
    _check_decode(block_size, seq_lens, kv_heads, heads, head_size, torch.float32, num_splits)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_half_precision(dtype, num_splits):
    _check_decode(16, [16, 45, 2], 2, 6, 64, dtype, num_splits)


def _check_decode(block_size, seq_lens, kv_heads, heads, head_size, dtype, num_splits):
    p = Paged(seq_lens, block_size, kv_heads, head_size, dtype, seed=len(seq_lens) + heads)
    q = torch.randn(len(seq_lens), heads, head_size, generator=p.gen).to(dtype)
    scale = head_size**-0.5
    want = reference.paged_decode_attention(q, p.clean_kc, p.clean_vc, p.table, p.seq_lens, scale)
    kc, vc, table, lens = p.to_device()
    out = torch.full_like(q, float("nan"), device=DEVICE)
    got = paged_attention.paged_decode_attention(
        q.to(DEVICE), kc, vc, table, lens, scale, num_splits=num_splits, out=out
    )
    assert got is out
    assert_matches(out, want, dtype)


def test_decode_choose_num_splits_on_cpu_is_one():
    assert paged_attention.choose_num_splits(1, 1, torch.device("cpu"), 100_000) == 1


PREFILL_CASES = [
    # block_size, seq_lens, q_lens (whole prompt, chunk after cached context, 1-token chunk,
    # a chunk longer than one query tile), kv_heads, heads, head_size
    (4, [20, 7, 33], [20, 3, 11], 2, 2, 16),
    (16, [9, 40, 18], [9, 1, 18], 1, 3, 16),
    (8, [90, 12], [70, 5], 2, 8, 16),
    (16, [21, 35], [21, 10], 1, 4, 64),
]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"bs{c[0]}-g{c[4] // c[3]}-d{c[5]}")
def test_prefill_matches_reference(case):
    _check_prefill(*case, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_half_precision(dtype):
    _check_prefill(16, [21, 35], [21, 10], 2, 6, 64, dtype)


def test_prefill_head_size_128():
    _check_prefill(16, [19], [7], 2, 4, 128, torch.float32)


def _check_prefill(block_size, seq_lens, q_lens, kv_heads, heads, head_size, dtype):
    p = Paged(seq_lens, block_size, kv_heads, head_size, dtype, seed=sum(q_lens))
    q = torch.randn(sum(q_lens), heads, head_size, generator=p.gen).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = head_size**-0.5
    want = reference.paged_prefill_attention(
        q, p.clean_kc, p.clean_vc, p.table, p.seq_lens, qsl, scale
    )
    kc, vc, table, lens = p.to_device()
    out = torch.full_like(q, float("nan"), device=DEVICE)
    prefill_attention.paged_prefill_attention(
        q.to(DEVICE), kc, vc, table, lens, qsl.to(DEVICE), scale, out=out
    )
    assert_matches(out, want, dtype)
