"""Speculative decoding with a draft model (``gpu/spec_decode/draft_model.py``) through the real
server: a model as its own draft accepts every greedy draft, also across preemption and prefix-cache
hits (stale draft K/V would show as rejections); a random draft leaves the output unchanged;
a draft with another tokenizer is refused at start."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from pagedserve.actors.spec_decode.proposer import SpeculativeConfig
from pagedserve.gpu import kv_cache
from pagedserve.gpu.config import EMBEDDED_SERVED_NAME, CacheConfig, DraftModelConfig, ModelConfig
from pagedserve.gpu.model_runner import ModelRunner
from tests.conftest import chat, chat_prompt_ids, hf_greedy, serve, stats
from tests.server.test_spec_decode import REPEAT


def draft(path: Path | str, k: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", model=str(path), num_speculative_tokens=k)


def delta(before: dict, after: dict, key: str) -> int:
    return after[key] - before[key]


async def test_smollm2_as_its_own_draft_accepts_every_greedy_draft(default_model_dir):
    """The draft named by the embedded model's hub id: the embedded file (issue 33: it went to
    the hub), the same weights de-quantized, so every greedy draft is accepted."""
    want = hf_greedy(default_model_dir, chat_prompt_ids(default_model_dir, REPEAT), 24)
    async with serve(default_model_dir, name="smollm2",
                     speculative=draft(EMBEDDED_SERVED_NAME)) as client:
        before = (await stats(client))["scheduler"]
        body = await chat(client, REPEAT, max_tokens=24, model="smollm2")
        after = (await stats(client))["scheduler"]
    tokens = body["choices"][0]["token_ids"]
    assert tokens == want[: len(tokens)] and len(tokens) == min(24, len(want))
    drafted = delta(before, after, "spec_decode_num_draft_tokens")
    assert drafted >= len(tokens) // 2
    assert delta(before, after, "spec_decode_num_accepted_tokens") == drafted
    assert delta(before, after, "num_steps_total") <= len(tokens) // 3 + 2


async def test_a_random_tiny_draft_keeps_smollm2_greedy_output(default_model_dir, tiny_model_dir):
    """Batched and chunked (a 48-token budget splits the prompts), beside a seeded sample."""
    prompts = [REPEAT, "What is the capital of France?"]
    wants = [hf_greedy(default_model_dir, chat_prompt_ids(default_model_dir, p), 16)
             for p in prompts]
    async with serve(default_model_dir, name="smollm2", speculative=draft(tiny_model_dir),
                     max_num_batched_tokens=48) as client:
        bodies = await asyncio.gather(
            *(chat(client, p, max_tokens=16, model="smollm2") for p in prompts),
            chat(client, REPEAT, max_tokens=16, model="smollm2", temperature=0.7, seed=5))
        again = await chat(client, REPEAT, max_tokens=16, model="smollm2", temperature=0.7,
                           seed=5)
        s = await stats(client)
    for body, want in zip(bodies, wants, strict=False):
        tokens = body["choices"][0]["token_ids"]
        assert tokens == want[: len(tokens)] and len(tokens) == min(16, len(want))
    assert bodies[2]["choices"][0]["token_ids"] == again["choices"][0]["token_ids"]
    assert s["scheduler"]["spec_decode_num_draft_tokens"] > 0
    assert s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"]


async def test_own_draft_stays_in_step_across_preemption_and_prefix_hits(tiny_model_dir):
    prompts = [f"{REPEAT} ({i})" for i in range(4)]
    wants = [hf_greedy(tiny_model_dir, chat_prompt_ids(tiny_model_dir, p), 40) for p in prompts]
    async with serve(tiny_model_dir, speculative=draft(tiny_model_dir, k=4),
                     num_blocks=14, max_model_len=200) as client:
        bodies = await asyncio.gather(*(chat(client, p, max_tokens=40) for p in prompts))
        repeat = await chat(client, prompts[0], max_tokens=40)  # its prompt blocks are cached
        s = await stats(client)
    for body, want in zip([*bodies, repeat], [*wants, wants[0]], strict=True):
        tokens = body["choices"][0]["token_ids"]
        assert tokens == want[: len(tokens)] and len(tokens) == min(40, len(want))
    sched = s["scheduler"]
    assert sched["num_preempted_total"] > 0 and s["kv_cache"]["prefix_cache_hits"] > 0
    assert sched["spec_decode_num_accepted_tokens"] == sched["spec_decode_num_draft_tokens"] > 0


def test_a_draft_with_another_tokenizer_is_refused(tiny_model_dir, tmp_path):
    other = tmp_path / "other-tokenizer"
    other.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.is_file():
            (other / f.name).write_bytes(f.read_bytes())
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.add_tokens(["<not-in-the-target>"])
    tok.save_pretrained(other)
    runner = ModelRunner(ModelConfig(model=str(tiny_model_dir), dtype="float32",
                                     max_model_len=64, device="cpu"),
                         CacheConfig(num_gpu_blocks_override=8),
                         draft=DraftModelConfig(str(other), 2))
    with pytest.raises(ValueError, match="tokenizer .* differs"):
        runner.load()


def test_the_kv_budget_pays_for_both_caches(tiny_model_dir):
    budget = 4 * 2**20
    runner = ModelRunner(ModelConfig(model=str(tiny_model_dir), dtype="float32",
                                     max_model_len=64, device="cpu"),
                         CacheConfig(kv_cache_memory_bytes=budget, block_size=16),
                         draft=DraftModelConfig(str(tiny_model_dir), 2))
    info = runner.load()
    per_block = kv_cache.bytes_per_block(runner.hf_config, 16, torch.float32)
    assert info.num_blocks == budget // (2 * per_block)
    assert info.kv_cache_bytes == 2 * info.num_blocks * per_block <= budget
