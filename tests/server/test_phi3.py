"""Phi-3 / Phi-3.5 / Phi-4-mini (``Phi3ForCausalLM``, GGUF ``phi3``) through the real server:
greedy output equal to transformers' ``generate`` in float32 on the same weights, batched,
chunked, prefix-cached and preempted (logprobs too), under ``-tp 2``, and from GGUF files in
llama.cpp's layout.

What sets the family apart, each in a tiny random config: q/k/v and gate/up stored fused;
``longrope`` with short and long factors (the long ones once the context passes the original
length: ``rope.longrope_factors``); partial rotary (Phi-4-mini's 0.75 of each head).
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from transformers import AutoTokenizer, GenerationConfig, Phi3Config

from pagedserve.gpu import loader
from pagedserve.gpu.config import ParallelConfig
from pagedserve.gpu.models import registry
from pagedserve.gpu.models.llama import LlamaForCausalLM
from pagedserve.gpu.models.rope import longrope_factors
from tests.conftest import (
    WITH_LOGPROBS,
    chat,
    chat_prompt_ids,
    check_served_answer,
    hf_gguf_model,
    hf_greedy,
    hf_model,
    serve,
    stats,
)
from tests.server.preemption import check_preempted_with_logprobs

ORIGINAL, LONG = 128, 512  # the longrope configs' original and extended contexts
PROMPTS = ["Hi",
           "Tell me a long story about a dragon who learned to paint with watercolors.",
           "Explain paged attention in one sentence, please, and be brief about it."]


def _longrope(rotary_dim: int) -> dict:
    n = rotary_dim // 2
    return {"rope_type": "longrope", "rope_theta": 1e4,
            "original_max_position_embeddings": ORIGINAL,
            "short_factor": [1.0 + 0.3 * i for i in range(n)],
            "long_factor": [1.0 + 4.0 * i for i in range(n)]}


# Phi-3-mini-4k (plain RoPE, untied), Phi-3.5-mini (longrope), Phi-4-mini (longrope, partial
# rotary 0.75: 12 of each 16-wide head turn, tied embeddings), at toy sizes.
FAMILIES = {
    "phi3-mini": {"tie_word_embeddings": False},
    "phi3.5-mini": {"max_position_embeddings": LONG, "rope_parameters": _longrope(16)},
    "phi4-mini": {"max_position_embeddings": LONG, "tie_word_embeddings": True,
                  "rope_parameters": {**_longrope(12), "partial_rotary_factor": 0.75}},
}


def phi3_dir(family: str, path, default_model_dir, long_as_short: bool = False):
    """A 2-layer random Phi3 of ``family`` with SmolLM2's tokenizer, saved in ``path``.
    ``long_as_short``: the short factors replaced by the long ones (transformers then rotates
    every position with the long set: the oracle for our long-context tables)."""
    from transformers import Phi3ForCausalLM

    extra = dict(FAMILIES[family])
    if long_as_short:
        rope = dict(extra["rope_parameters"])
        rope["short_factor"] = rope["long_factor"]
        extra["rope_parameters"] = rope
    torch.manual_seed(11)
    config = Phi3Config(**{
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152,
        "max_position_embeddings": 2048, "original_max_position_embeddings": ORIGINAL,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "sliding_window": None,
        "tie_word_embeddings": True, "initializer_range": 0.1, **extra})
    Phi3ForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(default_model_dir).save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(path)
    return path


async def completion(client, prompt_ids: list[int], max_tokens: int, **body) -> dict:
    """A greedy text completion of ``prompt_ids`` (``body``: more request keys)."""
    r = await client.post("/v1/completions", json={
        "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
        "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


async def completion_ids(client, prompt_ids: list[int], max_tokens: int) -> list[int]:
    return (await completion(client, prompt_ids, max_tokens))["choices"][0]["token_ids"]


def random_prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


@pytest.mark.parametrize("family", FAMILIES)
async def test_phi3_families_match_transformers_batched_chunked_and_cached(
        family, tmp_path, default_model_dir):
    """Within the original context (the short factors, as transformers uses for any sequence
    that short): concurrent requests, prompts chunked over 32-token steps, then a prefix-cache
    hit, each equal to transformers' greedy output."""
    path = phi3_dir(family, tmp_path, default_model_dir)
    config = loader.load_config(path)
    assert registry.model_class(config) is LlamaForCausalLM
    async with serve(path, max_model_len=ORIGINAL, max_num_batched_tokens=32) as client:
        want = [hf_greedy(path, chat_prompt_ids(path, p), 16) for p in PROMPTS]
        bodies = await asyncio.gather(*(chat(client, p, max_tokens=16) for p in PROMPTS))
        assert [b["choices"][0]["token_ids"] for b in bodies] == want
        before = (await stats(client))["kv_cache"]["prefix_cache_hits"]
        again = await chat(client, PROMPTS[1], max_tokens=16)
        assert (await stats(client))["kv_cache"]["prefix_cache_hits"] > before
        assert again["choices"][0]["token_ids"] == want[1]
    expected = None if family == "phi3-mini" else "short"
    assert longrope_factors(config, ORIGINAL) == expected


