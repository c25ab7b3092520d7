"""Mistral's sliding window through the real server (issue 29): a tiny random
``MistralConfig`` (float32, ``sliding_window`` 32, 16-token blocks) whose prompts are several
windows long. Greedy tokens equal transformers' ``generate`` and logprobs its full forward's
log-softmax, with chunked prefill, prefix-cache hits (by the window's rule), concurrent
requests and preemption; the KV cache holds fewer blocks than the sequences' lengths need
without the window, because blocks behind the window go back to the pool. A Mistral v0.1 GGUF
(llama.cpp's ``llama`` architecture, no window key) attends over everything, as llama.cpp."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from transformers import AutoTokenizer, GenerationConfig, MistralConfig, MistralForCausalLM

from pagedserve.gpu import loader
from pagedserve.gpu.models import registry
from tests.conftest import chat, chat_prompt_ids, hf_greedy, hf_logprobs, serve, stats

WINDOW, BLOCK = 32, 16
STORY = ("Once upon a time a small dragon lived by the sea and learned to paint with "
         "watercolors, first the waves, then the gulls, then the fishing boats at dawn. ")
PROMPTS = [STORY * 2 + "What did it paint last?",
           STORY + "Then it painted the lighthouse. " + STORY + "Name three things."]


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory, default_model_dir):
    """2 layers, 4 heads of 64 (the C++ prefill kernel's size) over 2 KV heads, window 32."""
    path = tmp_path_factory.mktemp("tiny-mistral-sw")
    torch.manual_seed(11)
    config = MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=49152, sliding_window=WINDOW,
        max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        tie_word_embeddings=True, initializer_range=0.1)
    MistralForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(default_model_dir).save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(path)
    return path


def test_the_window_is_honoured_not_capped(mistral_dir):
    config = loader.load_config(mistral_dir)
    assert registry.unhonoured_sliding_window(config) is None
    assert registry.derived_max_model_len(config) == 2048  # not capped to the window
    assert registry.kv_sliding_window(config) == WINDOW


