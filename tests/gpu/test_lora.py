"""LoRA adapters in mixed batches: greedy output equals transformers + peft (float32)."""

from __future__ import annotations

import asyncio
import random
import uuid

import pytest

from pagedserve.actors.engine.async_engine import AsyncEngine
from pagedserve.gpu.lora.config import LoRAConfig
from pagedserve.gpu.lora.request import LoRARequest
from pagedserve.gpu.sample.sampling_params import SamplingParams
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
        before = (await engine.get_stats()).kv_cache.prefix_cache_hits
        assert await _run(engine, jobs) == want  # prefix-cached now
        assert (await engine.get_stats()).kv_cache.prefix_cache_hits > before
    finally:
        await engine.shutdown()


async def _hits(engine: AsyncEngine, ids: list[int], lora: LoRARequest | None) -> int:
    before = (await engine.get_stats()).kv_cache.prefix_cache_hits
    await _run(engine, [(ids, lora)])
    return (await engine.get_stats()).kv_cache.prefix_cache_hits - before


async def test_prefix_cache_is_keyed_by_adapter(tiny_model_dir, adapters):
    """A prompt cached under one adapter is a miss for the base model and for another
    adapter, and a hit for the same adapter."""
    a8, r4 = LoRARequest("a8", 1, str(adapters["a8"])), LoRARequest("r4", 2, str(adapters["r4"]))
    ids = _prompts(1, 5, 48)[0]
    engine = await AsyncEngine.start(_lora_engine_config(tiny_model_dir, block_size=8))
    try:
        assert await _hits(engine, ids, a8) == 0
        assert await _hits(engine, ids, None) == 0
        assert await _hits(engine, ids, r4) == 0
        # A whole cached prompt still computes its last block (its last token is sampled).
        assert await _hits(engine, ids, a8) == 40
        assert await _hits(engine, ids, None) == 40
    finally:
        await engine.shutdown()


async def test_lru_eviction_unload_and_reload(tiny_model_dir, adapters):
    """One slot, two adapters held in memory, three used in turn (each evicts one), then a
    reload under a new id (an unload and load): outputs stay the oracle's throughout."""
    ids = _prompts(1, 9)[0]
    names = ["a8", "r4", "m16", "a8"]
    jobs = [(ids, LoRARequest(n, i + 1, str(adapters[n]))) for i, n in enumerate(names)]
    want = _oracle(tiny_model_dir, adapters, jobs)
    engine = await AsyncEngine.start(_lora_engine_config(tiny_model_dir, max_loras=1,
                                                         max_cpu_loras=2))
    try:
        for job, w in zip(jobs, want, strict=True):
            assert await _run(engine, [job]) == [w]
        # Several adapters at once with one slot: they take turns (the scheduler waits).
        assert await _run(engine, jobs[:3]) == want[:3]
    finally:
        await engine.shutdown()


async def test_adapter_on_kept_quantized_gguf_linears(tiny_gguf_path, adapters):
    """The delta on top of the GGUF's quantized linears (exact mode) equals peft over the
    file's de-quantized weights."""
    from pagedserve.gpu import loader

    folder = loader.convert_gguf(tiny_gguf_path)
    ids = _prompts(1, 3)[0]
    jobs = [(ids, LoRARequest("a8", 1, str(adapters["a8"]))), (ids, None)]
    want = [peft_greedy(folder, adapters["a8"], ids, MAX_TOKENS), hf_greedy(folder, ids,
                                                                           MAX_TOKENS)]
    engine = await AsyncEngine.start(_lora_engine_config(
        tiny_gguf_path, quantization="gguf", cpu_linear_mode="exact"))
    try:
        assert engine.info.quantization == "gguf"
        assert await _run(engine, jobs) == want
    finally:
        await engine.shutdown()


async def test_adapter_under_tensor_parallelism(tiny_model_dir, adapters):
    """Two ranks: B split by rows on q/k/v/gate/up, A by columns on o/down."""
    from pagedserve.gpu.config import ParallelConfig

    ids = _prompts(1, 4)[0]
    loras = {n: LoRARequest(n, i + 1, str(adapters[n])) for i, n in enumerate(adapters)}
    jobs = [(ids, loras["a8"]), (ids, loras["m16"]), (ids, None)]
    want = _oracle(tiny_model_dir, adapters, jobs)
    engine = await AsyncEngine.start(_lora_engine_config(
        tiny_model_dir, parallel=ParallelConfig(tensor_parallel_size=2)))
    try:
        assert await _run(engine, jobs) == want
    finally:
        await engine.shutdown()


async def test_torch_reference_path_equals_peft(tiny_model_dir, adapters, monkeypatch):
    """The torch SGMV path (what runs where no kernel does) in the same mixed, chunked steps."""
    from pagedserve.gpu import model_runner

    monkeypatch.setattr(model_runner, "lora_kernel", lambda *a: "torch")
    loras = {n: LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(adapters.items())}
    prompts = _prompts(2, 7)
    jobs = [(prompts[0], loras["m16"]), (prompts[1], None), (prompts[1], loras["r4"])]
    want = _oracle(tiny_model_dir, adapters, jobs)
    engine = await AsyncEngine.start(_lora_engine_config(tiny_model_dir,
                                                         max_num_batched_tokens=32))
    try:
        assert await _run(engine, jobs) == want
    finally:
        await engine.shutdown()


async def test_max_loras_makes_another_adapter_wait(tiny_model_dir, adapters):
    """--max-loras 1: while one adapter's request runs, another adapter's waits (and, first
    in the queue, the base request behind it), and both run once the first is done."""
    a8, r4 = LoRARequest("a8", 1, str(adapters["a8"])), LoRARequest("r4", 2, str(adapters["r4"]))
    ids = _prompts(1, 11)[0]
    engine = await AsyncEngine.start(_lora_engine_config(tiny_model_dir, max_loras=1))
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    try:
        first = await engine.add_request("long-a8", ids, long, lora_request=a8)
        await anext(aiter(first))  # running
        waiting = asyncio.ensure_future(_run(engine, [(ids, r4), (ids, None)]))
        while True:
            sched = (await engine.get_stats()).scheduler
            if sched.waiting_lora_adapters or sched.num_running > 1:
                break
            await asyncio.sleep(0.01)
        assert sched.running_lora_adapters == {"a8": 1}
        assert sched.waiting_lora_adapters == {"r4": 1} and sched.max_lora == 1
        first.close()
        assert await waiting == _oracle(tiny_model_dir, adapters, [(ids, r4), (ids, None)])
    finally:
        await engine.shutdown()
