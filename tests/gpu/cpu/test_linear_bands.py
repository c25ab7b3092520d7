"""``--cpu-linear-mode``: how each mode resolves (an explicit ``--dtype float32`` keeps
``auto`` exact, the greedy-parity setting), and ``GGUFLinear`` running each band's path on
the tiny GGUF's real Q8_0 / Q4_0 / Q4_1 layers, output for output."""

from __future__ import annotations

import pytest
import torch

from pagedserve.gpu import gguf_linear, loader
from pagedserve.gpu.cpu import linear_bands
from pagedserve.gpu.cpu.linear_bands import ALL, plan_for
from pagedserve.gpu.parallel import gguf_ranks
from pagedserve.kernels import gguf_ops


def test_modes_resolve_as_documented():
    f32, bf16 = torch.float32, torch.bfloat16
    assert plan_for("exact", "auto", f32, "avx2").bands == ((ALL, "exact"),)
    # bfloat16 too: no de-quantized copy for large batches any more.
    assert plan_for("exact", "auto", bf16, "avx512").bands == ((ALL, "exact"),)
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


def test_a_plan_names_one_path():
    plan = linear_bands.LinearPlan("auto", ((2, "int8"), (ALL, "int8")), "avx2")
    assert plan.describe() == [{"rows": "1-2", "path": "int8"}, {"rows": "3+", "path": "int8"}]
    assert plan.path == "int8" and plan.path_for(10**6) == "int8"
    # A layer holds one form of its weights: a plan needing two is refused, as is "dense".
    with pytest.raises(ValueError, match="one path"):
        linear_bands.LinearPlan("auto", ((2, "int8"), (ALL, "exact")))
    with pytest.raises(ValueError, match="one path"):
        linear_bands.LinearPlan("exact", ((ALL, "dense"),))


def test_each_path_runs_its_kernel(tiny_gguf_path):
    config = loader.load_config(loader.resolve_model(str(tiny_gguf_path)).path)
    blocks, _ = gguf_ranks.read_blocks(tiny_gguf_path, config)
    seen = set()
    for name, (qtype, qweight) in blocks.items():
        n, k = qweight.shape[0], qweight.shape[1] // gguf_ops.GGUF_BLOCK_BYTES[qtype] * 32
        exact = gguf_linear.GGUFLinear([gguf_linear.quantized_part(qweight, qtype, k, "exact")],
                                       k)
        int8 = gguf_linear.GGUFLinear([gguf_linear.quantized_part(qweight, qtype, k, "int8")],
                                      k)
        assert int8.parts[0].path == "int8"
        packed = gguf_ops.gguf_q8_repack(qweight, qtype, k)
        assert torch.equal(int8.parts[0].weight, packed)  # the panels replace the rows
        for rows in (1, 3, 40):
            x = torch.randn(rows, k)
            assert torch.equal(exact(x), gguf_ops.gguf_linear(x, qweight, qtype)), name
            assert torch.equal(int8(x), gguf_ops.gguf_q8_linear(x, packed, qtype, n)), name
        seen.add(qtype)
    assert seen == {2, 3, 8}
