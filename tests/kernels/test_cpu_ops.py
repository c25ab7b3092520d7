"""The C++ CPU decode and elementwise kernels equal the torch references on every ISA tier the
CPU runs (the ``isa`` fixture), and the decode kernel reads only a sequence's own slots. The
build and the tier's choice are tested in ``test_cpu_isa.py``."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_ops, reference

pytestmark = pytest.mark.usefixtures("isa")


def _setup(seq_lens, heads, kv_heads, head_size, block_size, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-s // block_size) for s in seq_lens) + 1  # a spare column, never read
    num_blocks = max_blocks * len(seq_lens) + 2
    table = torch.randperm(num_blocks, generator=g)[: max_blocks * len(seq_lens)]
    table = table.view(len(seq_lens), max_blocks).int()
    # Every slot NaN, then each sequence's own tokens written: reading past seq_len (or
    # another sequence's block) would poison the output.
    kc = torch.full((num_blocks, block_size, kv_heads, head_size), float("nan"), dtype=dtype)
    vc = kc.clone()
    for i, s in enumerate(seq_lens):
        pos = torch.arange(s)
        slots = table[i, pos // block_size].long() * block_size + pos % block_size
        reference.reshape_and_cache(
            torch.randn(s, kv_heads, head_size, generator=g).to(dtype),
            torch.randn(s, kv_heads, head_size, generator=g).to(dtype), kc, vc, slots)
    q = torch.randn(len(seq_lens), heads, head_size, generator=g).to(dtype)
    return q, kc, vc, table, torch.tensor(seq_lens, dtype=torch.int32)


def _reference(q, kc, vc, table, seq_lens, scale):
    # The reference pads with real cache rows; give it a NaN-free copy of the caches.
    return reference.paged_decode_attention(
        q, kc.nan_to_num(0.0), vc.nan_to_num(0.0), table, seq_lens, scale)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_size", [(4, 4, 8), (9, 3, 64), (8, 2, 128)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_matches_reference(dtype, tol, heads, kv_heads, head_size, block_size):
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 70]
    q, kc, vc, table, lens = _setup(seq_lens, heads, kv_heads, head_size, block_size, dtype)
    scale = head_size**-0.5
    out = torch.full_like(q, float("nan"))
    got = cpu_ops.paged_decode_attention(q, kc, vc, table, lens, scale, out=out)
    assert got.data_ptr() == out.data_ptr() and got.dtype == dtype
    want = _reference(q, kc, vc, table, lens, scale)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_size", [(4, 4, 8), (9, 3, 64), (32, 32, 64)])
@pytest.mark.parametrize("seq_lens", [[1500], [2100, 1030, 1], [300, 97]])
def test_long_contexts_of_few_sequences_split_and_merge(dtype, tol, heads, kv_heads, head_size,
                                                         seq_lens):
    """Fewer sequences than threads: contexts of 98k+ K elements (1,024+ tokens of SmolLM2's
    3 x 64, 48+ of 32 x 64) are split across tasks and the parts merged by their softmax maxima
    and sums (uneven and empty parts included)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(8)  # the kernel shares torch's OpenMP pool: 2+ parts each
    try:
        q, kc, vc, table, lens = _setup(seq_lens, heads, kv_heads, head_size, 16, dtype)
        got = cpu_ops.paged_decode_attention(q, kc, vc, table, lens, 0.2)
    finally:
        torch.set_num_threads(threads)
    want = _reference(q, kc, vc, table, lens, 0.2)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("heads,kv_heads,head_size", [(4, 2, 64), (12, 2, 32), (6, 1, 48)])
def test_simd_paths_for_every_group_and_head_layout(heads, kv_heads, head_size):
    """GQA groups of 2 and 6 query heads per kv head and head sizes 32, 48 and 64 on every
    tier: the vector loop where the head size is a multiple of the tier's lanes, the portable
    one where it is not (48 at AVX-512's 16), and contexts that end inside a block."""
    seq_lens = [3, 17, 33, 100]
    q, kc, vc, table, lens = _setup(seq_lens, heads, kv_heads, head_size, 16, torch.float32)
    got = cpu_ops.paged_decode_attention(q, kc, vc, table, lens, 0.3)
    want = _reference(q, kc, vc, table, lens, 0.3)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_single_token_context_returns_its_value():
    """With one cached token the softmax is 1: the output is that token's V, exactly."""
    q, kc, vc, table, lens = _setup([1], 6, 2, 16, 4, torch.float32)
    got = cpu_ops.paged_decode_attention(q, kc, vc, table, lens, 0.25)
    v = vc[table[0, 0]][0]  # [kv_heads, D]
    assert torch.equal(got, v.repeat_interleave(3, dim=0)[None])