@pytest.mark.parametrize("family", FAMILIES)
async def test_phi3_families_preempted_requests_and_logprobs(family, tmp_path,
                                                             default_model_dir):
    """Within the original context: requests preempted and recomputed, and logprobs, equal
    transformers' (``preemption.check_preempted_with_logprobs``)."""
    await check_preempted_with_logprobs(phi3_dir(family, tmp_path, default_model_dir),
                                        max_model_len=ORIGINAL)


@pytest.mark.parametrize("family", ["phi3.5-mini", "phi4-mini"])
async def test_longrope_serves_the_whole_context_with_its_long_factors(
        family, tmp_path, default_model_dir):
    """The derived context is ``max_position_embeddings`` (512, not the original 128), and the
    tables take the long factors. A prompt that starts past the original length equals
    transformers' (whose prefill then picks the long factors too); a short prompt equals
    transformers' on the same weights with the short factors replaced by the long ones."""
    path = phi3_dir(family, tmp_path / "model", default_model_dir)
    oracle = phi3_dir(family, tmp_path / "long-only", default_model_dir, long_as_short=True)
    long_prompt, short_prompt = random_prompt(1, ORIGINAL + 20), random_prompt(2, 24)
    async with serve(path, max_model_len=None, max_num_batched_tokens=64) as client:
        models = (await client.get("/v1/models")).json()["data"]
        assert models[0]["max_model_len"] == LONG
        got_long, got_short = await asyncio.gather(completion_ids(client, long_prompt, 16),
                                                   completion_ids(client, short_prompt, 16))
        # Prefix-cached: the long prompt's full blocks again.
        assert await completion_ids(client, long_prompt, 16) == got_long
    assert got_long == hf_greedy(path, long_prompt, 16)
    assert got_short == hf_greedy(oracle, short_prompt, 16)
    # The difference is real: transformers rotates a short prompt with the short factors.
    assert got_short != hf_greedy(path, short_prompt, 16)


async def test_phi4_mini_shape_under_tensor_and_pipeline_parallel(tmp_path, default_model_dir):
    """-tp 2 -pp 2 (2 of 4 heads, 1 of 2 KV heads per rank, one layer per stage): the fused
    checkpoint tensors split per part, partial rotary and the long factors on every rank."""
    path = phi3_dir("phi4-mini", tmp_path, default_model_dir)
    long_prompt = random_prompt(3, ORIGINAL + 8)
    async with serve(path, max_model_len=None, parallel=ParallelConfig(2, 2),
                     max_num_batched_tokens=64) as client:
        got_long = await completion_ids(client, long_prompt, 12)
        body = await chat(client, PROMPTS[1], max_tokens=12)
    assert got_long == hf_greedy(path, long_prompt, 12)
    oracle = phi3_dir("phi4-mini", tmp_path / "long-only", default_model_dir,
                      long_as_short=True)
    assert body["choices"][0]["token_ids"] == hf_greedy(
        oracle, chat_prompt_ids(path, PROMPTS[1]), 12)


def _phi3_gguf(family: str, tmp_path, default_model_dir, types=None, embedding=None):
    from tests.gguf_tiny import LAYER_SHORTS, write_tiny_gguf

    src = phi3_dir(family, tmp_path / "hf", default_model_dir)
    types = dict.fromkeys(LAYER_SHORTS) if types is None else types
    gguf = write_tiny_gguf(src, loader.embedded_gguf_path(), tmp_path / f"{family}.gguf",
                           loader.load_config(src), types, embedding=embedding)
    return src, gguf


