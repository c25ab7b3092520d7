"""The GGUF block kernels: de-quantization bit-equal to gguf-py's (what transformers loads), and
``gguf_linear`` equal to a float64 product over those weights on every loop (the register path
up to 8 rows, the panel path above, the portable loops), in float32 and bfloat16, on every ISA
tier the CPU runs (the ``isa`` fixture)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from pagedserve.kernels import gguf_ops
from tests.kernels.gguf_blocks import EXACT_TYPES, block_weights, random_blocks, width

pytestmark = pytest.mark.usefixtures("isa")


@pytest.mark.parametrize("qtype", EXACT_TYPES)
def test_dequantize_is_bit_equal_to_gguf_py(qtype):
    blocks, values = random_blocks(qtype, 33, 512)
    bb = gguf_ops.GGUF_BLOCK_BYTES[int(qtype)]
    assert blocks.shape[1] == 512 // block_weights(qtype) * bb
    assert torch.equal(gguf_ops.gguf_dequantize(blocks, int(qtype), 512), values)


@pytest.mark.parametrize("qtype", EXACT_TYPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 70])  # 70: two 64-row chunks
@pytest.mark.parametrize("generic", [False, True])
def test_linear_equals_float64_product(qtype, rows, generic):
    # n not a multiple of the 4-row panel; k of 16-wide vectors and blocks (K-quants: 2 blocks)
    n, k = 37, width(qtype, 320)
    blocks, values = random_blocks(qtype, n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    want = x.double() @ values.double().T
    got = gguf_ops.gguf_linear(x, blocks, int(qtype), generic=generic)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    # bfloat16 in and out: the same float32 products of the rounded input, rounded once.
    xb = x.bfloat16()
    got_b = gguf_ops.gguf_linear(xb, blocks, int(qtype), generic=generic)
    want_b = (xb.double() @ values.double().T).bfloat16()
    assert got_b.dtype == torch.bfloat16
    torch.testing.assert_close(got_b.float(), want_b.float(), rtol=8e-3, atol=1e-2)


def test_linear_keeps_leading_dims_and_rejects_bad_input():
    blocks, values = random_blocks(GGMLQuantizationType.Q4_1, 8, 64)
    x = torch.randn(2, 3, 64)
    out = gguf_ops.gguf_linear(x, blocks, 3)
    assert out.shape == (2, 3, 8)
    torch.testing.assert_close(out, x @ values.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="has no kernel here"):
        gguf_ops.gguf_linear(x, blocks, int(GGMLQuantizationType.IQ2_XXS))
    with pytest.raises(ValueError, match="not whole Q4_K blocks"):
        gguf_ops.gguf_linear(x, blocks, int(GGMLQuantizationType.Q4_K))
    with pytest.raises(ValueError, match="qweight must be"):
        gguf_ops.gguf_linear(torch.randn(1, 96), blocks, 3)  # rows are 64 weights, not 96
    with pytest.raises(ValueError, match="float32 and bfloat16"):
        gguf_ops.gguf_linear(x.half(), blocks, 3)
