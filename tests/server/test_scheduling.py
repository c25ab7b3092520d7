"""Chunked prefill and preemption leave every greedy output equal to transformers'."""

from __future__ import annotations

import asyncio

from tests.conftest import chat, chat_prompt_ids, hf_greedy, serve, stats, stream_chat

LONG = " ".join(f"word{i}" for i in range(120))  # ~ 250 tokens with the chat template


async def test_chunked_prefill_same_output(tiny_model_dir):
    prompt_len = len(chat_prompt_ids(tiny_model_dir, LONG))
    budget = 32
    assert prompt_len > 4 * budget
    want = hf_greedy(tiny_model_dir, chat_prompt_ids(tiny_model_dir, LONG), 20)
    async with serve(tiny_model_dir, max_num_batched_tokens=budget) as client:
        before = (await stats(client))["scheduler"]["num_steps_total"]
        body = await chat(client, LONG, max_tokens=20)
        steps = (await stats(client))["scheduler"]["num_steps_total"] - before
    assert body["choices"][0]["token_ids"] == want
    # the prompt really was split: ceil(prompt/budget) prefill steps, then one per new token
    assert steps == -(-prompt_len // budget) + len(want) - 1


async def test_preemption_keeps_outputs_and_leaks_nothing(tiny_model_dir):
    prompts = [f"Request number {i}: tell me about {w}" for i, w in
               enumerate(["cats", "dogs", "the sea", "mountains", "rain", "paging"])]
    wants = [hf_greedy(tiny_model_dir, chat_prompt_ids(tiny_model_dir, p), 60) for p in prompts]
    # 12 blocks of 16 tokens: two ~110-token requests fit at once, six are sent.
    async with serve(tiny_model_dir, num_blocks=12, max_model_len=160) as client:
        results = await asyncio.gather(
            *(stream_chat(client, p, max_tokens=60, ignore_eos=True) for p in prompts)
        )
        s = await stats(client)
    for (_, tokens, _), want in zip(results, wants):
        assert tokens == want
    assert s["scheduler"]["num_preempted_total"] > 0
    assert s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"] == 12
    assert s["scheduler"]["num_running"] == s["scheduler"]["num_waiting"] == 0
