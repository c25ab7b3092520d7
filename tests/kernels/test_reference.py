"""The pure-torch paged kernels equal scaled_dot_product_attention on the unpaged equivalent."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels import reference


def _paged_setup(seq_lens, q_lens, block_size, heads, kv_heads, head_size, seed=0):
    """Random K/V written into a cache through a scattered, out-of-order block table."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    num_blocks = max_blocks * len(seq_lens) + 3
    perm = torch.randperm(num_blocks, generator=g)  # scattered, out of order
    table = perm[: max_blocks * len(seq_lens)].view(len(seq_lens), max_blocks).int()
    kc = torch.randn(num_blocks, block_size, kv_heads, head_size, generator=g)
    vc = torch.randn(num_blocks, block_size, kv_heads, head_size, generator=g)
    ks, vs = [], []
    for i, s in enumerate(seq_lens):
        k = torch.randn(s, kv_heads, head_size, generator=g)
        v = torch.randn(s, kv_heads, head_size, generator=g)
        pos = torch.arange(s)
        slots = table[i, pos // block_size].long() * block_size + pos % block_size
        reference.reshape_and_cache(k, v, kc, vc, slots)
        ks.append(k)
        vs.append(v)
    q = torch.randn(sum(q_lens), heads, head_size, generator=g)
    return q, kc, vc, table, ks, vs


def _sdpa(q, k, v, causal_offset):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    ql, kl = q.shape[0], k.shape[0]
    mask = torch.arange(kl)[None, :] <= (torch.arange(ql)[:, None] + causal_offset)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       attn_mask=mask)
    return o.transpose(0, 1)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("kv_heads,heads", [(4, 4), (2, 6), (1, 4)])
def test_decode_matches_sdpa(block_size, kv_heads, heads):
    seq_lens = [1, 17, 32, 5]  # fill and do not fill the last block
    q, kc, vc, table, ks, vs = _paged_setup(seq_lens, [1] * 4, block_size, heads, kv_heads, 8)
    out = reference.paged_decode_attention(q, kc, vc, table, torch.tensor(seq_lens), 8**-0.5)
    for i, s in enumerate(seq_lens):
        want = _sdpa(q[i : i + 1], ks[i], vs[i], s - 1)
        torch.testing.assert_close(out[i : i + 1], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_with_cached_context_matches_sdpa(block_size):
    seq_lens, q_lens = [20, 7, 33], [20, 3, 11]  # full prompt, and chunks after a cached context
    q, kc, vc, table, ks, vs = _paged_setup(seq_lens, q_lens, block_size, 6, 2, 8, seed=1)
    qsl = torch.tensor([0, 20, 23, 34])
    out = reference.paged_prefill_attention(
        q, kc, vc, table, torch.tensor(seq_lens), qsl, 8**-0.5
    )
    for i, (s, n) in enumerate(zip(seq_lens, q_lens)):
        want = _sdpa(q[qsl[i] : qsl[i + 1]], ks[i], vs[i], s - n)
        torch.testing.assert_close(out[qsl[i] : qsl[i + 1]], want, atol=1e-5, rtol=1e-5)


def test_reshape_and_cache_skips_padded_slots():
    kc = torch.full((2, 4, 1, 2), -7.0)
    vc = torch.full((2, 4, 1, 2), -7.0)
    k = torch.arange(6.0).view(3, 1, 2)
    reference.reshape_and_cache(k, k + 100, kc, vc, torch.tensor([5, -1, 0]))
    assert kc.view(-1, 2)[5].tolist() == [0.0, 1.0]
    assert kc.view(-1, 2)[0].tolist() == [4.0, 5.0]
    assert vc.view(-1, 2)[0].tolist() == [104.0, 105.0]
    untouched = [i for i in range(8) if i not in (0, 5)]
    assert (kc.view(-1, 2)[untouched] == -7.0).all()
