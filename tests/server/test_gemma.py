"""Gemma 2 and Gemma 3 (text) through the real server, against transformers' float32 model on
the same random weights: greedy tokens and logprobs (final-logit soft-capping included) of
batched, chunked, preempted and prefix-cached requests, under -tp 2, and from GGUF (llama.cpp's
``gemma2`` / ``gemma3`` names, norms stored plus one)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from transformers import AutoTokenizer, Gemma2Config, Gemma3TextConfig, GenerationConfig

from pagedserve.actors.spec_decode.proposer import SpeculativeConfig
from pagedserve.gpu import loader
from pagedserve.gpu.config import ParallelConfig
from pagedserve.gpu.models import registry
from pagedserve.gpu.models.gemma2 import Gemma2ForCausalLM
from pagedserve.gpu.models.gemma3 import Gemma3ForCausalLM
from tests.conftest import (
    WITH_LOGPROBS,
    _hf_model,
    chat,
    chat_prompt_ids,
    check_served_answer,
    hf_gguf_model,
    hf_greedy,
    hf_model,
    serve,
    stats,
    stream_chat,
)

# Gemma's turn format, with its refusal of a system turn (transformers raises from the
# template's raise_exception), over SmolLM2's vocabulary.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' "
    "+ m['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")

PROMPTS = [f"Request number {i}: tell me about {w}, at length and with care." for i, w in
           enumerate(["cats", "the sea", "mountains", "paging"])]


def _config(family: str, **overrides):
    """A tiny Gemma 2 (2 layers: local, global) or Gemma 3 (6 layers: five local, one global;
    32-wide heads unlike hidden / heads; a linear RoPE scaling on the global layers), with a
    window longer than any context here (attention soft-capping: none) and a final-logit
    cap of 3 that changes every logprob."""
    common = {
        "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 49152, "max_position_embeddings": 2048,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "tie_word_embeddings": True,
        "initializer_range": 0.1, "sliding_window": 4096, "attn_logit_softcapping": None,
        "final_logit_softcapping": 3.0, "query_pre_attn_scalar": 24}
    if family == "gemma2":
        return Gemma2Config(**{**common, "num_hidden_layers": 2, "head_dim": 16, **overrides})
    return Gemma3TextConfig(**{
        **common, "num_hidden_layers": 6, "head_dim": 32, "rope_theta": 1e6,
        "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        **overrides})


def random_gemma(path, family: str, tokenizer_dir, **overrides):
    """``family``'s tiny random model saved in ``path``, its norm weights (zero-centred,
    zero at init) drawn at random so that each counts, with SmolLM2's tokenizer and
    ``GEMMA_TEMPLATE``."""
    from transformers import Gemma2ForCausalLM as HFGemma2
    from transformers import Gemma3ForCausalLM as HFGemma3

    torch.manual_seed(29)
    config = _config(family, **overrides)
    model = (HFGemma2 if family == "gemma2" else HFGemma3)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
    model.save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = GEMMA_TEMPLATE
    tokenizer.save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma_dir(request, tmp_path_factory, default_model_dir):
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return random_gemma(path, request.param, default_model_dir)


def hf_last_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    """transformers' log-distribution ``[V]`` of the token after ``ids`` (its logits are
    soft-capped already)."""
    with torch.no_grad():
        logits = _hf_model(str(model_dir))(torch.tensor([ids])).logits[0, -1].float()
    return logits.log_softmax(-1)


def check_logprobs(model_dir, prompt_ids: list[int], choice: dict) -> None:
    ids = choice["token_ids"]
    for pos, (token, entry) in enumerate(zip(ids, choice["logprobs"]["content"], strict=True)):
        want = hf_last_logprobs(model_dir, prompt_ids + ids[:pos])
        assert entry["logprob"] == pytest.approx(float(want[token]), abs=1e-4)
        top = [t["logprob"] for t in entry["top_logprobs"]]
        assert top == pytest.approx(want.topk(len(top)).values.tolist(), abs=1e-4)


def test_registry_serves_gemma_and_refuses_its_vision_model(gemma_dir, tmp_path):
    config = loader.load_config(gemma_dir)
    want = Gemma2ForCausalLM if config.model_type == "gemma2" else Gemma3ForCausalLM
    assert registry.model_class(config) is want
    config.architectures = None  # a GGUF's converted config: by model type
    assert registry.model_class(config) is want
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"}))
    with pytest.raises(loader.ModelLoadError) as e:
        loader.load_config(tmp_path)
    assert "\n" not in str(e.value) and "Gemma3ForCausalLM" in str(e.value)
    assert "Gemma3ForConditionalGeneration" in str(e.value)


async def test_gemma_matches_transformers(gemma_dir):
    """Four requests at once in 12 blocks (preemption) under a 32-token budget (chunked
    prefill), then logprobs of one, then the same prompt again (prefix-cache hit)."""
    wants = [hf_greedy(gemma_dir, chat_prompt_ids(gemma_dir, p), 40) for p in PROMPTS]
    async with serve(gemma_dir, num_blocks=12, max_model_len=160,
                     max_num_batched_tokens=32) as client:
        results = await asyncio.gather(
            *(stream_chat(client, p, max_tokens=40, ignore_eos=True) for p in PROMPTS))
        s = await stats(client)
        body = await chat(client, PROMPTS[1], max_tokens=6, logprobs=True, top_logprobs=5)
        hits = (await stats(client))["kv_cache"]["prefix_cache_hits"]
        again = await chat(client, PROMPTS[1], max_tokens=6)
        after = await stats(client)
    for (_, tokens, _), want in zip(results, wants, strict=True):
        assert tokens == want
    assert s["scheduler"]["num_preempted_total"] > 0
    assert after["kv_cache"]["prefix_cache_hits"] > hits
    assert after["kv_cache"]["num_free_blocks"] == 12
    check_logprobs(gemma_dir, chat_prompt_ids(gemma_dir, PROMPTS[1]), body["choices"][0])
    assert again["choices"][0]["token_ids"] == body["choices"][0]["token_ids"] == wants[1][:6]


async def test_gemma_tensor_parallel_matches_transformers(gemma_dir):
    """-tp 2: each rank its two heads (q/k norms with the whole weights), vocabulary-parallel
    scaled embeddings, logits gathered before the cap; Gemma 3 also over 2 pipeline stages
    (the global layer on the second, its layer type by its global index)."""
    pp = 2 if loader.load_config(gemma_dir).model_type == "gemma3_text" else 1
    async with serve(gemma_dir, parallel=ParallelConfig(2, pp),
                     max_num_batched_tokens=32) as client:
        body = await chat(client, PROMPTS[0], max_tokens=8, logprobs=True, top_logprobs=3)
    ids = chat_prompt_ids(gemma_dir, PROMPTS[0])
    assert body["choices"][0]["token_ids"] == hf_greedy(gemma_dir, ids, 8)
    check_logprobs(gemma_dir, ids, body["choices"][0])


async def test_gemma_system_turn_is_a_400(gemma_dir):
    async with serve(gemma_dir) as client:
        r = await client.post("/v1/chat/completions", json={"messages": [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]})
        ok = await chat(client, "Hi", max_tokens=2)
    assert r.status_code == 400
    error = r.json()["error"]
    assert "System role not supported" in error["message"] and error["param"] == "messages"
    assert ok["choices"][0]["token_ids"] == hf_greedy(
        gemma_dir, chat_prompt_ids(gemma_dir, "Hi"), 2)


# A window shorter than every prompt here (24 tokens: the local layers see only the last 24),
# and Gemma 2's attention-logit cap at 2 (its 50 would never bind on these small logits).
WINDOWED = {"gemma2": {"sliding_window": 24, "attn_logit_softcapping": 2.0},
            "gemma3": {"sliding_window": 24}}


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
async def test_gemma_sliding_window_and_soft_cap_match_transformers(family, tmp_path,
                                                                     default_model_dir):
    """Prompts past the window, prefilled in 16-token chunks (the window spans chunks), then
    decoded past it, then again from the prefix cache: tokens and logprobs as transformers'
    masked (and, Gemma 2, capped) attention gives them. Gemma's global layers keep every
    block, so the context is not capped to the window."""
    path = random_gemma(tmp_path, family, default_model_dir, **WINDOWED[family])
    async with serve(path, max_num_batched_tokens=16, max_model_len=None) as client:
        models = (await client.get("/v1/models")).json()["data"]
        bodies = await asyncio.gather(*(chat(client, p, max_tokens=12, logprobs=True,
                                              top_logprobs=3) for p in PROMPTS[:2]))
        again = await chat(client, PROMPTS[0], max_tokens=12)
        hits = (await stats(client))["kv_cache"]["prefix_cache_hits"]
    assert models[0]["max_model_len"] == 2048
    for prompt, body in zip(PROMPTS[:2], bodies, strict=True):
        ids = chat_prompt_ids(path, prompt)
        assert len(ids) > 1.5 * WINDOWED[family]["sliding_window"]
        assert body["choices"][0]["token_ids"] == hf_greedy(path, ids, 12), prompt
        check_logprobs(path, ids, body["choices"][0])
    assert hits > 0 and again["choices"][0]["token_ids"] == bodies[0]["choices"][0]["token_ids"]


async def test_gemma_speculative_decoding_keeps_greedy_output(tmp_path, default_model_dir):
    """n-gram drafts verified by windowed, soft-capped Gemma 2 attention (several queries a
    sequence in one decode step, each with its own window)."""
    path = random_gemma(tmp_path, "gemma2", default_model_dir, **WINDOWED["gemma2"])
    prompt = "1 2 3 4 5 6 7 8 9 10 11 12 1 2 3 4 5 6 7 8 9 10 11 12 1 2 3 4"
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1)
    async with serve(path, speculative=spec) as client:
        body = await chat(client, prompt, max_tokens=24)
        s = (await stats(client))["scheduler"]
    assert body["choices"][0]["token_ids"] == hf_greedy(path, chat_prompt_ids(path, prompt), 24)
    assert s["spec_decode_num_draft_tokens"] > 0


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
async def test_gemma_gguf_matches_transformers(family, tmp_path, default_model_dir):
    """llama.cpp's layout (four norms a layer stored plus one, q/k rows not interleaved, the
    window, caps and Gemma 3's RoPE scaling as metadata keys, no query_pre_attn_scalar: the
    head size), float32 tensors: transformers on the original weights is the oracle, of the
    greedy tokens, their top logprobs and every prompt token's logprob."""
    from tests.gguf_tiny import LAYER_SHORTS, write_tiny_gguf

    head_dim = 16 if family == "gemma2" else 32
    src = random_gemma(tmp_path / "hf", family, default_model_dir, query_pre_attn_scalar=head_dim,
                       **WINDOWED[family])
    gguf = write_tiny_gguf(src, loader.embedded_gguf_path(), tmp_path / f"tiny-{family}.gguf",
                           loader.load_config(src), dict.fromkeys(LAYER_SHORTS), embedding=None)
    config = loader.load_config(loader.gguf_metadata_dir(gguf))
    assert (config.final_logit_softcapping, config.query_pre_attn_scalar) == (3.0, head_dim)
    assert (config.sliding_window, config.attn_logit_softcapping) == (
        24, WINDOWED[family].get("attn_logit_softcapping"))
    if family == "gemma3":
        assert config.rope_parameters["full_attention"]["factor"] == 8.0
        assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    prompt = PROMPTS[2]
    async with serve(gguf, quantization="gguf", cpu_linear_mode="exact") as client:
        body = await chat(client, prompt, max_tokens=8, top_logprobs=3, **WITH_LOGPROBS)
    # The prompt as the file's tokenizer gave it: transformers builds SmolLM2's BPE under a
    # gemma architecture its own way (real Gemma files carry a sentencepiece vocabulary).
    ids = body["prompt_token_ids"]
    assert len(ids) > 16
    check_served_answer(body, hf_model(src), ids, 8)
    check_logprobs(src, ids, body["choices"][0])


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
async def test_gemma_gguf_kept_quantized_matches_transformers(family, tmp_path,
                                                               default_model_dir):
    """Q8_0 / Q4_0 / Q4_1 blocks read in place (the tied Q8_0 embedding scaled after its
    lookup), against transformers' de-quantized reading of the same file with the config as
    we read it (transformers' GGUF config lacks the caps, the scale, the RoPE): greedy tokens
    and the prompt's and generated tokens' logprobs."""
    from tests.gguf_tiny import write_tiny_gguf

    head_dim = 16 if family == "gemma2" else 32
    src = random_gemma(tmp_path / "hf", family, default_model_dir, query_pre_attn_scalar=head_dim,
                       **WINDOWED[family])
    gguf = write_tiny_gguf(src, loader.embedded_gguf_path(), tmp_path / f"q-{family}.gguf",
                           loader.load_config(src))
    parallel = ParallelConfig(2, 1) if family == "gemma3" else ParallelConfig()
    async with serve(gguf, quantization="gguf", cpu_linear_mode="exact",
                     parallel=parallel) as client:
        body = await chat(client, PROMPTS[3], max_tokens=8, **WITH_LOGPROBS)
    hf = hf_gguf_model(gguf, loader.load_config(loader.gguf_metadata_dir(gguf)))
    assert hf.config.query_pre_attn_scalar == head_dim  # ours, not transformers' default 256
    check_served_answer(body, hf, body["prompt_token_ids"], 8)
