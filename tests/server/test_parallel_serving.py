"""A tensor × pipeline parallel engine (tp=2 × pp=2: four spawned gloo workers behind the
executor actor) through a real server: greedy outputs equal transformers' for batched,
chunked-prefill, prefix-cached and preempted requests; ``/admin/stats`` shows the layout;
with ``--quantization gguf`` each rank keeps its share of the GGUF blocks (tp=2)."""

from __future__ import annotations

import asyncio

import pytest_asyncio

from pagedserve.gpu.config import ParallelConfig
from tests.conftest import chat_prompt_ids, hf_greedy, serve, stats, stream_chat

PROMPTS = [f"Request number {i}: tell me about {w}" for i, w in
           enumerate(["cats", "dogs", "the sea", "mountains", "rain", "paging"])]
LONG = " ".join(f"word{i}" for i in range(22))  # ~90 tokens: chunked at 32 a step


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def client(tiny_model_dir):
    # 12 blocks of 16 tokens: two ~100-token requests at once, so six preempt each other.
    # --async-scheduling: two batches in flight, so the parity tests below cover them too.
    async with serve(tiny_model_dir, parallel=ParallelConfig(2, 2), num_blocks=12,
                     max_model_len=144, max_num_batched_tokens=32, async_scheduling=True) as c:
        yield c


async def test_layout_in_admin_stats(client):
    layout = (await stats(client))["model"]["parallel"]
    assert [(r["rank"], r["tp_rank"], r["pp_rank"]) for r in layout] == [
        (0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]
    assert [r["layers"] for r in layout] == [[0, 1], [0, 1], [1, 2], [1, 2]]
    assert [r["q_heads"] for r in layout] == [[0, 2], [2, 4]] * 2
    assert [r["kv_heads"] for r in layout] == [[0, 1], [1, 2]] * 2
    assert len({r["pid"] for r in layout}) == 4


async def test_greedy_batched_chunked_preempted_equal_transformers(client, tiny_model_dir):
    prompts = [*PROMPTS, LONG]
    wants = [hf_greedy(tiny_model_dir, chat_prompt_ids(tiny_model_dir, p), 40) for p in prompts]
    results = await asyncio.gather(
        *(stream_chat(client, p, max_tokens=40, ignore_eos=True) for p in prompts))
    for (_, tokens, _), want, p in zip(results, wants, prompts):
        assert tokens == want[:40], p
    s = await stats(client)
    assert s["scheduler"]["num_preempted_total"] > 0
    assert s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"]


async def test_prefix_cached_request_equals_transformers(client, tiny_model_dir):
    want = hf_greedy(tiny_model_dir, chat_prompt_ids(tiny_model_dir, LONG), 16)
    before = (await stats(client))["kv_cache"]["prefix_cache_hits"]
    for _ in range(2):
        _, tokens, _ = await stream_chat(client, LONG, max_tokens=16, ignore_eos=True)
        assert tokens == want[:16]
    assert (await stats(client))["kv_cache"]["prefix_cache_hits"] > before


async def test_two_batches_in_flight_never_one_request_in_both(client):
    """pp=2 under --async-scheduling keeps two batches in flight (stage 1 on batch k+1 while
    stage 2 is on batch k),
    each with requests the other does not hold (``actors/inflight.py`` raises otherwise)."""
    results = await asyncio.gather(
        *(stream_chat(client, p, max_tokens=8, ignore_eos=True) for p in PROMPTS[:4]))
    assert all(len(tokens) == 8 for _, tokens, _ in results)
    sched = (await stats(client))["scheduler"]
    assert sched["max_batches_in_flight"] == 2
    assert sched["num_scheduled_ahead_total"] == 0


async def test_gguf_blocks_over_two_ranks_equal_one_process(tiny_gguf_path):
    """``-tp 2 --quantization gguf`` on the tiny GGUF: each rank multiplies its half of the
    blocks, and greedy output equals the one-process GGUF model's."""
    async def greedy(parallel: ParallelConfig) -> list[int]:
        async with serve(tiny_gguf_path, parallel=parallel, quantization="gguf",
                         max_model_len=144) as c:
            assert (await stats(c))["model"]["quantization"] == "gguf"
            _, tokens, _ = await stream_chat(c, PROMPTS[0], max_tokens=24, ignore_eos=True)
            return tokens

    one = await greedy(ParallelConfig())
    assert len(one) == 24 and await greedy(ParallelConfig(2)) == one
