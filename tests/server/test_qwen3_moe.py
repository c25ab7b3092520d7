"""Qwen3-MoE (issue 29's mixture of experts) through the real server: greedy output equal to
transformers' ``generate`` in float32 for batched, chunked, preempted and prefix-cached
requests, with n-gram speculative decoding, under ``-tp 2 -pp 2`` (every expert's
intermediate rows split), and from GGUF files whose 3-D expert tensors stay quantized
(``gpu/gguf_moe.py``): legacy Q8_0 / Q4_1 / Q4_0 blocks, and Q4_K / Q5_K / Q6_K ones."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoTokenizer, GenerationConfig, Qwen3MoeConfig

from pagedserve.gpu import loader
from pagedserve.gpu.config import ParallelConfig
from pagedserve.gpu.models import registry
from pagedserve.gpu.models.qwen3_moe import Qwen3MoeForCausalLM, is_sparse_layer
from tests.conftest import chat, chat_prompt_ids, hf_greedy, serve, stats
from tests.server.preemption import check_preempted_with_logprobs

PROMPTS = ["Hi",
           "Tell me a long story about a dragon who learned to paint with watercolors.",
           "Explain paged attention in one sentence, please, and be brief about it."]


def random_qwen3_moe(path, mlp_only_layers=(1,), seed: int = 29, **kw):
    """A 3-layer random Qwen3-MoE (4 heads of 32, 2 KV heads, 8 experts of width 64, top-2
    renormalised; layer 1 dense unless ``mlp_only_layers`` says otherwise) with SmolLM2's
    vocabulary size; router and q/k norms random so that routing and norms matter."""
    from transformers import Qwen3MoeForCausalLM as HFQwen3Moe

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**{
        "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 64,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "mlp_only_layers": list(mlp_only_layers), "vocab_size": 49152, "rope_theta": 1e6,
        "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 2, "tie_word_embeddings": True, "initializer_range": 0.1, **kw})
    model = HFQwen3Moe(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0, 0.5)  # distinct experts per token
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, default_model_dir):
    path = random_qwen3_moe(tmp_path_factory.mktemp("tiny-qwen3-moe"))
    AutoTokenizer.from_pretrained(default_model_dir).save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(path)
    return path


def test_registry_and_sparse_layers(moe_dir):
    config = loader.load_config(moe_dir)
    assert registry.model_class(config) is Qwen3MoeForCausalLM
    assert [is_sparse_layer(config, i) for i in range(3)] == [True, False, True]
    config.decoder_sparse_step, config.mlp_only_layers = 2, []
    assert [is_sparse_layer(config, i) for i in range(3)] == [False, True, False]


async def test_batched_chunked_prefix_cached_greedy_matches_transformers(moe_dir):
    """Three requests at once (their tokens in one step, each routed on its own), prefills
    chunked by the 32-token budget, then a prefix-cache hit: all equal transformers'."""
    want = [hf_greedy(moe_dir, chat_prompt_ids(moe_dir, p), 16) for p in PROMPTS]
    async with serve(moe_dir, max_num_batched_tokens=32) as client:
        bodies = await asyncio.gather(*(chat(client, p, max_tokens=16) for p in PROMPTS))
        before = (await stats(client))["kv_cache"]["prefix_cache_hits"]
        again = await chat(client, PROMPTS[1], max_tokens=16)
        after = (await stats(client))["kv_cache"]["prefix_cache_hits"]
    assert [b["choices"][0]["token_ids"] for b in bodies] == want
    assert after > before and again["choices"][0]["token_ids"] == want[1]


async def test_preempted_requests_keep_the_greedy_output_and_logprobs(moe_dir):
    """More requests than blocks: the preempted ones recompute (prompt and generated tokens
    routed again) and still equal transformers' (``preemption.check_preempted_with_logprobs``)."""
    await check_preempted_with_logprobs(moe_dir)


async def test_tensor_and_pipeline_parallel_split_the_experts(moe_dir):
    """-tp 2 -pp 2: each rank holds half of every expert's 64 intermediate rows (and half the
    dense layer's 128) of its stage's layers, routes with the whole router; one all-reduce
    per block."""
    async with serve(moe_dir, parallel=ParallelConfig(2, 2), max_num_batched_tokens=32) as c:
        s = await stats(c)
        bodies = await asyncio.gather(*(chat(c, p, max_tokens=12) for p in PROMPTS[1:]))
    assert [r["layers"] for r in s["model"]["parallel"]] == [[0, 2], [0, 2], [2, 3], [2, 3]]
    for prompt, body in zip(PROMPTS[1:], bodies, strict=True):
        assert body["choices"][0]["token_ids"] == hf_greedy(
            moe_dir, chat_prompt_ids(moe_dir, prompt), 12), prompt


