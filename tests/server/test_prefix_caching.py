"""Prefix caching and priority scheduling never change an answer; hits are real."""

from __future__ import annotations

import asyncio

from tests.conftest import chat, chat_prompt_ids, hf_greedy, serve, stats, until_stats


async def test_cache_hit_skips_prefill_work(tiny_model_dir):
    long = " ".join(f"item{i}" for i in range(60))
    n_prompt = len(chat_prompt_ids(tiny_model_dir, long))
    async with serve(tiny_model_dir) as client:
        s0 = await stats(client)
        first = await chat(client, long, max_tokens=4, ignore_eos=True)
        s1 = await stats(client)
        second = await chat(client, long, max_tokens=4, ignore_eos=True)
        s2 = await stats(client)
    assert first["choices"][0]["token_ids"] == second["choices"][0]["token_ids"]
    hit = (n_prompt - 1) // 16 * 16  # every full block but the one holding the last token
    assert s1["kv_cache"]["prefix_cache_hits"] - s0["kv_cache"]["prefix_cache_hits"] == 0
    assert s2["kv_cache"]["prefix_cache_hits"] - s1["kv_cache"]["prefix_cache_hits"] == hit
    work1 = s1["scheduler"]["num_computed_tokens_total"] - s0["scheduler"]["num_computed_tokens_total"]
    work2 = s2["scheduler"]["num_computed_tokens_total"] - s1["scheduler"]["num_computed_tokens_total"]
    assert work1 == n_prompt + 3 and work2 == n_prompt - hit + 3


async def test_eviction_under_small_budget_keeps_outputs(tiny_model_dir):
    prompts = [f"Topic {i}: " + " ".join(f"w{i}x{j}" for j in range(30)) for i in range(6)]
    wants = [hf_greedy(tiny_model_dir, chat_prompt_ids(tiny_model_dir, p), 8) for p in prompts]
    async with serve(tiny_model_dir, num_blocks=20, max_model_len=200) as client:
        for _ in range(2):  # second round: some prefixes evicted, some still cached
            for p, want in zip(prompts, wants):
                body = await chat(client, p, max_tokens=8)
                assert body["choices"][0]["token_ids"] == want
        s = await stats(client)
    assert s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"] == 20
    assert s["kv_cache"]["num_cached_blocks"] <= 20


async def test_cache_salt_isolates_tenants(tiny_model_dir):
    long = " ".join(f"secret{i}" for i in range(40))
    async with serve(tiny_model_dir) as client:
        async def hits(**kw) -> int:
            before = (await stats(client))["kv_cache"]["prefix_cache_hits"]
            await chat(client, long, max_tokens=2, **kw)
            return (await stats(client))["kv_cache"]["prefix_cache_hits"] - before

        assert await hits(cache_salt="tenant-a") == 0
        assert await hits(cache_salt="tenant-b") == 0
        assert await hits() == 0  # unsalted never sees salted blocks
        assert await hits(cache_salt="tenant-a") > 0
        r = await client.post("/reset_prefix_cache")
        assert r.status_code == 200 and r.json()["num_blocks_dropped"] > 0
        assert (await stats(client))["kv_cache"]["num_cached_blocks"] == 0
        assert await hits(cache_salt="tenant-a") == 0
        r = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "cache_salt": ""})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


async def test_priority_arrival_preempts_lowest_priority(tiny_model_dir):
    low = ["low priority one", "low priority two"]
    wants = {p: hf_greedy(tiny_model_dir, chat_prompt_ids(tiny_model_dir, p), 120) for p in low}
    high = "urgent"
    want_high = hf_greedy(tiny_model_dir, chat_prompt_ids(tiny_model_dir, high), 5)
    async with serve(tiny_model_dir, max_num_seqs=2, policy="priority") as client:
        order: list[str] = []

        async def run(p: str, prio: int, n: int) -> list[int]:
            body = await chat(client, p, max_tokens=n, priority=prio, ignore_eos=True)
            order.append(p)
            return body["choices"][0]["token_ids"]

        tasks = [asyncio.create_task(run(p, 5, 120)) for p in low]
        await until_stats(client, lambda s: s["scheduler"]["num_running"] == 2, "both running")
        got_high = await run(high, 0, 5)
        got_low = await asyncio.gather(*tasks)
        s = await stats(client)
    assert order[0] == high  # it did not wait for a running low-priority request to end
    assert got_high == want_high
    assert got_low == [wants[p] for p in low]
    assert s["scheduler"]["num_preempted_total"] >= 1
    assert s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"]
