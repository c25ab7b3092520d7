"""``--cpu-linear-mode``: how each mode resolves (an explicit ``--dtype float32`` keeps
``auto`` exact, the greedy-parity setting), and ``GGUFLinear`` running each band's path on
the tiny GGUF's real Q8_0 / Q4_0 / Q4_1 layers, output for output."""

from __future__ import annotations

import pytest
import torch

from pagedserve.gpu import gguf_linear, linear_bands, loader
from pagedserve.gpu.linear_bands import ALL, plan_for
from pagedserve.kernels import gguf_ops


def test_modes_resolve_as_documented():
    f32, bf16 = torch.float32, torch.bfloat16
    assert plan_for("exact", "auto", f32, "avx2").bands == ((ALL, "exact"),)
    assert plan_for("exact", "auto", bf16, "avx512").bands == ((4, "exact"), (ALL, "dense"))
    assert plan_for("int8", "float32", f32, "avx2").bands == ((ALL, "int8"),)
    # auto: exact whenever float32 is asked for by name; else the measured table.
    assert plan_for("auto", "float32", f32, "avx2") == plan_for("exact", "float32", f32, "avx2")
    for (tier, dtype), bands in linear_bands.AUTO_BANDS.items():
        plan = plan_for("auto", "auto", getattr(torch, dtype), tier)
        assert plan.mode == "auto" and plan.bands == bands and plan.bands[-1][0] == ALL
    # A tier the table does not cover runs exact.
    assert plan_for("auto", "auto", f32, "generic").bands == ((ALL, "exact"),)
    with pytest.raises(ValueError, match="unknown --cpu-linear-mode"):
        plan_for("fast", "auto", f32, "avx2")


def test_describe_names_every_band():
    plan = linear_bands.LinearPlan("auto", ((2, "int8"), (8, "exact"), (ALL, "dense")), "avx2")
    assert plan.describe() == [{"rows": "1-2", "path": "int8"}, {"rows": "3-8", "path": "exact"},
                               {"rows": "9+", "path": "dense"}]
    assert [plan.path_for(r) for r in (1, 2, 3, 8, 9, 10**6)] == [
        "int8", "int8", "exact", "exact", "dense", "dense"]


def test_each_band_runs_its_path(tiny_gguf_path):
    config = loader.load_config(loader.resolve_model(str(tiny_gguf_path)).path)
    blocks, _ = gguf_ranks.read_blocks(tiny_gguf_path, config)
    plan = linear_bands.LinearPlan("auto", ((2, "int8"), (8, "exact"), (ALL, "dense")))
    seen = set()
    for name, (qtype, qweight) in blocks.items():
        n, k = qweight.shape[0], qweight.shape[1] // gguf_ops.GGUF_BLOCK_BYTES[qtype] * 32
        dense = torch.nn.Linear(k, n, bias=False)
        dense.weight.data = gguf_ops.gguf_dequantize(qweight, qtype, k)
        layer = gguf_linear.GGUFLinear(dense, qweight, qtype, plan)
        packed = gguf_ops.gguf_q8_repack(qweight, qtype, k)
        for rows in (1, 2, 3, 8, 9, 40):
            x = torch.randn(rows, k)
            want = (gguf_ops.gguf_q8_linear(x, packed, qtype, n) if rows <= 2
                    else gguf_ops.gguf_linear(x, qweight, qtype) if rows <= 8 else dense(x))
            assert torch.equal(layer(x), want), (name, rows)
        seen.add(qtype)
    assert seen == {2, 3, 8}
    # One mode's layer keeps only what its bands read.
    only_int8 = gguf_linear.GGUFLinear(dense, qweight, qtype, plan_for(
        "int8", "auto", torch.float32, None))
    assert only_int8.dense is None and only_int8.packed is not None
    exact = gguf_linear.GGUFLinear(dense, qweight, qtype)
    assert exact.dense is None and exact.packed is None and exact.max_rows == ALL
