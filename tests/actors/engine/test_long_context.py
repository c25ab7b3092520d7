"""A long prompt on the real SmolLM2 (float32) gives transformers' greedy tokens through every
long-context path: chunked prefill (later chunks attend to their cached context in the C++
prefill kernel, where the CPU has AVX-512), a prefix-cache hit on the whole prompt, and decodes past 1,024 tokens (decode
attention split across threads and merged)."""

from __future__ import annotations

import uuid

from pagedserve.actors.engine.async_engine import AsyncEngine
from pagedserve.gpu.sample.sampling_params import SamplingParams
from tests.conftest import chat_prompt_ids, engine_config, hf_greedy


async def _greedy(engine: AsyncEngine, ids: list[int], max_tokens: int) -> list[int]:
    out: list[int] = []
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    async for d in engine.generate(uuid.uuid4().hex, ids, params):
        out.extend(d.token_ids)
    return out


async def test_long_prompt_chunked_cached_and_split_equals_transformers(default_model_dir):
    text = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(80))
    ids = chat_prompt_ids(default_model_dir, text + " Which animal jumps?")
    assert 1100 < len(ids) < 1500  # five 256-token chunks; decodes beyond 1,024 tokens
    want = hf_greedy(default_model_dir, ids, 16)
    engine = await AsyncEngine.start(engine_config(
        default_model_dir, max_model_len=2048, max_num_batched_tokens=256, num_blocks=300))
    try:
        first = await _greedy(engine, ids, 16)
        again = await _greedy(engine, ids, 16)  # every full block of the prompt is cached
        s = await engine.get_stats()
    finally:
        await engine.shutdown()
    assert first == want and again == want
    assert s.kv_cache.prefix_cache_hits >= len(ids) // 16 - 1