async def test_speculative_decoding_keeps_greedy_output(moe_dir):
    """n-gram drafts verified by the MoE model: several tokens of one request a step, each
    routed on its own."""
    from pagedserve.actors.spec_decode.proposer import SpeculativeConfig

    prompt = "1 2 3 4 5 6 7 8 9 10 11 12 1 2 3 4 5 6 7 8 9 10 11 12 1 2 3 4"
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1)
    async with serve(moe_dir, speculative=spec) as client:
        body = await chat(client, prompt, max_tokens=24)
        s = (await stats(client))["scheduler"]
    assert body["choices"][0]["token_ids"] == hf_greedy(
        moe_dir, chat_prompt_ids(moe_dir, prompt), 24)
    assert s["spec_decode_num_draft_tokens"] > 0


def _dequantized_hf(gguf, src):
    """transformers' Qwen3-MoE (``src``'s config) holding the GGUF file's weights
    de-quantized by gguf-py: the oracle for the kept-quantized path."""
    import numpy as np
    from gguf import GGUFReader, quants
    from transformers import Qwen3MoeForCausalLM as HFQwen3Moe

    def value(t):
        shape = tuple(int(d) for d in reversed(t.shape))
        return torch.from_numpy(np.array(
            quants.dequantize(np.asarray(t.data), t.tensor_type)).reshape(shape)).float()

    f = {t.name: value(t) for t in GGUFReader(str(gguf)).tensors}
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
             "ffn_gate_inp": "mlp.gate", "ffn_down_exps": "mlp.experts.down_proj"}
    state = {"model.embed_tokens.weight": f["token_embd.weight"],
             "model.norm.weight": f["output_norm.weight"]}
    model = HFQwen3Moe.from_pretrained(src, dtype=torch.float32).eval()
    for i in range(model.config.num_hidden_layers):
        for short, ours in names.items():
            leaf = "" if ours.endswith("_proj") and "experts" in ours else ".weight"
            state[f"model.layers.{i}.{ours}{leaf}"] = f[f"blk.{i}.{short}.weight"]
        state[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat(
            (f[f"blk.{i}.ffn_gate_exps.weight"], f[f"blk.{i}.ffn_up_exps.weight"]), dim=1)
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model


def _oracle(gguf, src, prompt: str, n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy ``n`` tokens for ``prompt`` on ``gguf``'s de-quantized weights
    (``_dequantized_hf``) and each one's logprob."""
    hf = _dequantized_hf(gguf, src)
    ids = chat_prompt_ids(src, prompt)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        want = out[0, len(ids):].tolist()
        logits = hf(out).logits[0, len(ids) - 1:-1].log_softmax(-1)
    return want, [logits[j, t].item() for j, t in enumerate(want)]


async def _served_from_blocks(gguf, mode: str, max_tokens: int) -> tuple[dict, dict]:
    """(the choice of one greedy chat with logprobs, ``weights_resident``) in ``mode``."""
    async with serve(gguf, quantization="gguf", cpu_linear_mode=mode) as client:
        s = await stats(client)
        body = await chat(client, PROMPTS[1], max_tokens=max_tokens, logprobs=True)
    return body["choices"][0], s["config"]["model"]["weights_resident"]


def _write_moe_gguf(tmp_path, default_model_dir, name: str, types=None, **config):
    """A 2-layer random Qwen3-MoE (every layer sparse; ``config`` overrides) with SmolLM2's
    tokenizer, and its GGUF (``gguf_tiny.write_tiny_gguf``, ``types`` per GGUF tensor)."""
    from tests.gguf_tiny import write_tiny_gguf

    src = random_qwen3_moe(tmp_path / "hf", mlp_only_layers=(), num_hidden_layers=2, **config)
    AutoTokenizer.from_pretrained(default_model_dir).save_pretrained(src)
    return src, write_tiny_gguf(src, loader.embedded_gguf_path(), tmp_path / name,
                                loader.load_config(src), types)


async def test_gguf_experts_kept_quantized_match_transformers(tmp_path, default_model_dir):
    """llama.cpp's ``qwen3moe`` layout (3-D Q8_0 / Q4_1 / Q4_0 expert tensors, F32 router)
    served from the file's blocks, in both kernel modes and over two pipeline stages: the
    experts are never de-quantized, and greedy tokens and their logprobs equal transformers'
    on the de-quantized weights; tensor parallelism is refused in one line."""
    src, gguf = _write_moe_gguf(tmp_path, default_model_dir, "tiny-moe.gguf")
    meta = loader.load_config(loader.gguf_metadata_dir(gguf))
    assert (meta.model_type, meta.moe_intermediate_size, meta.num_experts) == (
        "qwen3_moe", 64, 8)
    want, want_lp = _oracle(gguf, src, PROMPTS[1], 10)
    for mode in ("exact", "int8"):
        got, weights = await _served_from_blocks(gguf, mode, 10)
        # only the two F32 routers are float: every 3-D expert tensor is kept as blocks
        assert (weights["dequantized_tensors"], weights["dequantized_types"]) == (2, ["F32"])
        assert weights["quantized_bytes"] > weights["float_bytes"] / 4
        if mode == "exact":  # the de-quantized weights' exact products
            assert got["token_ids"] == want
            lp = [c["logprob"] for c in got["logprobs"]["content"]]
            assert lp == pytest.approx(want_lp, abs=2e-3)
        else:  # int8 activations: llama.cpp's arithmetic, close to the float products
            assert got["token_ids"][:3] == want[:3]
    # -pp 2: each stage reads its layer's experts from the file in place, as one process
    async with serve(gguf, quantization="gguf", cpu_linear_mode="exact",
                     parallel=ParallelConfig(1, 2)) as client:
        s = await stats(client)
        body = await chat(client, PROMPTS[1], max_tokens=10, logprobs=True)
    assert [r["layers"] for r in s["model"]["parallel"]] == [[0, 1], [1, 2]]
    weights = s["config"]["model"]["weights_resident"]  # the first stage's: layer 0's router
    assert (weights["dequantized_tensors"], weights["dequantized_types"]) == (1, ["F32"])
    assert body["choices"][0]["token_ids"] == want
    lp = [c["logprob"] for c in body["choices"][0]["logprobs"]["content"]]
    assert lp == pytest.approx(want_lp, abs=2e-3)
    with pytest.raises(ValueError, match="GGUF mixture of experts splits over pipeline stages"):
        async with serve(gguf, quantization="gguf", parallel=ParallelConfig(2, 1)):
            pass


async def test_kquant_gguf_experts_kept_quantized_match_transformers(tmp_path,
                                                                    default_model_dir):
    """A ``_K_M``-like file's experts: Q4_K gate, Q5_K up, Q6_K down (256-weight super-blocks,
    so hidden and ``moe_intermediate_size`` are 256), read in place in both modes, none
    de-quantized; in the exact mode (float32) greedy tokens and logprobs equal transformers'
    on the de-quantized weights."""
    from gguf import GGUFReader

    from tests.gguf_tiny import Q

    kquants = {"ffn_gate_exps": Q.Q4_K, "ffn_up_exps": Q.Q5_K, "ffn_down_exps": Q.Q6_K}
    src, gguf = _write_moe_gguf(tmp_path, default_model_dir, "tiny-moe-k.gguf", kquants,
                                hidden_size=256, moe_intermediate_size=256)
    types = {t.name: t.tensor_type for t in GGUFReader(str(gguf)).tensors}
    assert types["blk.1.ffn_down_exps.weight"] == Q.Q6_K
    assert types["blk.0.ffn_gate_exps.weight"] == Q.Q4_K
    want, want_lp = _oracle(gguf, src, PROMPTS[1], 10)
    for mode in ("exact", "int8"):
        got, weights = await _served_from_blocks(gguf, mode, 10)
        assert (weights["dequantized_tensors"], weights["dequantized_types"]) == (2, ["F32"])
        if mode == "exact":
            assert got["token_ids"] == want
            lp = [c["logprob"] for c in got["logprobs"]["content"]]
            assert lp == pytest.approx(want_lp, abs=2e-3)
        else:
            # int8 quantizes activations per 256 values against K-quants (llama.cpp's Q8_K),
            # coarser than per 32: this random model's flat next-token distributions (logprobs
            # near -5.5) tie closely enough that the third token may flip, so two tokens and the
            # first one's logprob.
            assert got["token_ids"][:2] == want[:2]
            first_lp = got["logprobs"]["content"][0]["logprob"]
            assert first_lp == pytest.approx(want_lp[0], abs=0.25)
