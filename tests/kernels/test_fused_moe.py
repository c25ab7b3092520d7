"""The mixture-of-experts paths equal the plain per-token sum (``fused_moe.reference_moe``):
the CPU path grouped by expert (``gpu/fused_moe.py``) and the Triton grouped GEMM
(``kernels/fused_moe.py``, in Triton's interpreter without CUDA), on tiny shapes with an
expert no token picks and an expert whose rows span several tiles."""

from __future__ import annotations

import pytest
import torch

from pagedserve.gpu.cpu import gemm as cpu_gemm
from pagedserve.gpu.fused_moe import (
    FusedMoE,
    moe_grouped,
    reference_moe,
    select_experts,
)
from pagedserve.gpu.layer_ops import TorchLayerOps
from tests.triton_interpreter import KERNEL_DEVICE as DEVICE

E, H, I, K = 6, 64, 32, 2  # noqa: E741  (the MoE papers' names)


def _case(t: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g).to(dtype)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * 0.2).to(dtype)
    down = (torch.randn(E, H, I, generator=g) * 0.2).to(dtype)
    logits = torch.randn(t, E, generator=g)
    logits[:, 5] = -30  # expert 5: never picked
    logits[: t // 2, 0] = 30  # expert 0: half the tokens, more than one 16-row tile
    weights, ids = select_experts(logits, K, renormalize=True)
    return x, gate_up, down, weights, ids


def test_select_experts_renormalises_the_top_k():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    w, ids = select_experts(logits, 2, renormalize=True)
    p = torch.softmax(logits, -1)[0]
    assert ids.tolist() == [[3, 2]]
    torch.testing.assert_close(w, torch.stack([p[3], p[2]])[None] / (p[3] + p[2]))
    w_raw, _ = select_experts(logits, 2, renormalize=False)
    torch.testing.assert_close(w_raw, torch.stack([p[3], p[2]])[None])


def test_cpu_grouped_path_equals_the_per_token_sum():
    x, gate_up, down, weights, ids = _case(40, 1)
    layer = FusedMoE(E, H, I, TorchLayerOps())
    with torch.no_grad():
        layer.gate_up_proj.copy_(gate_up)
        layer.down_proj.copy_(down)
        got = layer(x, weights, ids)
    torch.testing.assert_close(got, reference_moe(x, gate_up, down, weights, ids),
                               atol=1e-5, rtol=1e-5)
    seen: list[int] = []  # each active expert is called once, over all of its rows
    moe_grouped(x, weights, ids, lambda e, rows: seen.append(e) or torch.zeros_like(rows))
    assert seen == sorted(set(ids.reshape(-1).tolist())) and 5 not in seen


def test_align_block_size_groups_pairs_by_expert_in_whole_tiles():
    from pagedserve.kernels.fused_moe import moe_align_block_size

    _, _, _, _, ids = _case(40, 2)
    sorted_ids, expert_ids = moe_align_block_size(ids, E, 16)
    flat, pairs = ids.reshape(-1), ids.numel()
    assert sorted(v for v in sorted_ids.tolist() if v < pairs) == list(range(pairs))
    for tile, e in enumerate(expert_ids.tolist()):
        rows = [v for v in sorted_ids[tile * 16:(tile + 1) * 16].tolist() if v < pairs]
        if e < 0:
            assert rows == []
        else:
            assert rows and all(flat[r] == e for r in rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_fused_moe_equals_the_per_token_sum(dtype):
    from pagedserve.kernels.fused_moe import fused_moe

    x, gate_up, down, weights, ids = _case(40, 3, dtype)
    want = reference_moe(x, gate_up, down, weights, ids)
    got = fused_moe(x.to(DEVICE), gate_up.to(DEVICE), down.to(DEVICE), weights.to(DEVICE),
                    ids.to(DEVICE)).cpu()
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert got.dtype == dtype and got.shape == (40, H)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.skipif(not cpu_gemm.can_pack(torch.bfloat16, torch.device("cpu")),
                    reason="no native oneDNN bfloat16 here")
def test_bfloat16_experts_packed_for_onednn_give_the_same_output():
    x, gate_up, down, weights, ids = _case(24, 4, torch.bfloat16)
    layer = FusedMoE(E, H, I, TorchLayerOps()).to(torch.bfloat16)
    with torch.no_grad():
        layer.gate_up_proj.copy_(gate_up)
        layer.down_proj.copy_(down)
        plain = layer(x, weights, ids)
        model = torch.nn.Sequential(layer)
        cpu_gemm.pack_linears(model)
        packed = layer(x, weights, ids)
    assert layer.packed is not None and layer.gate_up_proj.numel() == 0  # one copy kept
    torch.testing.assert_close(packed.float(), plain.float(), atol=2e-2, rtol=2e-2)
