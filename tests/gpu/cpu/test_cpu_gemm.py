"""Pre-packed bfloat16 linears give F.linear's output (exactly, at the row counts a decode step
and most prefill chunks have), and packing swaps every layer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedserve.gpu.cpu import gemm as cpu_gemm

pytestmark = pytest.mark.skipif(
    not cpu_gemm.can_pack(torch.bfloat16, torch.device("cpu")),
    reason="this CPU's oneDNN has no native bfloat16 (CI's machines do)",
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 33, 700, 2048])
def test_packed_equals_f_linear_bit_for_bit(bias, rows):
    torch.manual_seed(rows)
    linear = nn.Linear(576, 960, bias=bias).bfloat16()
    packed = cpu_gemm.PackedLinear(linear)
    x = torch.randn(rows, 576).bfloat16()
    assert torch.equal(packed(x), linear(x))
    x3 = torch.randn(2, 3, 576).bfloat16()  # leading dims are kept
    assert torch.equal(packed(x3), linear(x3))


def test_packed_within_one_bfloat16_step_where_onednn_blocks_differently():
    """At some large row counts (1,400 here) oneDNN tiles the two layouts differently and a
    few outputs differ by one bfloat16 step; the float32 parity path never packs."""
    torch.manual_seed(0)
    linear = nn.Linear(576, 960).bfloat16()
    x = torch.randn(1400, 576).bfloat16()
    want = linear(x)
    got = cpu_gemm.PackedLinear(linear)(x)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=8e-3)
    assert (got != want).float().mean() < 1e-3


def test_pack_linears_replaces_every_linear_and_keeps_the_rest():
    model = nn.Sequential(nn.Linear(64, 32), nn.SiLU(), nn.Sequential(nn.Linear(32, 8)))
    model = model.bfloat16()
    x = torch.randn(3, 64).bfloat16()
    want = model(x)
    assert cpu_gemm.pack_linears(model) == 2
    assert isinstance(model[0], cpu_gemm.PackedLinear) and isinstance(model[2][0],
                                                                    cpu_gemm.PackedLinear)
    assert isinstance(model[1], nn.SiLU)
    assert torch.equal(model(x), want)


def test_only_bfloat16_on_the_cpu_is_packed():
    assert not cpu_gemm.can_pack(torch.float32, torch.device("cpu"))
    assert not cpu_gemm.can_pack(torch.bfloat16, torch.device("cuda"))
