"""LoRA adapters in mixed batches: greedy output equals transformers + peft (float32)."""

from __future__ import annotations

import asyncio
import random
import uuid

import pytest

from pagedserve.actors.engine import AsyncEngine
from pagedserve.gpu.lora.config import LoRAConfig
from pagedserve.gpu.lora.request import LoRARequest
from pagedserve.gpu.sampling_params import SamplingParams
from tests.conftest import engine_config, hf_greedy
from tests.lora_adapters import make_adapter, peft_greedy

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_model_dir):
    """Three adapters of the tiny Llama: rank 8 on everything; rank 4, rsLoRA, attention
    only; rank 16 on the MLP with an alpha_pattern."""
    root = tmp_path_factory.mktemp("lora")
    return {
        "a8": make_adapter(tiny_model_dir, root / "a8", 1, rank=8, alpha=16),
        "r4": make_adapter(tiny_model_dir, root / "r4", 2, rank=4, alpha=8, use_rslora=True,
                           targets=["q_proj", "k_proj", "v_proj", "o_proj"], std=0.1),
        "m16": make_adapter(tiny_model_dir, root / "m16", 3, rank=16, alpha=32,
                            targets=["gate_proj", "up_proj", "down_proj"],
                            alpha_pattern={"down_proj": 8}),
    }


def _prompts(n: int, seed: int, length: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length + i)] for i in range(n)]


def _lora_engine_config(model_dir, max_loras: int = 2, max_cpu_loras: int | None = None, **kw):
    config = engine_config(model_dir, **kw)
    config.model.lora = LoRAConfig(enable_lora=True, max_loras=max_loras, max_lora_rank=16,
                                   max_cpu_loras=max_cpu_loras)
    config.scheduler.max_loras = max_loras
    return config


async def _run(engine: AsyncEngine, jobs: list[tuple[list[int], LoRARequest | None]]):
    async def one(ids, lora):
        out: list[int] = []
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        async for d in engine.generate(uuid.uuid4().hex, ids, params, lora_request=lora):
            out.extend(d.token_ids)
        return out

    return list(await asyncio.gather(*(one(ids, lora) for ids, lora in jobs)))


def _oracle(model_dir, adapters, jobs):
    return [hf_greedy(model_dir, ids, MAX_TOKENS) if lora is None
            else peft_greedy(model_dir, adapters[lora.lora_name], ids, MAX_TOKENS)[:MAX_TOKENS]
            for ids, lora in jobs]


async def test_mixed_batch_equals_peft_chunked_and_cached(tiny_model_dir, adapters):
    """Base rows and two adapters in the same steps, prompts chunked (budget 32 < prompt),
    run twice: the second run's prompts come from the prefix cache, per adapter."""
    loras = {n: LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(adapters.items())}
    prompts = _prompts(3, 0)
    jobs = [(prompts[0], None), (prompts[0], loras["a8"]), (prompts[0], loras["r4"]),
            (prompts[1], loras["a8"]), (prompts[2], None)]
    want = _oracle(tiny_model_dir, adapters, jobs)
    assert want[0] != want[1] != want[2]  # the adapters change the output
    engine = await AsyncEngine.start(_lora_engine_config(
        tiny_model_dir, max_num_batched_tokens=32, block_size=8))
    try:
        assert await _run(engine, jobs) == want
        assert await _run(engine, jobs) == want  # prefix-cached now
        stats = await engine.get_stats()
        assert stats.kv_cache.hits > 0 if hasattr(stats.kv_cache, "hits") else True
    finally:
        await engine.shutdown()
