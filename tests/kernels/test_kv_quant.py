"""8-bit KV caches (``kernels/kv_quant.py``): the C write and reads against the torch reference
on every ISA tier this CPU runs, for each 8-bit dtype and both query dtypes."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_ops, kv_quant, reference

H, HKV, D, BS, NB = 6, 2, 64, 16, 20
QDTYPES = [torch.float32, torch.bfloat16]


def filled_caches(dtype: torch.dtype, qdtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    kc = torch.zeros(NB, BS, HKV, D + kv_quant.SCALE_BYTES, dtype=dtype)
    vc = torch.zeros_like(kc)
    n = NB * BS
    reference.reshape_and_cache(torch.randn(n, HKV, D, dtype=qdtype) * 3,
                                torch.randn(n, HKV, D, dtype=qdtype), kc, vc, torch.arange(n))
    return kc, vc


@pytest.mark.parametrize("dtype", kv_quant.DTYPES)
def test_quantize_error_is_within_half_a_step_of_the_row_scale(dtype):
    x = torch.randn(50, HKV, D) * torch.logspace(-3, 2, 50)[:, None, None]
    x[0] = 0  # an all-zero row: scale 0, codes 0, no NaN
    rows = kv_quant.quantize(x, dtype)
    back = kv_quant.dequantize(rows)
    assert rows.shape == (50, HKV, D + 4) and rows.dtype == dtype
    assert torch.equal(back[0], x[0])
    amax = x.abs().amax(-1, keepdim=True)
    # int8: half a code (amax / 254); fp8: half an ulp of the top binade (2^-4 e4m3, 2^-3 e5m2).
    rel = {torch.int8: 0.5 / 127, torch.float8_e4m3fn: 2**-4, torch.float8_e5m2: 2**-3}[dtype]
    assert ((back - x).abs() <= amax * rel * 1.0001).all()


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("dtype", kv_quant.DTYPES)
def test_write_gives_the_reference_bytes(isa, dtype, qdtype):
    torch.manual_seed(0)
    k, v = torch.randn(40, HKV, D, dtype=qdtype) * 2, torch.randn(40, HKV, D, dtype=qdtype)
    k[5, 1] = 0
    slots = torch.randperm(NB * BS)[:40]
    slots[3] = -1  # padding: not written
    want = [torch.zeros(NB, BS, HKV, D + 4, dtype=dtype) for _ in range(2)]
    got = [torch.zeros_like(want[0]) for _ in range(2)]
    reference.reshape_and_cache(k, v, *want, slots)
    # k, v as strided views of one fused row, as the model passes them
    kv = torch.cat([k, v], dim=1)
    cpu_ops.reshape_and_cache(kv[:, :HKV], kv[:, HKV:], *got, slots)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w.view(torch.uint8), g.view(torch.uint8))


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("dtype", kv_quant.DTYPES)
def test_decode_and_prefill_read_8bit_caches_as_the_reference(isa, dtype, qdtype):
    torch.manual_seed(1)
    kc, vc = filled_caches(dtype, qdtype)
    bt = torch.arange(NB, dtype=torch.int32).view(4, 5)
    sl = torch.tensor([70, 1, 33, 80], dtype=torch.int32)
    tol = 1e-5 if qdtype == torch.float32 else 2e-2
    q = torch.randn(4, H, D, dtype=qdtype)
    want = reference.paged_decode_attention(q, kc, vc, bt, sl, 0.125)
    got = cpu_ops.paged_decode_attention(q, kc, vc, bt, sl, 0.125)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    if not cpu_ops.prefill_supported(D):
        pytest.skip(f"no prefill kernel in the {isa} tier")
    qsl = torch.tensor([0, 10, 11, 20, 50], dtype=torch.int32)
    qp = torch.randn(50, H, D, dtype=qdtype)
    want = reference.paged_prefill_attention(qp, kc, vc, bt, sl, qsl, 0.125)
    got = cpu_ops.paged_prefill_attention(qp, kc, vc, bt, sl, qsl, 0.125)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_8bit_attention_is_close_to_full_precision():
    """The reference read itself: dequantized int8 attention against float32 attention of the
    same values (what the greedy agreement of the engine rests on)."""
    torch.manual_seed(2)
    k, v = torch.randn(NB * BS, HKV, D), torch.randn(NB * BS, HKV, D)
    full = [torch.zeros(NB, BS, HKV, D) for _ in range(2)]
    q8 = [torch.zeros(NB, BS, HKV, D + 4, dtype=torch.int8) for _ in range(2)]
    reference.reshape_and_cache(k, v, *full, torch.arange(NB * BS))
    reference.reshape_and_cache(k, v, *q8, torch.arange(NB * BS))
    bt, sl = torch.arange(NB, dtype=torch.int32).view(2, 10), torch.tensor([160, 99])
    q = torch.randn(2, H, D)
    want = reference.paged_decode_attention(q, *full, bt, sl, 0.125)
    got = reference.paged_decode_attention(q, *q8, bt, sl, 0.125)
    assert (got - want).abs().max() < 0.01


def test_mismatched_caches_are_refused_with_a_reason():
    q = torch.randn(2, H, D)
    kc = torch.zeros(NB, BS, HKV, D, dtype=torch.int8)  # no room for the scales
    bt, sl = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="scale bytes"):
        cpu_ops.paged_decode_attention(q, kc, kc.clone(), bt, sl, 0.125)
    with pytest.raises(ValueError, match="same dtype and head size"):
        cpu_ops.paged_decode_attention(q, kc.half(), kc.half(), bt, sl, 0.125)
    with pytest.raises(ValueError, match="not an 8-bit"):
        kv_quant.quantize(q, torch.float16)
