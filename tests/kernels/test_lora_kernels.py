"""The LoRA BGMV kernels (C++ per ISA tier, Triton under the interpreter) equal the torch
reference (``gpu/lora/punica.py``): mixed slots, rows without an adapter, zero-padded ranks;
the C++ kernel's tiles (1 to 5 rows of a slot, ranks whose parts do not fill its blocks) and
its OpenMP split, which changes no bit."""

from __future__ import annotations

import pytest
import torch

from pagedserve.gpu.lora import punica
from pagedserve.kernels import cpu_isa, cpu_ops, lora_ops
from tests.triton_interpreter import KERNEL_DEVICE

MIXED = [0, 0, 2, -1, 1, 1, 1, -1, 2, 0, -1, 1, 2]
# Slot 0 one row, slot 1 two, slot 2 five (a full tile of four and one more), base rows between.
TILES = [2, -1, 1, 2, 0, 2, -1, 1, 2, 2]


def _case(dtype, device="cpu", seed=0, slot_of_row=MIXED, fan_in=72, rank=8,
          parts=(24, 8, 8)):
    g = torch.Generator().manual_seed(seed)
    rows, slots = len(slot_of_row), 3
    x = torch.randn(rows, fan_in, generator=g).to(dtype)
    a = torch.randn(slots, len(parts) * rank, fan_in, generator=g).to(dtype)
    b = [torch.randn(slots, n, rank, generator=g).to(dtype) for n in parts]
    token_slots = torch.tensor(slot_of_row, dtype=torch.int32)
    y = torch.randn(rows, sum(parts), generator=g).to(dtype)
    return [t.to(device) for t in (y, x, a)], [t.to(device) for t in b], token_slots.to(device)


def _groups(token_slots):
    return [(s, torch.nonzero(token_slots == s)[:, 0]) for s in range(3)
            if (token_slots == s).any()]


def test_sgmv_and_bgmv_references_agree():
    (y, x, a), b, slots = _case(torch.float32)
    want = punica.sgmv_add(y.clone(), x, a, b, _groups(slots))
    got = punica.bgmv_add(y.clone(), x, a, b, slots)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    no_adapter = slots < 0
    assert torch.equal(got[no_adapter], y[no_adapter]) and not torch.equal(got, y)


@pytest.mark.parametrize("isa", cpu_isa.supported())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_equals_reference(isa, dtype):
    (y, x, a), b, slots = _case(dtype)
    want = punica.bgmv_add(y.float().clone(), x.float(), a.float(), [t.float() for t in b],
                           slots)
    with cpu_ops.use_isa(isa):
        got = lora_ops.bgmv_add("cpu", y.clone(), x, a, b, slots)
    tol = 1e-4 if dtype == torch.float32 else 0.15
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=tol)
    assert torch.equal(got[slots < 0], y[slots < 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_equals_reference(dtype):
    (y, x, a), b, slots = _case(dtype, KERNEL_DEVICE)
    want = punica.bgmv_add(y.float().clone(), x.float(), a.float(), [t.float() for t in b],
                           slots)
    got = lora_ops.bgmv_add("triton", y.clone(), x, a, b, slots)
    tol = 1e-4 if dtype == torch.float32 else 0.15
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=tol)
    assert torch.equal(got[slots < 0], y[slots < 0])


@pytest.mark.parametrize("isa", cpu_isa.supported())
@pytest.mark.parametrize("kernel", ["cpu", "triton"])
def test_one_call_over_parts_sliced_from_one_tensor(kernel, isa):
    """The layers' layout: every part's B a slice of one ``[L, sum(out_p), R]`` tensor; the
    C++ kernel's one call per layer reads them transposed, ``[L, R, sum(out_p)]``."""
    device = "cpu" if kernel == "cpu" else KERNEL_DEVICE
    (y, x, a), b, slots = _case(torch.float32, device)
    cat = torch.cat(b, dim=1)
    views = list(cat.split([t.shape[1] for t in b], dim=1))
    bt = cat.transpose(1, 2).contiguous() if kernel == "cpu" else None
    want = punica.bgmv_add(y.clone(), x, a, b, slots)
    with cpu_ops.use_isa(isa):
        got = lora_ops.bgmv_add(kernel, y.clone(), x, a, views, slots, bt)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("isa", cpu_isa.supported())
@pytest.mark.parametrize("rank, parts", [(1, (40, 24, 8)), (2, (40, 24, 8)), (7, (17,)),
                                         (8, (17,)), (16, (33, 31))])
def test_cpu_kernel_tiles_of_every_size(isa, rank, parts):
    """Tiles of 1, 2 and 4+1 rows of a slot; shrinks of 3, 6, 7, 8 and 32 dots (the kernel
    runs 4 or 8 at a time); parts ending inside a vector."""
    (y, x, a), b, slots = _case(torch.float32, slot_of_row=TILES, fan_in=37, rank=rank,
                                parts=parts)
    want = punica.bgmv_add(y.clone(), x, a, b, slots)
    with cpu_ops.use_isa(isa):
        got = lora_ops.bgmv_add("cpu", y.clone(), x, a, b, slots)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got[slots < 0], y[slots < 0])


@pytest.mark.parametrize("isa", cpu_isa.supported())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_threads_change_no_bit(isa, dtype):
    """A step big enough to run under OpenMP: each output is summed by one thread in the same
    order, so four threads give one thread's result exactly, and both equal the reference."""
    slot_of_row = [(i * 7) % 4 - 1 for i in range(64)]  # slots 0-2 and base rows, interleaved
    # 48 rows x (48 x 600 + 16 x 384) = 1.7 M multiply-adds: past the kernel's kParallelMin.
    (y, x, a), b, slots = _case(dtype, slot_of_row=slot_of_row, fan_in=600, rank=16,
                                parts=(256, 64, 64))
    threads = torch.get_num_threads()
    try:
        with cpu_ops.use_isa(isa):
            torch.set_num_threads(1)
            one = lora_ops.bgmv_add("cpu", y.clone(), x, a, b, slots)
            torch.set_num_threads(4)
            four = lora_ops.bgmv_add("cpu", y.clone(), x, a, b, slots)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, four)
    want = punica.bgmv_add(y.float().clone(), x.float(), a.float(), [t.float() for t in b],
                           slots)
    tol = 1e-4 if dtype == torch.float32 else 0.15
    torch.testing.assert_close(four.float(), want, rtol=1e-2, atol=tol)
