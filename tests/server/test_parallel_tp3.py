"""Tensor parallel across three ranks on the real SmolLM2-135M (9 heads, 3 KV heads: three
heads and one KV head a rank; its 576-wide MLP and 49,152-token vocabulary split in three),
through the real ``pagedserve serve -tp 3`` process (issue 13): greedy float32 outputs equal a
tp=1 server's token for token (and tp=1 equals transformers' ``generate``: ``tests/test_e2e.py``;
transformers itself is the slow part on a shared 2-core machine, ~5 s a prompt, so the tp=1
engine is the oracle here) for batched, chunked-prefill, preempted and prefix-cached requests:
12 KV blocks of 16 tokens and 32 tokens a step, so the five requests at once (the long one,
~86 tokens, chunked) preempt each other, and the long prompt once more hits the prefix
cache."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from pagedserve.gpu.config import EMBEDDED_SERVED_NAME
from pagedserve.server.launch import start_server_process
from tests.conftest import serve

LONG = " ".join(f"word{i}" for i in range(22))  # 86 tokens with the chat template
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Name three colours.", "Why is the sky blue?", LONG]
NEW_TOKENS = 16


# Offline, so that the hub id can only mean the embedded file (the README's own form).
OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def tp3_server(tmp_path_factory):
    """``-tp 3`` in float32, unquantized, started by the embedded model's hub id (issue 33:
    it went to the hub); three CPU threads shared out, one per rank (the executor gives each
    rank ``PAGEDSERVE_CPU_THREADS // world``)."""
    log = tmp_path_factory.mktemp("tp3") / "server.log"
    env = {**OFFLINE, "PAGEDSERVE_CPU_THREADS": "3"}
    with log.open("w") as out:
        try:
            proc, url = start_server_process(
                [EMBEDDED_SERVED_NAME, "-tp", "3", "--dtype", "float32",
                 "--quantization", "none", "--max-model-len", "192",
                 "--num-gpu-blocks-override", "12", "--max-num-batched-tokens", "32"],
                stdout=out, stderr=subprocess.STDOUT, env=env)
        except RuntimeError as e:
            pytest.fail(f"{e}:\n{log.read_text()}")
        try:
            yield url
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, log.read_text()


def test_tp2_is_refused_naming_the_sizes_that_work():
    """9 heads, 3 KV heads, MLP 1536: 1 and 3 ranks split it (9 would not divide the MLP)."""
    exe = Path(sys.executable).parent / "pagedserve"
    done = subprocess.run([str(exe), "serve", EMBEDDED_SERVED_NAME, "-tp", "2", "--port", "0"],
                          capture_output=True, text=True, timeout=120, env=OFFLINE)
    assert done.returncode != 0
    assert ("--tensor-parallel-size 2 does not divide the model's 9 attention heads; sizes "
            "that work for this model: 1, 3") in done.stderr + done.stdout


def _chat(url: str, prompt: str) -> list[int]:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": prompt}], "temperature": 0,
        "max_tokens": NEW_TOKENS, "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_layout_is_three_ranks_one_kv_head_each(tp3_server):
    layout = httpx.get(f"{tp3_server}/admin/stats", timeout=30).json()["model"]["parallel"]
    models = httpx.get(f"{tp3_server}/v1/models", timeout=30).json()["data"]
    assert models[0]["id"] == EMBEDDED_SERVED_NAME
    assert [r["tp_rank"] for r in layout] == [0, 1, 2]
    assert [r["q_heads"] for r in layout] == [[0, 3], [3, 6], [6, 9]]
    assert [r["kv_heads"] for r in layout] == [[0, 1], [1, 2], [2, 3]]


async def _tp1_tokens(model_dir) -> list[list[int]]:
    """The same prompts, batched, through an in-process tp=1 server (float32)."""
    async with serve(model_dir, name="tp1") as client:
        async def one(prompt: str) -> list[int]:
            r = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": prompt}], "temperature": 0,
                "max_tokens": NEW_TOKENS, "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]
        return list(await asyncio.gather(*(one(p) for p in PROMPTS)))


def _stats(url: str) -> dict:
    return httpx.get(f"{url}/admin/stats", timeout=30).json()


async def test_tp3_batched_chunked_preempted_prefix_cached_equal_tp1(tp3_server,
                                                                     default_model_dir):
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # at once: one batch on the ranks
        got = await asyncio.gather(
            *(loop.run_in_executor(pool, _chat, tp3_server, p) for p in PROMPTS))
    s = _stats(tp3_server)
    assert s["scheduler"]["num_preempted_total"] > 0
    assert s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"] == 12
    hits = s["kv_cache"]["prefix_cache_hits"]
    again = await loop.run_in_executor(None, _chat, tp3_server, LONG)
    assert _stats(tp3_server)["kv_cache"]["prefix_cache_hits"] > hits
    wants = await _tp1_tokens(default_model_dir)
    for tokens, want, p in zip([*got, again], [*wants, wants[-1]], [*PROMPTS, "again"],
                               strict=True):
        assert len(tokens) == NEW_TOKENS and tokens == want, p
