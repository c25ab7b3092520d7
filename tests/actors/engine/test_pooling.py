"""Pooling requests through the scheduler (issue 32): chunked prefill and the prefix cache
leave each pooled vector equal to transformers' (a tiny random Llama, float32, ``--convert
embed``), and every block comes back; a recompute from position 0 (preemption) starts the
pooler's partial state afresh."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from pagedserve.actors.engine.async_engine import AsyncEngine
from pagedserve.gpu.batch import ScheduledRequest
from pagedserve.gpu.pooling.pooler import Pooler
from pagedserve.gpu.pooling.pooling_params import PoolerConfig, PoolingParams, PoolingType
from pagedserve.gpu.sample.sampling_params import SamplingParams
from tests.conftest import engine_config
from tests.server.pooling_models import hf_embeddings


def prompts(n: int, length: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(100, 40000) for _ in range(length // 2)]  # a common prefix
    return [shared + [rng.randrange(100, 40000) for _ in range(length - len(shared))]
            for _ in range(n)]


async def start(model_dir, pooling: PoolingType, **kw) -> AsyncEngine:
    config = engine_config(model_dir, **kw)
    config.model.convert = "embed"
    config.model.pooler_config = PoolerConfig(pooling)
    return await AsyncEngine.start(config)


@pytest.mark.parametrize("pooling", [PoolingType.MEAN, PoolingType.CLS, PoolingType.LAST])
async def test_preempted_chunked_pooling_equals_transformers(tiny_model_dir, pooling):
    """8 prompts of 70 tokens sharing 35, in 40-token steps: chunked, several in one step,
    the prefix cache read by LAST only, yet each vector is exact."""
    ids = prompts(8, 70)
    want = hf_embeddings(tiny_model_dir, [], pooling.value, normalize=False, ids=ids)
    engine = await start(tiny_model_dir, pooling, num_blocks=24, max_num_batched_tokens=40,
                         max_model_len=128)
    try:
        outs = await asyncio.gather(*(engine.encode(f"r{i}", p, PoolingParams(normalize=False))
                                      for i, p in enumerate(ids)))
        s = await engine.get_stats()
    finally:
        await engine.shutdown()
    for out, w in zip(outs, want, strict=True):
        torch.testing.assert_close(torch.tensor(out.data), w, atol=1e-5, rtol=0)
    assert s.kv_cache.num_free_blocks == s.kv_cache.num_blocks
    assert s.scheduler.num_pooling_finished_total == len(ids)
    hits = s.kv_cache.prefix_cache_hits
    assert hits == 0 if pooling.needs_whole_prompt else hits > 0  # the shared prefix


async def test_a_generation_engine_refuses_pooling(tiny_model_dir):
    engine = await AsyncEngine.start(engine_config(tiny_model_dir))
    try:
        assert engine.info.runner == "generate" and engine.info.pooling is None
        with pytest.raises(ValueError, match="--runner pooling"):
            await engine.encode("r", [1, 2, 3], PoolingParams())
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("pooling", [PoolingType.MEAN, PoolingType.CLS])
def test_a_recompute_from_zero_drops_the_partial_pool(pooling):
    """Chunks 0-4 and 4-8, then the request is preempted and recomputed 0-6 and 6-10: the
    pooled vector is that of rows 0-10 of the recompute only."""
    torch.manual_seed(0)
    first, again = torch.randn(8, 4), torch.randn(10, 4)
    pooler = Pooler(pooling)

    def chunk(rows, start, end, last):
        sr = ScheduledRequest("r", list(range(start, end)), start, [0], SamplingParams(),
                              sample=last, pooling_params=PoolingParams(normalize=False))
        return pooler.pool(rows[start:end], [sr])

    assert chunk(first, 0, 4, False) == chunk(first, 4, 8, False) == {}
    assert chunk(again, 0, 6, False) == {}
    (got,) = chunk(again, 6, 10, True).values()
    want = again.mean(0) if pooling is PoolingType.MEAN else again[0]
    torch.testing.assert_close(torch.tensor(got), want)
    assert pooler.partial == {}
