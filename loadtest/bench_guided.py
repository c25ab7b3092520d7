"""Guided-decoding benchmark on the default model, in-process (no HTTP):

1. output tokens/s of a batch of 16 concurrent requests where half are guided by a JSON schema,
   against the same batch unguided, alternating in one run (target: guided >= 0.8x);
2. compile times of a medium JSON schema: the first compile and a cached one (and the one-time
   tokenizer set-up, which the engine does at start).

The schema asks for at least 64 strings, so a guided request runs to ``max_tokens`` like the
unguided ones (``ignore_eos``): both batches produce the same number of tokens.

    python loadtest/bench_guided.py [--max-tokens 48] [--rounds 2] [--device cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import time

import torch
import xgrammar as xgr

from pagedserve.actors.engine.async_engine import AsyncEngine
from pagedserve.actors.engine.config import EngineConfig
from pagedserve.gpu.config import CacheConfig, ModelConfig
from pagedserve.gpu.sample.grammar_bitmask import apply_grammar_bitmask
from pagedserve.gpu.sample.sampling_params import SamplingParams, StructuredOutputsParams

LONG = {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 64}
MEDIUM = {
    "$defs": {"address": {"type": "object", "properties": {
        "street": {"type": "string"}, "city": {"type": "string"},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "country": {"enum": ["FR", "DE", "US", "JP", "BR"]}}, "required": ["city", "zip"]}},
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 1000000},
        "name": {"type": "string", "minLength": 1, "maxLength": 64},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 8},
        "home": {"$ref": "#/$defs/address"},
        "work": {"anyOf": [{"$ref": "#/$defs/address"}, {"type": "null"}]},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "history": {"type": "array", "maxItems": 5, "items": {"type": "object", "properties": {
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "event": {"type": "string", "maxLength": 40}}, "required": ["year", "event"]}},
    },
    "required": ["id", "name", "email", "home", "role"],
}


async def run_batch(engine: AsyncEngine, tag: str, guided: bool, max_tokens: int) -> float:
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "List many short words as a JSON array."}],
        add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):
        ids = ids["input_ids"]

    async def one(i: int) -> int:
        spec = StructuredOutputsParams(json=LONG) if guided and i % 2 == 0 else None
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True,
                                structured_outputs=spec)
        # compiled first and handed on, as the HTTP handler does
        grammar = None if spec is None else await engine.compile_grammar(spec)
        n = 0
        async for d in engine.generate(f"{tag}-{i}", ids, params, grammar=grammar):
            n += len(d.token_ids)
        return n

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(16))))
    return tokens / (time.perf_counter() - start)


def mask_overhead_ms(engine: AsyncEngine, reps: int = 50) -> float:
    """CPU time per step of the guided work for 8 guided rows in a batch of 16: fill the
    bitmask rows, mask the logits, advance the matchers by one token."""
    reqs = [engine.structured_output.request_for(StructuredOutputsParams(json=LONG))
            for _ in range(8)]
    for r in reqs:
        r.matcher.accept_string('["abc", "de')
    vocab = reqs[0].vocab_size
    x = engine.tokenizer.convert_tokens_to_ids("x")
    logits = torch.randn(16, vocab)
    rows = {f"g{i}": i for i in range(8)}
    ids = [f"g{i // 2}" if i % 2 == 0 else f"u{i}" for i in range(16)]
    start = time.perf_counter()
    for _ in range(reps):
        bitmask = xgr.allocate_token_bitmask(8, vocab)
        for row, r in enumerate(reqs):
            r.matcher.fill_next_token_bitmask(bitmask, row)
        apply_grammar_bitmask(logits, bitmask, rows, ids)
        for r in reqs:
            r.matcher.accept_token(x)
            r.matcher.rollback(1)
    return (time.perf_counter() - start) / reps * 1000


async def main(args: argparse.Namespace) -> None:
    engine = await AsyncEngine.start(EngineConfig(
        model=ModelConfig(max_model_len=512, device=args.device),
        cache=CacheConfig(num_gpu_blocks_override=16 * 512 // 16 + 16)))
    try:
        t = time.perf_counter()
        await asyncio.wrap_future(engine.structured_output._compiler)
        setup = time.perf_counter() - t
        # Fresh schema texts (not the cached one) for the compile timings.
        spec = StructuredOutputsParams(json=copy.deepcopy(MEDIUM))
        t = time.perf_counter()
        await engine.compile_grammar(spec)
        first = time.perf_counter() - t
        t = time.perf_counter()
        await engine.compile_grammar(StructuredOutputsParams(json=json.dumps(MEDIUM, indent=2)))
        cached = time.perf_counter() - t
        await run_batch(engine, "warm", True, 4)
        plain, guided = [], []
        for r in range(args.rounds):
            plain.append(await run_batch(engine, f"plain{r}", False, args.max_tokens))
            guided.append(await run_batch(engine, f"guided{r}", True, args.max_tokens))
        p, g = max(plain), max(guided)
        print(json.dumps({
            "device": engine.info.device, "batch": 16, "guided_in_batch": 8,
            "max_tokens": args.max_tokens,
            "unguided_tok_s": [round(x, 1) for x in plain],
            "half_guided_tok_s": [round(x, 1) for x in guided],
            "ratio_best": round(g / p, 3),
            "guided_cpu_overhead_ms_per_step": round(mask_overhead_ms(engine), 3),
            "tokenizer_setup_wait_s": round(setup, 3),  # built in the background at start
            "medium_schema_first_compile_ms": round(first * 1000, 2),
            "medium_schema_cached_compile_ms": round(cached * 1000, 3),
        }, indent=2))
    finally:
        await engine.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"])
    asyncio.run(main(parser.parse_args()))
