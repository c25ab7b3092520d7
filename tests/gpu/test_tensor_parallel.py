"""Tensor and pipeline parallelism inside the model: the logits of a model split over spawned
gloo ranks equal the single-process model's (float32), step after step over the paged KV
cache (a prefill of two prompts, then a decode of each)."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from pagedserve.gpu import loader
from pagedserve.gpu.batch import ScheduledRequest, order_batch
from pagedserve.gpu.config import CacheConfig, ModelConfig
from pagedserve.gpu.model_runner import ModelRunner
from pagedserve.gpu.parallel.comm import ParallelContext, free_port
from pagedserve.gpu.parallel.layout import check_layout, rank_layout, stage_layers
from pagedserve.gpu.sample.sampling_params import SamplingParams
from pagedserve.gpu.step_inputs import prepare_inputs

PROMPTS = [[1, 17, 300, 4000, 12, 99, 5], [1, 2000, 3, 48000, 777, 31, 8, 9, 10, 11, 12, 13]]


def _steps() -> list[list[ScheduledRequest]]:
    greedy = SamplingParams(temperature=0.0)
    prefill = [ScheduledRequest(f"r{i}", p, 0, [2 * i, 2 * i + 1], greedy, True, len(p))
               for i, p in enumerate(PROMPTS)]
    decode = [ScheduledRequest(f"r{i}", [42 + i], len(p), [2 * i, 2 * i + 1], greedy, True,
                               len(p)) for i, p in enumerate(PROMPTS)]
    return [order_batch(prefill), order_batch(decode)]


def _runner(path: str, parallel: ParallelContext | None = None) -> ModelRunner:
    return ModelRunner(ModelConfig(model=path, dtype="float32", max_model_len=64),
                       CacheConfig(num_gpu_blocks_override=8, block_size=8), 64, 4,
                       parallel=parallel)


def _logits(runner: ModelRunner) -> list[torch.Tensor | None]:
    runner.load()
    with torch.inference_mode():
        return [runner.model(prepare_inputs(s, runner.block_size, runner.device),
                             runner.kv_caches) for s in _steps()]


def _rank(path: str, layouts: list[tuple[int, int]], rank: int, ports: list[int],
          results) -> None:
    """One process, one rank of each layout in turn (one spawn for all: imports dominate)."""
    os.environ["PAGEDSERVE_CPU_THREADS"] = "1"  # one thread per rank, no governor
    torch.set_num_threads(1)
    config = loader.load_config(loader.resolve_model(path).path)
    for (tp, pp), port in zip(layouts, ports):
        layout = rank_layout(config, tp, pp, rank)
        parallel = ParallelContext.init(layout, f"tcp://127.0.0.1:{port}", torch.device("cpu"))
        try:
            out = _logits(_runner(path, parallel))
            gathers_agree = _gathers_agree(parallel)
        finally:
            parallel.destroy()
        # As numpy arrays: pickled by value (a tensor would go by a file descriptor that
        # dies with this process).
        if layout.is_driver:
            results.put(((tp, pp), ([t.numpy() for t in out], gathers_agree)))


def _gathers_agree(parallel: ParallelContext) -> bool | None:
    """The logits' all-gather that CUDA runs (inside decode graphs), here over gloo, against
    the gather the CPU runs: on the stage's first rank the same ``[N, vocab]`` (3 padding
    columns dropped), on the others ``None`` from both. ``None`` without tensor parallelism."""
    tp, tp_rank = parallel.layout.tp_size, parallel.layout.tp_rank
    if tp == 1:
        return None
    part = torch.arange(15, dtype=torch.float32).view(3, 5) + 100 * tp_rank
    want = parallel.gather_logits(part, 5 * tp - 3)
    have = parallel._all_gather_logits(part, 5 * tp - 3)
    if tp_rank != 0:
        return want is None and have is None
    return want.shape == (3, 5 * tp - 3) and torch.equal(have, want)


def parallel_logits(path: str, layouts: list[tuple[int, int]]) -> dict:
    """``{(tp, pp): (logits of each step, whether the driver's two gathers agreed)}``, every
    layout over the same 4 processes."""
    ctx = mp.get_context("spawn")
    results, ports = ctx.Queue(), [free_port() for _ in layouts]
    procs = [ctx.Process(target=_rank, args=(path, layouts, r, ports, results))
             for r in range(4)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=300) for _ in layouts)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return {k: ([torch.from_numpy(a) for a in v], agree) for k, (v, agree) in got.items()}


@pytest.fixture(scope="module")
def single_logits(tiny_model_dir) -> list[torch.Tensor]:
    return _logits(_runner(str(tiny_model_dir)))


def test_parallel_logits_equal_single_process(tiny_model_dir, single_logits):
    """tp=2 × pp=2: the split heads, MLP and vocabulary and the stage-to-stage send; tp=4
    (more ranks than the 2 KV heads): the replicated KV heads. (tp=2 and pp=2 alone pass
    too; the server runs tp=2 × pp=2 in tests/server/test_parallel_serving.py.)"""
    layouts = [(2, 2), (4, 1)]
    got = parallel_logits(str(tiny_model_dir), layouts)
    for layout in layouts:
        assert got[layout][1] is True, f"{layout}: all-gather of the logits != gather"
        for step, (want, have) in enumerate(zip(single_logits, got[layout][0])):
            assert have.shape == want.shape
            torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5,
                                       msg=f"{layout} step {step}")
            assert torch.equal(have.argmax(-1), want.argmax(-1))


def test_layout_refuses_a_tp_that_does_not_divide_the_heads(tiny_model_dir):
    config = loader.load_config(tiny_model_dir)  # 4 heads, 2 KV heads, 2 layers
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads; sizes "
                                         "that work for this model: 1, 2, 4$"):
        check_layout(config, 3, 1)
    with pytest.raises(ValueError, match="more than the model's 2 layers"):
        check_layout(config, 1, 3)
    # tp=4 > 2 KV heads: each KV head on two ranks, as vLLM replicates them.
    assert [rank_layout(config, 4, 1, r).kv_heads for r in range(4)] == [
        (0, 1), (0, 1), (1, 2), (1, 2)]
    assert [stage_layers(5, 2, s) for s in range(2)] == [(0, 3), (3, 5)]
