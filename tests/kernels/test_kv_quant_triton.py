"""8-bit KV caches (``kernels/kv_quant.py``) in the Triton kernels (CUDA's path; here Triton's
interpreter): the quantizing write against ``kv_quant.quantize``'s bytes, and the decode and
prefill reads against the torch reference, for each 8-bit dtype and query dtype."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import (
    kv_quant,
    paged_attention,
    prefill_attention,
    reference,
    reshape_and_cache,
)
from tests.triton_interpreter import KERNEL_DEVICE as DEVICE

H, HKV, D, BS, NB = 4, 2, 32, 16, 12
QDTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("dtype", kv_quant.DTYPES)
def test_write_quantizes_as_the_reference(dtype, qdtype):
    torch.manual_seed(0)
    k, v = torch.randn(40, HKV, D, dtype=qdtype) * 2, torch.randn(40, HKV, D, dtype=qdtype)
    k[5, 1] = 0  # an all-zero row: scale 0, codes 0
    k[7, 0, :8] = torch.arange(8) * 1e-5  # fp8 subnormal codes beside the row's max
    k[7, 0, 8] = 3.0
    slots = torch.randperm(NB * BS)[:40]
    slots[3] = -1  # padding: not written
    want = [torch.zeros(NB, BS, HKV, D + 4, dtype=dtype) for _ in range(2)]
    reference.reshape_and_cache(k, v, *want, slots)
    got = [torch.zeros_like(w, device=DEVICE) for w in want]
    kv = torch.cat([k, v], dim=1).to(DEVICE)  # k, v as strided views of one fused row
    reshape_and_cache.reshape_and_cache(kv[:, :HKV], kv[:, HKV:], *got, slots.to(DEVICE))
    for w, g in zip(want, got, strict=True):
        g = g.cpu()
        assert torch.equal(w.view(torch.uint8), g.view(torch.uint8))


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("dtype", kv_quant.DTYPES)
def test_decode_and_prefill_read_8bit_caches_as_the_reference(dtype, qdtype):
    torch.manual_seed(1)
    kc = torch.zeros(NB, BS, HKV, D + kv_quant.SCALE_BYTES, dtype=dtype)
    vc = torch.zeros_like(kc)
    n = NB * BS
    reference.reshape_and_cache(torch.randn(n, HKV, D, dtype=qdtype) * 3,
                                torch.randn(n, HKV, D, dtype=qdtype), kc, vc, torch.arange(n))
    bt = torch.randperm(NB).to(torch.int32).view(3, 4)
    sl = torch.tensor([50, 1, 33], dtype=torch.int32)
    tol = 1e-5 if qdtype == torch.float32 else 2e-2
    q = torch.randn(3, H, D, dtype=qdtype)
    want = reference.paged_decode_attention(q, kc, vc, bt, sl, 0.125)
    dev = [t.to(DEVICE) for t in (kc, vc, bt, sl)]
    for splits in (1, 2):
        got = paged_attention.paged_decode_attention(q.to(DEVICE), *dev, 0.125,
                                                     num_splits=splits)
        torch.testing.assert_close(got.cpu(), want, atol=tol, rtol=tol)
    qsl = torch.tensor([0, 10, 11, 30], dtype=torch.int32)
    qp = torch.randn(30, H, D, dtype=qdtype)
    want = reference.paged_prefill_attention(qp, kc, vc, bt, sl, qsl, 0.125)
    got = prefill_attention.paged_prefill_attention(qp.to(DEVICE), *dev, qsl.to(DEVICE), 0.125)
    torch.testing.assert_close(got.cpu(), want, atol=tol, rtol=tol)
