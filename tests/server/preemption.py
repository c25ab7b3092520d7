"""The preemption check of issue 29's families: more concurrent requests than the KV cache
holds, so the latest arrivals are preempted (their blocks freed) and recomputed once blocks
come back, through the real server against transformers' float32 model on the same weights."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.conftest import chat, chat_prompt_ids, hf_greedy, hf_logprobs, serve, stats, stream_chat

# Four requests of ~45 prompt tokens (SmolLM2's chat template) and 40 generated: about 22
# blocks of 16 at once, for a pool of 12.
LONG_PROMPTS = [f"Request number {i}: tell me about {w}, at length and with care." for i, w in
                enumerate(["cats", "the sea", "mountains", "paging"])]
NUM_BLOCKS = 12


async def check_preempted_with_logprobs(path: Path, max_model_len: int = 160) -> None:
    """Four streams at once in ``NUM_BLOCKS`` blocks under a 32-token budget (prefills and
    recomputations chunked): each equals transformers' greedy tokens (``ignore_eos``), some
    request was preempted, every block is back at the end, and a request's logprobs equal
    transformers' forward's log-softmax."""
    wants = [hf_greedy(path, chat_prompt_ids(path, p), 40) for p in LONG_PROMPTS]
    async with serve(path, num_blocks=NUM_BLOCKS, max_model_len=max_model_len,
                     max_num_batched_tokens=32) as client:
        results = await asyncio.gather(
            *(stream_chat(client, p, max_tokens=40, ignore_eos=True) for p in LONG_PROMPTS))
        s = await stats(client)
        body = (await chat(client, LONG_PROMPTS[2], max_tokens=8, logprobs=True))["choices"][0]
    assert [tokens for _, tokens, _ in results] == wants
    assert s["scheduler"]["num_preempted_total"] > 0
    assert s["kv_cache"]["num_free_blocks"] == NUM_BLOCKS
    ids = chat_prompt_ids(path, LONG_PROMPTS[2])
    assert body["token_ids"] == wants[2][:8]
    lps = [e["logprob"] for e in body["logprobs"]["content"]]
    assert lps == pytest.approx(hf_logprobs(path, ids + body["token_ids"], len(ids)), abs=1e-4)
