"""``--kv-cache-dtype``: 8-bit KV blocks serve the tiny model with greedy output close to
``auto``'s, hold about twice the blocks of bfloat16 in a budget, and bad values or backends
that cannot read them are refused with a reason."""

from __future__ import annotations

import pytest
import torch

from pagedserve.gpu import kv_cache
from pagedserve.gpu.config import CacheConfig
from pagedserve.gpu.loader import load_config
from pagedserve.server.cli import build_parser
from tests.conftest import chat, serve

PROMPTS = ["Tell me about the sea.", "What is 2 + 2?", "Write a haiku about rain.",
           "Name three colours.", "Why is the sky blue?", "Say hello in French."]
MAX_TOKENS = 24


async def greedy_tokens(model_dir, kv_cache_dtype: str) -> list[list[int]]:
    async with serve(model_dir, kv_cache_dtype=kv_cache_dtype) as client:
        return [(await chat(client, p, max_tokens=MAX_TOKENS))["choices"][0]["token_ids"]
                for p in PROMPTS]


# Measured here (Sapphire Rapids, avx512 tier, float32), tokens before each prompt's first
# divergence, of 6 x 24: int8 139, fp8 (e4m3) 116, fp8_e5m2 77 (2 mantissa bits). The bounds
# leave a margin for another tier's summation order, and fail a read that is broken.
AGREEMENT = {"int8": 0.85, "fp8": 0.65, "fp8_e5m2": 0.4}


@pytest.mark.parametrize("name", list(AGREEMENT))
async def test_8bit_kv_greedy_output_agrees_with_auto(tiny_model_dir, name):
    want = await greedy_tokens(tiny_model_dir, "auto")
    got = await greedy_tokens(tiny_model_dir, name)
    assert all(len(g) == MAX_TOKENS for g in got)
    # Token agreement up to each prompt's first divergence (after it, the contexts differ).
    agree = 0
    for w, g in zip(want, got, strict=True):
        agree += next((i for i, (a, b) in enumerate(zip(w, g, strict=True)) if a != b), len(w))
    assert agree >= AGREEMENT[name] * len(PROMPTS) * MAX_TOKENS, (agree, want, got)


def test_8bit_budget_holds_about_twice_the_blocks_of_bfloat16(tiny_model_dir):
    config = load_config(tiny_model_dir)
    cc = CacheConfig(kv_cache_memory_bytes=64 * 2**20)
    cpu = torch.device("cpu")
    bf16 = kv_cache.num_blocks_for(config, cc, torch.bfloat16, cpu, 0)
    _, kv_heads, head_size = kv_cache.kv_shape(config)
    for name in ("int8", "fp8", "fp8_e4m3", "fp8_e5m2"):
        dtype = kv_cache.cache_dtype(name, torch.bfloat16)
        n = kv_cache.num_blocks_for(config, cc, dtype, cpu, 0)
        # 2 bytes per value against 1 + 4 / head_size (the scale)
        assert n == pytest.approx(bf16 * 2 * head_size / (head_size + 4), rel=0.01), name
        caches = kv_cache.allocate_kv_caches(config, 3, 16, dtype, cpu)
        assert caches[0][0].dtype == dtype
        assert sum(t.nbytes for kv in caches for t in kv) == 3 * kv_cache.bytes_per_block(
            config, 16, dtype)
    assert kv_cache.cache_dtype("auto", torch.bfloat16) == torch.bfloat16


def test_bad_kv_cache_dtype_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--kv-cache-dtype", "fp4"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--kv-cache-dtype: invalid choice: 'fp4'" in err
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8_e5m2"])
    assert args.kv_cache_dtype == "fp8_e5m2" and args.vllm_ignored == []
    with pytest.raises(ValueError, match="choose from"):
        kv_cache.cache_dtype("fp4", torch.float32)