def test_rejects_bad_inputs():
    q, kc, vc, table, lens = _setup([5], 4, 4, 8, 4, torch.float32)
    with pytest.raises(ValueError, match="float16"):
        cpu_ops.paged_decode_attention(q.half(), kc.half(), vc.half(), table, lens, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        cpu_ops.paged_decode_attention(q[:, :3], kc, vc, table, lens, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        cpu_ops.paged_decode_attention(q, kc.bfloat16(), vc.bfloat16(), table, lens, 1.0)


# -- elementwise kernels against the torch code they replace (gpu/models/llama.py) -----------

def _rms_reference(x, weight, eps):
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


# Row counts on both sides of kParallelMin (64k elements): the calling thread alone, and OpenMP.
ROWS = [7, 300]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)])
def test_rms_norm_with_and_without_residual(dtype, tol, rows):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    res = torch.randn(rows, 576, generator=g).to(dtype)
    w = torch.rand(576, generator=g).to(dtype) + 0.5
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-5), _rms_reference(x, w, 1e-5),
                               atol=tol, rtol=tol)
    res_in = res.clone()
    out = cpu_ops.rms_norm(x, w, 1e-5, residual=res)
    assert torch.equal(res, x + res_in)  # updated in place, rounded to dtype like torch's add
    torch.testing.assert_close(out, _rms_reference(x + res_in, w, 1e-5), atol=tol, rtol=tol)
    # A strided view (rows of a wider tensor) reads only its own columns.
    wide = torch.cat([x, torch.full_like(x, float("nan"))], dim=1)[:, :576]
    torch.testing.assert_close(cpu_ops.rms_norm(wide, w, 1e-5), _rms_reference(x, w, 1e-5),
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_silu_and_mul(dtype, tol, rows):
    x = (torch.randn(rows, 2 * 256, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    x[0, 0] = -200.0  # exp overflow territory: silu is -0, not NaN
    want = torch.nn.functional.silu(x[:, :256].float()) * x[:, 256:].float()
    got = cpu_ops.silu_and_mul(x)
    assert got.shape == (rows, 256) and not got.isnan().any()
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("rows", [6, 1400])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("partial", [1.0, 0.75])  # 0.75: Phi-4-mini's, 12 of 16 turn
def test_rotary_in_place_on_q_and_k_heads_only(dtype, tol, rows, partial):
    from transformers import LlamaConfig

    from pagedserve.gpu.models.llama import RotaryEmbedding, apply_rope

    heads, kv_heads, d = 4, 2, 16
    rotary = RotaryEmbedding(LlamaConfig(rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial}), d, 64)
    assert rotary.cos.shape == (64, int(d * partial))
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    positions = torch.tensor([0, 5, 17, 63, 1, 2] * (rows // 6) + [7] * (rows % 6))
    cos, sin = rotary(positions, torch.float32)
    want = qkv.float().clone().view(rows, -1, d)
    want[:, : heads + kv_heads] = apply_rope(want[:, : heads + kv_heads], cos, sin)
    got = qkv.clone()
    cpu_ops.rotary_embedding(got, positions, rotary.cos, rotary.sin, heads + kv_heads, d)
    torch.testing.assert_close(got.float().view(rows, -1, d), want, atol=tol, rtol=tol)
    assert torch.equal(got[:, -kv_heads * d:], qkv[:, -kv_heads * d:])  # v untouched
    rd = int(d * partial)  # the unrotated tail of each head passes unchanged
    assert torch.equal(got.view(rows, -1, d)[..., rd:], qkv.view(rows, -1, d)[..., rd:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_equals_reference_from_qkv_views(dtype):
    """k and v arrive as strided views of the fused qkv output; -1 slots (padding) are skipped."""
    g = torch.Generator().manual_seed(4)
    heads, kv_heads, d, t = 4, 2, 16, 6
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(t, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].view(t, kv_heads, d)
    slots = torch.tensor([5, 0, -1, 17, 3, -1])
    caches = []
    for write in (reference.reshape_and_cache, cpu_ops.reshape_and_cache):
        kc = torch.full((5, 4, kv_heads, d), float("nan"), dtype=dtype)
        vc = kc.clone()
        write(k, v, kc, vc, slots)
        caches.append((kc, vc))
    (rk, rv), (ck, cv) = caches
    assert torch.equal(rk.nan_to_num(7.0), ck.nan_to_num(7.0))
    assert torch.equal(rv.nan_to_num(7.0), cv.nan_to_num(7.0))
    assert torch.equal(ck.view(-1, kv_heads, d)[17], k[3])  # really written
    assert ck.isnan().sum() == (20 - 4) * kv_heads * d  # and nothing else


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_several_queries_per_sequence_are_causal_decodes(dtype, tol):
    """A decode with drafts: query j of q_len sees the context up to its own position."""
    seq_lens, q_lens = [9, 1, 20], [3, 1, 4]
    q, kc, vc, table, lens = _setup(seq_lens, 6, 2, 64, 4, dtype)
    g = torch.Generator().manual_seed(5)
    query = torch.randn(sum(q_lens), 6, 64, generator=g).to(dtype)
    qsl = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    got = cpu_ops.paged_decode_attention(query, kc, vc, table, lens, 0.125, query_start_loc=qsl)
    rows, row_lens = [], []
    for i, (s, n) in enumerate(zip(seq_lens, q_lens, strict=True)):
        rows += [i] * n
        row_lens += [s - (n - 1 - j) for j in range(n)]
    want = _reference(query, kc, vc, table[rows], torch.tensor(row_lens, dtype=torch.int32),
                      0.125)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
