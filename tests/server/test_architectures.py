"""The model registry and the families beyond Llama (issue 29), each through the real server
with greedy output equal to transformers' ``generate`` in float32, chunked prefill, a
prefix-cache hit, preempted requests and logprobs included; from safetensors and from GGUF."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from pagedserve.actors.spec_decode.proposer import SpeculativeConfig
from pagedserve.gpu import loader
from pagedserve.gpu.config import ParallelConfig
from pagedserve.gpu.models import registry
from pagedserve.gpu.models.llama import LlamaForCausalLM
from pagedserve.gpu.models.qwen3 import Qwen3ForCausalLM
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

# Longer than one 16-token block and than the 32-token step budget once templated.
PROMPTS = ["Hi",
           "Tell me a long story about a dragon who learned to paint with watercolors.",
           "Explain paged attention in one sentence, please, and be brief about it."]


def _random_qwen3(path, head_dim: int):
    """A 2-layer random Qwen3 (4 heads, 2 KV heads, ``head_dim`` unlike hidden / heads = 16,
    q/k norms with random weights so they matter) with SmolLM2's tokenizer."""
    from transformers import Qwen3ForCausalLM as HFQwen3

    torch.manual_seed(77)
    config = Qwen3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=head_dim, vocab_size=49152, rope_theta=1e6,
        max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        tie_word_embeddings=True, initializer_range=0.1)
    model = HFQwen3(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, default_model_dir):
    path = _random_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), head_dim=32)
    AutoTokenizer.from_pretrained(default_model_dir).save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(path)
    return path


def test_registry_maps_architectures_and_model_types(qwen3_dir):
    assert registry.model_class(loader.load_config(qwen3_dir)) is Qwen3ForCausalLM
    for model_type in ("llama", "mistral", "qwen2"):
        config = Qwen3Config()  # any config object; only the names are read
        config.architectures, config.model_type = None, model_type
        assert registry.model_class(config) is LlamaForCausalLM


