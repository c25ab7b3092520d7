"""The C++ flash-style prefill kernel equals the per-sequence SDPA reference: fresh prompts and
chunks after cached context, GQA groups, 64 and 128 head sizes, rows that fill 16 lanes or not,
strided query rows (views of the fused qkv); it reads no slot outside a sequence's own tokens;
unsupported shapes are refused and the cpu backend then uses the reference. Once per ISA tier
with the kernel (avx2: 8 lanes, avx512: 16); the generic tier has none."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_ops, reference
from tests.kernels.test_cpu_ops import _setup


@pytest.fixture(autouse=True)
def _prefill_tier(isa):
    if not cpu_ops.prefill_supported(64):
        pytest.skip(f"the {isa} tier has no prefill kernel")


def _problem(q_lens, seq_lens, heads, kv_heads, head_size, block_size, dtype, seed=0):
    # The decode tests' paged cache: every slot NaN but each sequence's own tokens.
    _, kc, vc, table, lens = _setup(seq_lens, heads, kv_heads, head_size, block_size, dtype, seed)
    # Queries as a view into a wider qkv row, as the model passes them.
    g = torch.Generator().manual_seed(seed + 1)
    width = (heads + 2 * kv_heads) * head_size
    qkv = torch.randn(sum(q_lens), width, generator=g).to(dtype)
    q = qkv[:, : heads * head_size].view(-1, heads, head_size)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, kc, vc, table, lens, qsl


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_size", [(9, 3, 64), (8, 2, 128), (4, 4, 64)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("q_lens,seq_lens", [
    ([37, 5, 1], [37, 5, 1]),  # fresh prompts, lane counts not multiples of 16
    ([16, 3, 40], [100, 20, 40]),  # chunks after cached context (prefix hits, later chunks)
])
def test_matches_reference(dtype, tol, heads, kv_heads, head_size, block_size, q_lens,
                           seq_lens):
    args = (*_problem(q_lens, seq_lens, heads, kv_heads, head_size, block_size, dtype), 0.11)
    got = cpu_ops.paged_prefill_attention(*args)
    ref_args = (args[0], args[1].nan_to_num(0.0), args[2].nan_to_num(0.0), *args[3:])
    want = reference.paged_prefill_attention(*ref_args)
    assert got.shape == (sum(q_lens), heads, head_size) and got.dtype == dtype
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_long_prompt_spans_many_chunks():
    args = (*_problem([700], [700], 9, 3, 64, 16, torch.float32, seed=3), 0.125)
    want = reference.paged_prefill_attention(args[0], args[1].nan_to_num(0.0),
                                             args[2].nan_to_num(0.0), *args[3:])
    torch.testing.assert_close(cpu_ops.paged_prefill_attention(*args), want, rtol=1e-5,
                               atol=1e-5)


def test_unsupported_shapes_are_refused_and_the_backend_falls_back():
    assert not cpu_ops.prefill_supported(8) and cpu_ops.prefill_supported(128)
    args = (*_problem([5], [5], 4, 4, 8, 4, torch.float32), 0.3)
    with pytest.raises(ValueError, match="head_size 8"):
        cpu_ops.paged_prefill_attention(*args)
    from pagedserve.gpu.attention import CpuAttentionBackend

    want = reference.paged_prefill_attention(args[0], args[1].nan_to_num(0.0),
                                             args[2].nan_to_num(0.0), *args[3:])
    got = CpuAttentionBackend.prefill(args[0], args[1].nan_to_num(0.0),
                                      args[2].nan_to_num(0.0), *args[3:])
    torch.testing.assert_close(got, want)