@pytest.mark.parametrize("family", ["phi3.5-mini", "phi4-mini"])
async def test_phi3_gguf_keeps_longrope_and_partial_rotary(family, tmp_path, default_model_dir):
    """llama.cpp's ``phi3`` layout (fused ``attn_qkv`` and ``ffn_up``, the factors as
    ``rope_factors_long/short`` tensors, ``rope.dimension_count`` 12 of 16 for Phi-4-mini),
    float32 tensors: transformers on the original weights is the oracle (its own GGUF
    reading drops longrope and partial rotary), of the greedy tokens and every prompt and
    generated token's logprob (all rotated with the long factors)."""
    src, gguf = _phi3_gguf(family, tmp_path, default_model_dir)
    config = loader.load_config(loader.gguf_metadata_dir(gguf))
    rope = config.rope_parameters
    assert rope["rope_type"] == "longrope" and config.original_max_position_embeddings == ORIGINAL
    assert rope["long_factor"] == pytest.approx(FAMILIES[family]["rope_parameters"]["long_factor"])
    assert rope.get("partial_rotary_factor", 1.0) == (0.75 if family == "phi4-mini" else 1.0)
    long_prompt = random_prompt(4, ORIGINAL + 10)
    async with serve(gguf, quantization="gguf", cpu_linear_mode="exact",
                     max_model_len=None) as client:
        assert (await client.get("/v1/models")).json()["data"][0]["max_model_len"] == LONG
        answer = await completion(client, long_prompt, 12, logprobs=0, prompt_logprobs=0)
    check_served_answer(answer, hf_model(src), long_prompt, 12)


async def test_phi3_gguf_kept_quantized_matches_transformers_reading_of_the_file(
        tmp_path, default_model_dir):
    """Phi-3-mini's shape (untied ``output``) with Q8_0 / Q4_0 / Q4_1 blocks read in place,
    one process and -tp 2 (each rank its rows of each fused part of ``attn_qkv`` and
    ``ffn_up``), against transformers' own de-quantized reading of the same file: greedy
    tokens and the prompt's and generated tokens' logprobs."""
    from tests.gguf_tiny import Q

    _, gguf = _phi3_gguf("phi3-mini", tmp_path, default_model_dir, types={},
                         embedding=Q.Q8_0)
    ids = chat_prompt_ids(default_model_dir, PROMPTS[1])
    hf = hf_gguf_model(gguf)
    for parallel in (ParallelConfig(), ParallelConfig(2, 1)):
        async with serve(gguf, quantization="gguf", cpu_linear_mode="exact",
                         parallel=parallel) as client:
            s = await stats(client)
            body = await chat(client, PROMPTS[1], max_tokens=12, **WITH_LOGPROBS)
        assert s["model"]["quantization"] == "gguf"
        check_served_answer(body, hf, ids, 12)


async def test_preemption_and_speculative_decoding_keep_the_long_context_output(
        tmp_path, default_model_dir):
    """Phi-4-mini's shape past its original context: requests preempted (27 blocks for four
    ~11-block requests: their KV recomputed with the same long factors) and n-gram drafts
    verified several positions a step, each equal to transformers'."""
    from pagedserve.actors.spec_decode.proposer import SpeculativeConfig

    path = phi3_dir("phi4-mini", tmp_path, default_model_dir)
    prompts = [random_prompt(10 + i, ORIGINAL + 7) for i in range(4)]
    wants = [hf_greedy(path, p, 40) for p in prompts]
    async with serve(path, max_model_len=320, num_blocks=27) as client:  # > 128: long
        got = await asyncio.gather(*(completion_ids(client, p, 40) for p in prompts))
        s = await stats(client)
    assert got == wants
    assert s["scheduler"]["num_preempted_total"] > 0
    repeat = random_prompt(20, 12) * 12  # 144 tokens, past the original 128
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2)
    async with serve(path, max_model_len=None, speculative=spec) as client:
        got = await completion_ids(client, repeat, 24)
        s = (await stats(client))["scheduler"]
    assert got == hf_greedy(path, repeat, 24)
    assert s["spec_decode_num_draft_tokens"] > 0
