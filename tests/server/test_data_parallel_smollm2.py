"""Issue 14's Done-means on the real default model: greedy float32 output of ``-dp 2`` (two
engine-core processes behind the router) equals transformers' ``generate``, with both engines
serving."""

from __future__ import annotations

import asyncio

import httpx

from tests.conftest import chat, chat_prompt_ids, hf_greedy, stats
from tests.server.dp_servers import dp_server

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Name three prime numbers.", "What does a CPU cache do?"]
NEW_TOKENS = 16


async def test_smollm2_dp2_greedy_equals_transformers(default_model_dir, tmp_path):
    with dp_server(default_model_dir, logs=tmp_path) as (_, url):
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            outs = await asyncio.gather(*(
                chat(client, p, max_tokens=NEW_TOKENS)
                for p in PROMPTS))
            s = await stats(client)
    assert all(e["num_routed"] > 0 for e in s["engines"]), s["engines"]  # both engines served
    for out, p in zip(outs, PROMPTS, strict=True):
        want = hf_greedy(default_model_dir, chat_prompt_ids(default_model_dir, p), NEW_TOKENS)
        assert out["choices"][0]["token_ids"] == want, p
