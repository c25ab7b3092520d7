"""The int8-activation GGUF kernel (``--cpu-linear-mode int8``): every variant the CPU runs
(portable loop, the tier's maddubs loop, its VNNI loop) on every ISA tier (the ``isa``
fixture) equals ``kernels/q8_reference.py``'s torch arithmetic, for every type, at
row counts that fill the 8-, 4- and 3-row tiles and ragged ones (from 9 rows without VNNI, the
K-quant codes the first tile of a panel decodes for the others; at 300 rows of 2048, three
passes of the 256 KB row blocks), output counts that fill the 16-row panels
and ragged ones (the half panels of AVX2's 8 lanes too), writing every output (NaN-poisoned
buffers), float32 and bfloat16 activations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from pagedserve.gpu import gguf_linear
from pagedserve.kernels import gguf_ops, q8_reference
from tests.kernels.gguf_blocks import EXACT_ONLY, TYPES, random_blocks, width

pytestmark = pytest.mark.usefixtures("isa")


def _x(rows: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0.0  # an all-zero block: scale 0, codes 0
    return x


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 37, 320), (2, 8, 64), (3, 33, 96),
                                              (4, 48, 576), (5, 37, 320), (9, 5, 32),
                                              (70, 37, 192), (300, 19, 2048)])
def test_every_variant_equals_the_torch_reference(qtype, rows, n, k):
    k = width(qtype, k)  # K-quants: whole 256-weight blocks
    blocks, values = random_blocks(qtype, n, k, seed=rows * 7 + n)
    x = _x(rows, k, seed=rows + k)
    want = q8_reference.gguf_q8_linear(x, blocks, int(qtype))
    # The int8 arithmetic is a close approximation of the float product, not equal to it.
    exact = x @ values.T
    assert (want - exact).abs().max() < 0.05 * exact.abs().max()
    packed = gguf_ops.gguf_q8_repack(blocks, int(qtype), k)
    assert packed.shape == (-(-n // 16) * 16, gguf_ops.row_bytes(int(qtype), k, packed=True))
    # The panels hold the same weights: rows read back equal gguf-py's, bit for bit.
    index = torch.tensor([n - 1, 0, n // 2, n - 1])
    assert torch.equal(gguf_ops.gguf_q8_dequantize_rows(packed, int(qtype), k, index),
                       values[index])
    # Float32 sums in the kernels' order against float64: a few ulp of the largest output (at
    # K = 2048 outputs reach ~400, and ones near zero meet that absolute error).
    atol = max(1e-5, 2e-6 * float(want.abs().max()))
    for variant in gguf_ops.q8_variants():
        out = torch.full((rows, n), float("nan"))
        got = gguf_ops.gguf_q8_linear(x, packed, int(qtype), n, variant=variant, out=out)
        assert got.data_ptr() == out.data_ptr() and not got.isnan().any(), variant
        torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=variant)
        xb = x.bfloat16()  # bfloat16 in and out: the widened input, the result rounded once
        want_b = q8_reference.gguf_q8_linear(xb, blocks, int(qtype)).bfloat16()
        got_b = gguf_ops.gguf_q8_linear(xb, packed, int(qtype), n, variant=variant,
                                        out=torch.full((rows, n), float("nan"),
                                                       dtype=torch.bfloat16))
        torch.testing.assert_close(got_b.float(), want_b.float(), rtol=8e-3, atol=1e-2,
                                   msg=variant)


def test_reference_quantizes_like_llama_cpp_q8_0():
    """The activation codes are gguf-py's Q8_0 of the same block (its scale is then rounded to
    fp16, ours stays float32): the round-to-nearest of x * 127 / amax."""
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    q, d = q8_reference.quantize_activations(x)
    ref = quants.quantize(x.numpy(), GGMLQuantizationType.Q8_0).reshape(3, 2, 34)
    codes = torch.from_numpy(ref[..., 2:].copy().view(np.int8)).to(torch.int32)
    assert (q - codes).abs().max() <= 1  # fp16 scale vs ours: at most a tie apart
    assert (q == codes).float().mean() > 0.97
    torch.testing.assert_close(d * 127, x.reshape(3, 2, 32).abs().amax(-1))


def test_reference_quantizes_k_quant_activations_per_256():
    """Against K-quants one scale covers 256 values (llama.cpp's Q8_K size): every 32-block of
    a group carries the group's scale, and the codes are the round of x / d with it."""
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(2))
    x[0, 3] = 9.0  # one large value sets the scale of its whole group of 256
    q, d = q8_reference.quantize_activations(x, 256)
    assert d.shape == (2, 16) and q.shape == (2, 16, 32)
    torch.testing.assert_close(d[0, :8], torch.full((8,), 9.0 / 127))
    assert d[0, 8] != d[0, 0] and (d[0, 8:] == d[0, 8]).all()
    assert q[0, 0, 3] == 127
    want = torch.round(x.reshape(2, 16, 32) / d[..., None]).to(torch.int32)
    assert (q - want).abs().max() <= 1 and (q == want).float().mean() > 0.99


def test_rejects_bad_input():
    blocks, _ = random_blocks(GGMLQuantizationType.Q4_1, 8, 64, seed=0)
    packed = gguf_ops.gguf_q8_repack(blocks, 3, 64)
    x = torch.randn(2, 3, 64)
    assert gguf_ops.gguf_q8_linear(x, packed, 3, 8).shape == (2, 3, 8)
    with pytest.raises(ValueError, match="not one of"):
        gguf_ops.gguf_q8_linear(x, packed, 3, 8, variant="amx")
    with pytest.raises(ValueError, match="out must be"):
        gguf_ops.gguf_q8_linear(x, packed, 3, 8, out=torch.empty(6, 9))
    with pytest.raises(ValueError, match="qweight must be"):
        gguf_ops.gguf_q8_linear(torch.randn(1, 96), packed, 3, 8)
    with pytest.raises(ValueError, match="padded to 16"):
        gguf_ops.gguf_q8_linear(x, blocks, 3, 8)  # not repacked: 8 rows


@pytest.mark.parametrize("qtype", EXACT_ONLY)
def test_types_without_panels_are_refused_and_run_exact(qtype):
    """Q2_K, Q3_K, IQ4_NL, IQ4_XS have no int8 kernel: repacking says so, and a layer asked for
    int8 keeps the file's rows for the exact kernel (still no de-quantized copy)."""
    k = width(qtype, 256)
    blocks, values = random_blocks(qtype, 5, k, seed=1)
    with pytest.raises(ValueError, match="no int8 kernel"):
        gguf_ops.gguf_q8_repack(blocks, int(qtype), k)
    part = gguf_linear.quantized_part(blocks, int(qtype), k, "int8")
    assert part.path == "exact" and torch.equal(part.weight, blocks)
    x = torch.randn(3, k)
    torch.testing.assert_close(part.run(x), x @ values.T, rtol=1e-5, atol=1e-4)
