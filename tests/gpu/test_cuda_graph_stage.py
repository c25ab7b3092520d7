"""What a rank's decode graphs read and write besides the decode batch (``gpu/cuda_graph.py``'s
``StageBuffers``): pure layout logic, so it runs on the CPU; the graphs themselves need CUDA
(``loadtest/device_check_parallel.py`` runs them on a lent GPU machine)."""

from __future__ import annotations

import torch

from pagedserve.gpu import loader
from pagedserve.gpu.cuda_graph import StageBuffers
from pagedserve.gpu.parallel.layout import rank_layout

CPU = torch.device("cpu")


def test_which_stage_receives_and_sends(tiny_model_dir):
    """pp=2 × tp=2 (ranks stage-major): stage 0 sends and does not receive, stage 1 receives
    and does not send, on each of its tensor-parallel ranks; one process neither sends nor receives."""
    config = loader.load_config(tiny_model_dir)  # 2 layers
    got = [(b.receives, b.sends, b.flat is not None) for b in (
        StageBuffers.of(rank_layout(config, 2, 2, r), 8, 64, torch.float32, CPU)
        for r in range(4))]
    assert got == [(False, True, False)] * 2 + [(True, False, True)] * 2
    alone = StageBuffers.of(None, 8, 64, torch.float32, CPU)
    assert (alone.receives, alone.sends, alone.received(4)) == (False, False, None)
    tp_only = StageBuffers.of(rank_layout(config, 2, 1, 1), 8, 64, torch.float32, CPU)
    assert (tp_only.receives, tp_only.sends) == (False, False)


def test_received_views_are_contiguous_at_fixed_addresses(tiny_model_dir):
    """A graph of ``b`` rows reads ``[2, b, hidden]`` at one address (captured once, refilled by
    ``recv`` before each replay, which wants a contiguous tensor): hidden then residual."""
    config = loader.load_config(tiny_model_dir)
    stage = StageBuffers.of(rank_layout(config, 1, 2, 1), 8, 64, torch.bfloat16, CPU)
    assert stage.flat.shape == (2 * 8 * 64,) and stage.flat.dtype == torch.bfloat16
    for b in (1, 2, 4, 8):
        view = stage.received(b)
        assert view.shape == (2, b, 64) and view.is_contiguous()
        assert view.data_ptr() == stage.flat.data_ptr() == stage.received(b).data_ptr()
    packed = torch.stack((torch.full((4, 64), 1.0), torch.full((4, 64), 2.0)))
    stage.received(4).copy_(packed)  # what ``recv_packed`` writes
    assert torch.equal(stage.flat[: 4 * 64], torch.ones(4 * 64, dtype=torch.bfloat16))
    assert torch.equal(stage.received(4)[1], torch.full((4, 64), 2.0, dtype=torch.bfloat16))
