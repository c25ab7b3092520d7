"""Issue 13's Done-means matrix on the tiny model, through a real server per layout: tp=2,
pp=2 and tp=2 × pp=2 (spawned gloo workers behind the executor actor) give greedy float32
outputs equal to transformers' for batched, chunked-prefill, prefix-cached and preempted
requests; ``/admin/stats`` shows each layout; with ``--quantization gguf`` each rank keeps
its share of the GGUF blocks (tp=2). The ray backend runs the same checks
(``test_parallel_ray.py``); tp=3 on SmolLM2 is ``test_parallel_tp3.py``.

One server per layout, its requests all at once: 12 blocks of 16 tokens hold two of the
~100-token requests, so the six plus the long prompt preempt each other, and 32 tokens a
step chunk the long prompt's prefill."""

from __future__ import annotations

import asyncio
from functools import lru_cache
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from pagedserve.gpu.config import ParallelConfig
from tests.conftest import chat_prompt_ids, hf_greedy, serve, stats, stream_chat

PROMPTS = [f"Request number {i}: tell me about {w}" for i, w in
           enumerate(["cats", "dogs", "the sea", "mountains", "rain", "paging"])]
LONG = " ".join(f"word{i}" for i in range(22))  # ~90 tokens: chunked at 32 a step
NEW_TOKENS = 40
SMALL_KV = {"num_blocks": 12, "max_model_len": 144, "max_num_batched_tokens": 32}

# (tp, pp) → each rank's (rank, tp_rank, pp_rank, layers, q_heads, kv_heads), rank order.
LAYOUTS = {
    (2, 1): [(0, 0, 0, [0, 2], [0, 2], [0, 1]), (1, 1, 0, [0, 2], [2, 4], [1, 2])],
    (1, 2): [(0, 0, 0, [0, 1], [0, 4], [0, 2]), (1, 0, 1, [1, 2], [0, 4], [0, 2])],
    (2, 2): [(0, 0, 0, [0, 1], [0, 2], [0, 1]), (1, 1, 0, [0, 1], [2, 4], [1, 2]),
             (2, 0, 1, [1, 2], [0, 2], [0, 1]), (3, 1, 1, [1, 2], [2, 4], [1, 2])],
}


@lru_cache(maxsize=2)
def _wants(model_dir: Path) -> tuple[list[int], ...]:
    """transformers' greedy tokens for PROMPTS and LONG (computed once for every layout)."""
    return tuple(hf_greedy(model_dir, chat_prompt_ids(model_dir, p), NEW_TOKENS)[:NEW_TOKENS]
                 for p in [*PROMPTS, LONG])


def check_layout(layout: list[dict], tp: int, pp: int) -> None:
    assert [(r["rank"], r["tp_rank"], r["pp_rank"], r["layers"], r["q_heads"], r["kv_heads"])
            for r in layout] == LAYOUTS[(tp, pp)]
    assert len({r["pid"] for r in layout}) == tp * pp
    assert [r["cuda_graphs"] for r in layout] == [False] * (tp * pp)  # the CPU captures none


async def check_batched_chunked_preempted(client: httpx.AsyncClient, model_dir: Path) -> None:
    """Every prompt at once (batched; the long one chunked; some preempted and recomputed):
    each stream's tokens equal transformers', and every block is free again after."""
    before = (await stats(client))["scheduler"]["num_preempted_total"]
    prompts = [*PROMPTS, LONG]
    results = await asyncio.gather(
        *(stream_chat(client, p, max_tokens=NEW_TOKENS, ignore_eos=True) for p in prompts))
    for (_, tokens, _), want, p in zip(results, _wants(model_dir), prompts, strict=True):
        assert tokens == want, p
    s = await stats(client)
    assert s["scheduler"]["num_preempted_total"] > before
    assert s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"]


async def check_prefix_cached(client: httpx.AsyncClient, model_dir: Path) -> None:
    """The long prompt twice more, alone: the second reuses the first's cached blocks (a
    prefix-cache hit) and both equal transformers'."""
    want = _wants(model_dir)[-1][:16]
    before = (await stats(client))["kv_cache"]["prefix_cache_hits"]
    for _ in range(2):
        _, tokens, _ = await stream_chat(client, LONG, max_tokens=16, ignore_eos=True)
        assert tokens == want
    assert (await stats(client))["kv_cache"]["prefix_cache_hits"] > before


@pytest_asyncio.fixture(scope="module", loop_scope="session", params=list(LAYOUTS),
                        ids=lambda tp_pp: "tp{}xpp{}".format(*tp_pp))
async def layout_client(request, tiny_model_dir):
    tp, pp = request.param
    # --async-scheduling under pp: two batches in flight, so the parity tests cover them too.
    async with serve(tiny_model_dir, parallel=ParallelConfig(tp, pp), async_scheduling=pp > 1,
                     **SMALL_KV) as c:
        yield tp, pp, c


async def test_layout_in_admin_stats(layout_client):
    tp, pp, client = layout_client
    check_layout((await stats(client))["model"]["parallel"], tp, pp)


async def test_greedy_batched_chunked_preempted_equal_transformers(layout_client,
                                                                   tiny_model_dir):
    await check_batched_chunked_preempted(layout_client[2], tiny_model_dir)


async def test_prefix_cached_request_equals_transformers(layout_client, tiny_model_dir):
    await check_prefix_cached(layout_client[2], tiny_model_dir)


async def test_two_batches_in_flight_never_one_request_in_both(layout_client):
    """pp=2 under --async-scheduling keeps two batches in flight (stage 1 on batch k+1 while
    stage 2 is on batch k),
    each with requests the other does not hold (``actors/core/inflight.py`` raises otherwise)."""
    tp, pp, client = layout_client
    if pp == 1:
        pytest.skip("batches in flight need pipeline stages")
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
