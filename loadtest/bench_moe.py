"""Decode throughput of a random-weight Qwen3-MoE: ``pagedserve serve`` vs transformers.

The shape is Qwen3-30B-A3B's scaled to a 24 GiB, 2-core machine: the 30B's 2048 hidden,
48 layers, 128 experts of 768 (top-8) become ``SHAPES``' ``small`` (hidden 1024, 8 layers,
16 query heads of 64, 4 KV heads, 64 experts of 384, top-8, renormalised: ~0.68 B parameters,
~0.11 B active per token) with SmolLM2's tokenizer (vocabulary 49152). Random weights: the
output is noise, generation ignores EOS; the figures are speed only.

1. pagedserve (safetensors, ``--dtype``): output tokens/s over SSE with 1 and 8 concurrent
   greedy streams of ``--output-tokens`` each; with ``--gguf`` also the same weights written as
   a Q8_0 GGUF (``tests/gguf_tiny.py``'s writer) and served kept-quantized.
2. transformers' ``generate`` on the same weights and dtype, batch 1 and batch 8 (equal-length
   prompts, no padding), new tokens/s.

On a shared machine the figures are noisy: compare within one run.

Usage: ``PYTHONPATH=.shim .venv/bin/python loadtest/bench_moe.py [--output-tokens 32]
[--dtype bfloat16] [--shape small] [--gguf] [--workdir DIR]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.gguf_tiny for --gguf

SHAPES = {
    # Qwen3-30B-A3B itself: hidden 2048, 48 layers, 32 x 128 heads, 4 KV heads, 128 experts
    # of 768, top-8, vocabulary 151936 (too big here).
    "small": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=4, head_dim=64, num_experts=64, num_experts_per_tok=8,
                  moe_intermediate_size=384, intermediate_size=3072),
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=32, num_experts=16, num_experts_per_tok=4,
                 moe_intermediate_size=128, intermediate_size=512),
}
PROMPT = "Write a short story about a lighthouse keeper and the sea."


def build_model(shape: str, out: Path, dtype: torch.dtype) -> Path:
    """The random Qwen3-MoE of ``shape`` with SmolLM2's tokenizer, saved in ``out``."""
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from pagedserve.gpu import loader

    if (out / "config.json").exists():
        return out
    config = Qwen3MoeConfig(vocab_size=49152, max_position_embeddings=4096, rope_theta=1e6,
                            tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                            norm_topk_prob=True, initializer_range=0.02, **SHAPES[shape])
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).to(dtype)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.05)  # spread the routing over the experts
    model.save_pretrained(out)
    meta = loader.gguf_metadata_dir(loader.embedded_gguf_path())
    AutoTokenizer.from_pretrained(meta).save_pretrained(out)
    return out


def write_gguf(model_dir: Path, out: Path) -> Path:
    """``model_dir`` as a Q8_0 GGUF (attention, experts and embedding; F32 routers, norms)."""
    from transformers import AutoConfig

    from pagedserve.gpu import loader
    from tests.gguf_tiny import EXPERTS, LAYER_SHORTS, Q, write_tiny_gguf

    if out.exists():
        return out
    f32 = out.parent / "f32"
    if not (f32 / "model.safetensors").exists():  # the writer reads float32 safetensors
        from transformers import Qwen3MoeForCausalLM

        Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32).save_pretrained(
            f32, max_shard_size="100GB")
    types = dict.fromkeys([*LAYER_SHORTS, *EXPERTS], Q.Q8_0)
    types.update(attn_norm=None, ffn_norm=None)
    return write_tiny_gguf(f32, loader.embedded_gguf_path(), out, AutoConfig.from_pretrained(
        model_dir), types, embedding=Q.Q8_0)


async def _stream(client: httpx.AsyncClient, n: int) -> int:
    body = {"messages": [{"role": "user", "content": PROMPT}], "stream": True, "max_tokens": n,
            "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    return tokens


async def _streams(url: str, streams: int, n: int) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=1800) as client:
        await _stream(client, 4)  # warm-up
        start = time.perf_counter()
        tokens = await asyncio.gather(*(_stream(client, n) for _ in range(streams)))
        return sum(tokens) / (time.perf_counter() - start)


def bench_pagedserve(model: Path, dtype: str, n: int, extra: list[str]) -> dict:
    from pagedserve.server.launch import start_server_process

    proc, url = start_server_process(
        ["--model", str(model), "--dtype", dtype, "--max-model-len", "1024", *extra],
        timeout=1200, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return {f"{s}_streams_tok_s": round(asyncio.run(_streams(url, s, n)), 2)
                for s in (1, 8)}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)


def bench_transformers(model_dir: Path, dtype: torch.dtype, n: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                   add_generation_prompt=True)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    out = {"experts_implementation": getattr(model.config, "_experts_implementation", None)}
    for batch in (1, 8):
        inputs = ids.repeat(batch, 1)
        kw = dict(do_sample=False, attention_mask=torch.ones_like(inputs), pad_token_id=2)
        with torch.no_grad():
            model.generate(inputs, max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
            start = time.perf_counter()
            model.generate(inputs, max_new_tokens=n, min_new_tokens=n, **kw)
        out[f"batch_{batch}_tok_s"] = round(batch * n / (time.perf_counter() - start), 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=SHAPES, default="small")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--gguf", action="store_true", help="also serve a Q8_0 GGUF of it")
    p.add_argument("--workdir", type=Path, default=None, help="keep the model here")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-moe-"))
    model = build_model(args.shape, work / f"qwen3moe-{args.shape}", dtype)
    results = {"shape": {"name": args.shape, **SHAPES[args.shape]}, "dtype": args.dtype,
               "output_tokens": args.output_tokens,
               "pagedserve": bench_pagedserve(model, args.dtype, args.output_tokens, [])}
    if args.gguf:
        gguf = write_gguf(model, work / f"gguf-{args.shape}" / "model-q8_0.gguf")
        results["pagedserve_gguf_q8_0"] = bench_pagedserve(
            gguf, args.dtype, args.output_tokens, ["--quantization", "gguf"])
    results["transformers"] = bench_transformers(model, dtype, args.output_tokens)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