async def test_long_prompts_match_transformers_with_fewer_blocks(mistral_dir):
    async with serve(mistral_dir, max_num_batched_tokens=32, block_size=BLOCK) as client:
        for prompt in PROMPTS:
            ids = chat_prompt_ids(mistral_dir, prompt)
            assert len(ids) > 3 * WINDOW
            body = await chat(client, prompt, max_tokens=40, ignore_eos=True, logprobs=True)
            got = body["choices"][0]["token_ids"]
            assert got == hf_greedy(mistral_dir, ids, 40), prompt
            want = hf_logprobs(mistral_dir, ids + got, len(ids))
            lps = [e["logprob"] for e in body["choices"][0]["logprobs"]["content"]]
            assert lps == pytest.approx(want, abs=1e-4)
        kv = (await stats(client))["kv_cache"]
        longest = max(len(chat_prompt_ids(mistral_dir, p)) for p in PROMPTS) + 40
        # Without the window a sequence ends holding ceil(len / 16) blocks; with it, the
        # window's (31 keys: 3 blocks at most) plus a 32-token chunk's.
        assert kv["sliding_window"] == WINDOW and kv["num_released_blocks_total"] > 0
        assert kv["max_blocks_in_use"] <= 6 < -(-longest // BLOCK)

        # The prompt again: a prefix-cache hit that needs only the last window's blocks.
        before = kv["prefix_cache_hits"]
        again = await chat(client, PROMPTS[0], max_tokens=40, ignore_eos=True)
        after = (await stats(client))["kv_cache"]["prefix_cache_hits"]
        ids = chat_prompt_ids(mistral_dir, PROMPTS[0])
        assert after - before >= 2 * WINDOW
        assert again["choices"][0]["token_ids"] == hf_greedy(mistral_dir, ids, 40)


async def test_concurrent_requests_and_preemption_keep_outputs(mistral_dir):
    """Six blocks (what one windowed sequence may need at most) for two long requests at
    once: they preempt each other, recompute, and still equal transformers."""
    async with serve(mistral_dir, max_num_batched_tokens=32, block_size=BLOCK,
                     num_blocks=6) as client:
        bodies = await asyncio.gather(*(chat(client, p, max_tokens=24, ignore_eos=True)
                                        for p in PROMPTS))
        s = await stats(client)
    for prompt, body in zip(PROMPTS, bodies, strict=True):
        ids = chat_prompt_ids(mistral_dir, prompt)
        assert body["choices"][0]["token_ids"] == hf_greedy(mistral_dir, ids, 24), prompt
    assert s["kv_cache"]["num_free_blocks"] == 6  # every block back
    assert s["scheduler"]["num_preempted_total"] > 0


async def test_qwen2_per_layer_windows_mask_without_releasing(tmp_path, default_model_dir):
    """Qwen2 with ``use_sliding_window``: layers from ``max_window_layers`` on are windowed,
    the first is global, so every block stays (the windows only mask) and the output still
    equals transformers'."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(12)
    config = Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=49152, sliding_window=WINDOW, use_sliding_window=True,
        max_window_layers=1, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
        pad_token_id=2, tie_word_embeddings=True, initializer_range=0.1)
    assert config.layer_types == ["full_attention", "sliding_attention"]
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(default_model_dir).save_pretrained(tmp_path)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(tmp_path)
    loaded = loader.load_config(tmp_path)
    assert registry.kv_sliding_window(loaded) is None
    assert registry.derived_max_model_len(loaded) == 2048
    async with serve(tmp_path, max_num_batched_tokens=32, block_size=BLOCK) as client:
        ids = chat_prompt_ids(tmp_path, PROMPTS[0])
        body = await chat(client, PROMPTS[0], max_tokens=24, ignore_eos=True)
        kv = (await stats(client))["kv_cache"]
    assert body["choices"][0]["token_ids"] == hf_greedy(tmp_path, ids, 24)
    assert kv["sliding_window"] is None and kv["num_released_blocks_total"] == 0
    assert kv["max_blocks_in_use"] >= -(-(len(ids) + 23) // BLOCK)  # all kept


async def test_parallel_and_speculative_decoding_keep_outputs(mistral_dir):
    """-tp 2 (each rank its heads, the same released blocks), -pp 2 (each stage its layers'
    windows), n-gram drafts (several windowed queries per sequence in one step) and async
    scheduling (blocks released by the tokens known computed, not those in flight) past the
    window."""
    from pagedserve.actors.spec_decode.proposer import SpeculativeConfig
    from pagedserve.gpu.config import ParallelConfig

    prompt = PROMPTS[0]
    ids = chat_prompt_ids(mistral_dir, prompt)
    want = hf_greedy(mistral_dir, ids, 32)
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1)
    for kw in ({"parallel": ParallelConfig(2, 1)}, {"parallel": ParallelConfig(1, 2)},
               {"speculative": spec}, {"async_scheduling": True}):
        async with serve(mistral_dir, max_num_batched_tokens=32, block_size=BLOCK,
                         **kw) as client:
            body = await chat(client, prompt, max_tokens=32, ignore_eos=True)
            s = await stats(client)
        assert body["choices"][0]["token_ids"] == want, kw
        assert s["kv_cache"]["num_released_blocks_total"] > 0
        if "speculative" in kw:
            assert s["scheduler"]["spec_decode"]["num_draft_tokens"] > 0


async def test_a_mistral_v01_gguf_attends_to_the_whole_context_as_llama_cpp(
        mistral_dir, tmp_path):
    """llama.cpp's ``convert_hf_to_gguf.py`` writes a Mistral v0.1 checkpoint as its ``llama``
    architecture (``LlamaModel``) and writes no window key for it, and llama.cpp's ``llama``
    graph attends over the whole context. Such a file (float32 tensors here) is served the same
    way: greedy tokens and logprobs equal transformers' on the same weights without the window,
    and not the windowed model's (the prompt is three windows long)."""
    from tests.gguf_tiny import LAYER_SHORTS, write_tiny_gguf

    gguf = write_tiny_gguf(mistral_dir, loader.embedded_gguf_path(), tmp_path / "m.gguf",
                           loader.load_config(mistral_dir), dict.fromkeys(LAYER_SHORTS),
                           embedding=None)
    config = loader.load_config(loader.gguf_metadata_dir(gguf))
    assert config.model_type == "llama" and registry.kv_sliding_window(config) is None
    unwindowed = tmp_path / "unwindowed"  # the same weights, the window taken out
    unwindowed.mkdir()
    for f in mistral_dir.iterdir():
        if f.name != "config.json":
            (unwindowed / f.name).symlink_to(f)
    hf = json.loads((mistral_dir / "config.json").read_text())
    (unwindowed / "config.json").write_text(json.dumps({**hf, "sliding_window": None}))
    ids = chat_prompt_ids(mistral_dir, PROMPTS[0])
    async with serve(gguf, quantization="gguf", cpu_linear_mode="exact",
                     block_size=BLOCK) as client:
        body = await chat(client, PROMPTS[0], max_tokens=12, ignore_eos=True, logprobs=True)
        kv = (await stats(client))["kv_cache"]
    got = body["choices"][0]["token_ids"]
    lps = [e["logprob"] for e in body["choices"][0]["logprobs"]["content"]]
    assert len(ids) > 3 * WINDOW and kv["sliding_window"] is None
    assert got == hf_greedy(unwindowed, ids, 12)
    assert lps == pytest.approx(hf_logprobs(unwindowed, ids + got, len(ids)), abs=1e-4)
    assert lps != pytest.approx(hf_logprobs(mistral_dir, ids + got, len(ids)), abs=1e-2)