def test_max_model_len_follows_each_configs_rules():
    def derived(**kw) -> int:
        return registry.derived_max_model_len(LlamaConfig(**kw))

    assert derived(max_position_embeddings=4096) == 4096
    assert derived(max_position_embeddings=32768, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
        "rope_theta": 1e6}) == 131072  # Qwen2.5's long-context config
    assert derived(max_position_embeddings=4096, rope_parameters={
        "rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}) == 8192
    assert derived(max_position_embeddings=131072, rope_parameters={  # Llama 3.1
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_theta": 5e5}) == 131072
    phi35 = Phi3Config(max_position_embeddings=131072, original_max_position_embeddings=4096,
                       hidden_size=3072, num_attention_heads=32, rope_parameters={
                           "rope_type": "longrope", "rope_theta": 1e4,
                           "short_factor": [1.0] * 48, "long_factor": [2.0] * 48})
    assert registry.derived_max_model_len(phi35) == 131072  # the long factors serve it all
    phi3_4k = Phi3Config(max_position_embeddings=4096, sliding_window=2047)
    assert registry.derived_max_model_len(phi3_4k) == 4096  # its window is applied


def test_unsupported_architecture_is_refused_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["FalconForCausalLM"], "model_type": "falcon"}))
    with pytest.raises(loader.ModelLoadError) as e:
        loader.load_config(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "FalconForCausalLM" in msg and "'falcon'" in msg
    assert "supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, " \
        "Qwen3ForCausalLM" in msg


async def test_qwen3_greedy_matches_transformers(qwen3_dir):
    async with serve(qwen3_dir, max_num_batched_tokens=32) as client:
        for prompt in PROMPTS:
            want = hf_greedy(qwen3_dir, chat_prompt_ids(qwen3_dir, prompt), 16)
            body = await chat(client, prompt, max_tokens=16)
            assert body["choices"][0]["token_ids"] == want, prompt
        before = (await stats(client))["kv_cache"]["prefix_cache_hits"]
        again = await chat(client, PROMPTS[1], max_tokens=16)  # its full blocks cached
        after = (await stats(client))["kv_cache"]["prefix_cache_hits"]
    assert after > before
    assert again["choices"][0]["token_ids"] == hf_greedy(
        qwen3_dir, chat_prompt_ids(qwen3_dir, PROMPTS[1]), 16)


async def test_qwen3_preempted_requests_and_logprobs_match_transformers(qwen3_dir):
    await check_preempted_with_logprobs(qwen3_dir)


async def test_qwen3_speculative_decoding_keeps_greedy_output(qwen3_dir):
    """n-gram drafts verified by Qwen3 (several tokens a step through the q/k norms)."""
    prompt = "1 2 3 4 5 6 7 8 9 10 11 12 1 2 3 4 5 6 7 8 9 10 11 12 1 2 3 4"
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1)
    async with serve(qwen3_dir, speculative=spec) as client:
        body = await chat(client, prompt, max_tokens=24)
        s = (await stats(client))["scheduler"]
    assert body["choices"][0]["token_ids"] == hf_greedy(
        qwen3_dir, chat_prompt_ids(qwen3_dir, prompt), 24)
    assert s["spec_decode_num_draft_tokens"] > 0


async def test_qwen3_tensor_and_pipeline_parallel_match_transformers(qwen3_dir):
    """tp=2 x pp=2: each rank norms its own q/k heads with the whole norm weights."""
    async with serve(qwen3_dir, parallel=ParallelConfig(2, 2), async_scheduling=True,
                     max_num_batched_tokens=32) as client:
        s = await stats(client)
        for prompt in PROMPTS[1:]:
            want = hf_greedy(qwen3_dir, chat_prompt_ids(qwen3_dir, prompt), 12)
            body = await chat(client, prompt, max_tokens=12)
            assert body["choices"][0]["token_ids"] == want, prompt
    assert [(r["tp_rank"], r["pp_rank"]) for r in s["model"]["parallel"]] == [
        (0, 0), (1, 0), (0, 1), (1, 1)]


# Families our Llama class serves, each with what sets it apart: Qwen2.5's q/k/v biases,
# rope_theta 1e6 and the YaRN scaling its long-context configs add (a context of 4 x 512);
# Llama 3.x's frequency-dependent ``llama3`` RoPE scaling (an original context of 64 so that
# every frequency band of 16-wide heads is touched); Mistral v0.1's sliding window, applied
# (``test_sliding_window.py`` runs prompts past it). Tied embeddings for all (Qwen2.5
# 0.5-3B, Llama 3.2 1B/3B tie them). Phi-3: ``test_phi3.py``.
LLAMA_CLASS_FAMILIES = {
    "qwen2.5": (Qwen2Config, "Qwen2ForCausalLM", {"max_position_embeddings": 512,
                "sliding_window": 16, "use_sliding_window": False,  # Qwen's configs: unused
                "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                    "original_max_position_embeddings": 512}}),
    "mistral-v0.1": (MistralConfig, "MistralForCausalLM", {"sliding_window": 64}),
    "llama3.2": (LlamaConfig, "LlamaForCausalLM", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
}


def _family_dir(family: str, path, default_model_dir, **overrides):
    """A 2-layer random model of ``family`` (``LLAMA_CLASS_FAMILIES``; ``overrides`` replace
    its config fields) with SmolLM2's tokenizer, saved in ``path``."""
    import transformers

    config_cls, arch, extra = LLAMA_CLASS_FAMILIES[family]
    extra = {**extra, **overrides}
    torch.manual_seed(5)
    config = config_cls(**{
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152,
        "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 2, "tie_word_embeddings": True, "initializer_range": 0.1, **extra})
    model = getattr(transformers, arch)(config)
    if family == "qwen2.5":  # biases initialise to zero: make them count
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.bias.normal_(0, 0.5)
                layer.self_attn.k_proj.bias.normal_(0, 0.5)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(default_model_dir).save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(path)
    return path


@pytest.mark.parametrize("family", LLAMA_CLASS_FAMILIES)
async def test_llama_class_families_match_transformers(family, tmp_path, default_model_dir):
    """Concurrent requests, prompts chunked over 32-token steps, then a prefix-cache hit."""
    _family_dir(family, tmp_path, default_model_dir)
    assert registry.model_class(loader.load_config(tmp_path)) is LlamaForCausalLM
    async with serve(tmp_path, max_model_len=None, max_num_batched_tokens=32) as client:
        models = (await client.get("/v1/models")).json()["data"]
        # vLLM's rules: YaRN's factor times its original length; llama3 states its own;
        # Mistral's window does not cap it (it is applied).
        assert models[0]["max_model_len"] == 2048
        prompts = PROMPTS[1:]
        want = [hf_greedy(tmp_path, chat_prompt_ids(tmp_path, p), 16) for p in prompts]
        bodies = await asyncio.gather(*(chat(client, p, max_tokens=16) for p in prompts))
        assert [b["choices"][0]["token_ids"] for b in bodies] == want, family
        before = (await stats(client))["kv_cache"]["prefix_cache_hits"]
        again = await chat(client, prompts[0], max_tokens=16)
        assert (await stats(client))["kv_cache"]["prefix_cache_hits"] > before
        assert again["choices"][0]["token_ids"] == want[0], family


@pytest.mark.parametrize("family", ["qwen2.5", "llama3.2"])
async def test_llama_class_preempted_requests_and_logprobs(family, tmp_path, default_model_dir):
    """Qwen2.5's biases and YaRN, Llama 3.x's scaled RoPE, through preemption and
    recomputation (Mistral v0.1's: ``test_sliding_window.py``)."""
    await check_preempted_with_logprobs(_family_dir(family, tmp_path, default_model_dir))


@pytest.mark.parametrize("family", ["qwen2.5", "llama3.2"])
async def test_qwen25_and_llama3_under_tensor_parallel(family, tmp_path, default_model_dir):
    """-tp 2: Qwen2.5's q/k/v biases split with their heads, Llama 3.x's scaled RoPE tables
    on each rank, the tied vocabulary-parallel head."""
    _family_dir(family, tmp_path, default_model_dir)
    async with serve(tmp_path, parallel=ParallelConfig(2, 1)) as client:
        body = await chat(client, PROMPTS[1], max_tokens=12)
    assert body["choices"][0]["token_ids"] == hf_greedy(
        tmp_path, chat_prompt_ids(tmp_path, PROMPTS[1]), 12)


async def test_qwen3_gguf_head_dim_comes_from_the_tensors(tmp_path, default_model_dir):
    """transformers' GGUF config gives Qwen3 its default ``head_dim`` (128) whatever the file
    has; ours reads it off ``attn_q``'s rows. float32 tensors: transformers on the original
    weights is the oracle, of the greedy tokens and of every prompt and generated token's
    logprob."""
    from tests.gguf_tiny import LAYER_SHORTS, write_tiny_gguf

    src = _random_qwen3(tmp_path / "hf", head_dim=32)
    gguf = write_tiny_gguf(src, loader.embedded_gguf_path(), tmp_path / "tiny-qwen3-32.gguf",
                           loader.load_config(src), dict.fromkeys(LAYER_SHORTS), embedding=None)
    assert loader.load_config(loader.gguf_metadata_dir(gguf)).head_dim == 32
    async with serve(gguf, quantization="gguf", cpu_linear_mode="exact") as client:
        body = await chat(client, PROMPTS[1], max_tokens=12, **WITH_LOGPROBS)
    ids = chat_prompt_ids(default_model_dir, PROMPTS[1])
    check_served_answer(body, hf_model(src), ids, 12)


async def test_qwen3_gguf_kept_quantized_matches_transformers(tmp_path, default_model_dir):
    """llama.cpp's ``qwen3`` architecture (q/k norms as ``attn_q_norm``/``attn_k_norm``, rows
    not interleaved), its Q8_0/Q4_0/Q4_1 blocks read in place, against transformers' own
    reading of the file (``head_dim`` 128, which transformers assumes for Qwen3): greedy
    tokens and the logprobs of the prompt and generated tokens."""
    from tests.gguf_tiny import write_tiny_gguf

    src = _random_qwen3(tmp_path / "hf", head_dim=128)
    gguf = write_tiny_gguf(src, loader.embedded_gguf_path(), tmp_path / "tiny-qwen3.gguf",
                           loader.load_config(src))
    hf = hf_gguf_model(gguf)
    async with serve(gguf, quantization="gguf", cpu_linear_mode="exact") as client:
        s = await stats(client)
        for prompt in PROMPTS[:2]:
            ids = chat_prompt_ids(default_model_dir, prompt)
            body = await chat(client, prompt, max_tokens=12, **WITH_LOGPROBS)
            assert body["prompt_token_ids"] == ids
            check_served_answer(body, hf, ids, 12)
    assert s["model"]["quantization"] == "gguf"


async def test_qwen25_gguf_keeps_its_biases(tmp_path, default_model_dir):
    """llama.cpp's ``qwen2`` architecture (rows not interleaved, q/k/v biases as
    ``attn_*.bias``), float32 tensors: greedy tokens and the prompt's and generated tokens'
    logprobs equal transformers' on the original weights (a Qwen2.5 without YaRN: llama.cpp's
    converter writes it as keys this tiny writer leaves out)."""
    from tests.gguf_tiny import LAYER_SHORTS, write_tiny_gguf

    src = _family_dir("qwen2.5", tmp_path / "hf", default_model_dir,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    gguf = write_tiny_gguf(src, loader.embedded_gguf_path(), tmp_path / "tiny-qwen2.gguf",
                           loader.load_config(src), dict.fromkeys(LAYER_SHORTS), embedding=None)
    assert loader.load_config(loader.gguf_metadata_dir(gguf)).model_type == "qwen2"
    ids = chat_prompt_ids(src, PROMPTS[1])
    async with serve(gguf, quantization="gguf", cpu_linear_mode="exact") as client:
        body = await chat(client, PROMPTS[1], max_tokens=12, **WITH_LOGPROBS)
    check_served_answer(body, hf_model(src), ids, 12)


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "kept-quantized"])
async def test_llama3_gguf_keeps_its_rope_scaling(quantized, tmp_path, default_model_dir):
    """A Llama 3.x GGUF carries its ``llama3`` RoPE scaling only as the ``rope_freqs`` tensor
    (transformers' GGUF config drops it): served from the file, greedy tokens and the prompt's
    and generated tokens' logprobs equal the scaled model's. The oracle: for float32 tensors
    transformers on the original weights; for Q8_0/Q4_0/Q4_1 blocks read in place (a Q8_0
    tied embedding), transformers' de-quantized reading of the file with the original config
    (its RoPE scaling)."""
    from tests.gguf_tiny import LAYER_SHORTS, Q, write_tiny_gguf

    src = _family_dir("llama3.2", tmp_path / "hf", default_model_dir)
    types, embedding = (None, Q.Q8_0) if quantized else (dict.fromkeys(LAYER_SHORTS), None)
    gguf = write_tiny_gguf(src, loader.embedded_gguf_path(), tmp_path / "tiny-llama3.gguf",
                           loader.load_config(src), types, embedding=embedding)
    factors = loader.load_config(loader.gguf_metadata_dir(gguf)).rope_freq_factors
    assert len(factors) == 8 and max(factors) == pytest.approx(8.0) and min(factors) == 1.0
    hf = hf_gguf_model(gguf, loader.load_config(src)) if quantized else hf_model(src)
    async with serve(gguf, quantization="gguf", cpu_linear_mode="exact") as client:
        for prompt in PROMPTS[1:]:
            ids = chat_prompt_ids(src, prompt)
            body = await chat(client, prompt, max_tokens=16, **WITH_LOGPROBS)
            check_served_answer(body, hf, ids, 16)


async def test_a_context_past_an_unapplied_sliding_window_is_refused(tmp_path, default_model_dir,
                                                                     monkeypatch):
    """A model class that does not apply its config's window (none of ours now) caps the
    context to it, as vLLM's --disable-sliding-window does."""
    class Unwindowed(LlamaForCausalLM):
        honours_sliding_window = False

    _family_dir("mistral-v0.1", tmp_path, default_model_dir)
    monkeypatch.setitem(registry.ARCHITECTURES, "MistralForCausalLM", (Unwindowed, "mistral"))
    assert registry.derived_max_model_len(loader.load_config(tmp_path)) == 64
    with pytest.raises(loader.ModelLoadError, match="sliding window .64 tokens.*--max-model-len 64"):
        async with serve(tmp_path, max_model_len=128):
            pass
