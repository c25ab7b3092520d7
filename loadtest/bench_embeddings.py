"""Embeddings per second: pagedserve's pooling engine against transformers, same machine.

The workload of a retrieval indexer (issue 32): ``--num-chunks`` chunks (512) of about
``--chunk-tokens`` tokens (200, each length drawn in +-10%), embedded by last-token pooling
of SmolLM2-135M's final hidden states (``--runner pooling --convert embed``), L2-normalised.

- pagedserve: every chunk queued at once through ``AsyncEngine.encode`` (the scheduler batches
  them under ``--max-num-batched-tokens``, paged KV blocks, no padding);
- transformers: ``AutoModel`` in batches of ``--hf-batch-size``, right-padded with an
  attention mask, the last real token's hidden state pooled.

Both take the same token ids, dtype and device; the first chunks' vectors are compared
(max abs difference). Chunks are random token ids (seeded), so the prefix cache never hits.
Figures on a shared machine are noisy: run it alone, and read them as such.

Usage: ``python loadtest/bench_embeddings.py [--num-chunks 512] [--device cuda]
[--dtype float32] [--model DIR] [--result-json out.json]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedserve.actors.core.config import SchedulerConfig
from pagedserve.actors.engine.async_engine import AsyncEngine
from pagedserve.actors.engine.config import EngineConfig
from pagedserve.gpu import loader
from pagedserve.gpu.config import CacheConfig, ModelConfig
from pagedserve.gpu.pooling.pooling_params import PoolingParams


def make_chunks(n: int, tokens: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(tokens * 9 // 10,
                                                                   tokens * 11 // 10))]
            for _ in range(n)]


async def run_pagedserve(args, chunks: list[list[int]]) -> tuple[float, list[list[float]]]:
    config = EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype, device=args.device,
                          runner="pooling", convert="embed", max_model_len=1024),
        cache=CacheConfig(kv_cache_memory_bytes=2 * 1024**3),
        scheduler=SchedulerConfig(max_num_seqs=256,
                                  max_num_batched_tokens=args.max_num_batched_tokens))
    engine = await AsyncEngine.start(config)
    try:
        params = PoolingParams()
        await asyncio.gather(*(engine.encode(f"warm-{i}", c, params)
                               for i, c in enumerate(chunks[:8])))
        start = time.perf_counter()
        outs = await asyncio.gather(*(engine.encode(f"c-{i}", c, params)
                                      for i, c in enumerate(chunks)))
        seconds = time.perf_counter() - start
    finally:
        await engine.shutdown()
    return seconds, [o.data for o in outs]


@torch.inference_mode()
def run_transformers(args, chunks: list[list[int]]) -> tuple[float, torch.Tensor]:
    from transformers import AutoModel

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = AutoModel.from_pretrained(args.model, dtype=dtype).to(args.device).eval()

    def embed(batch: list[list[int]]) -> torch.Tensor:
        width = max(map(len, batch))
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, c in enumerate(batch):
            ids[i, : len(c)] = torch.tensor(c)
            mask[i, : len(c)] = 1
        h = model(ids.to(args.device), attention_mask=mask.to(args.device)).last_hidden_state
        last = h[torch.arange(len(batch)), mask.sum(1).to(args.device) - 1]
        return F.normalize(last.float(), dim=-1).cpu()

    embed(chunks[:8])  # warm-up
    bs = args.hf_batch_size
    if args.device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = torch.cat([embed(chunks[i:i + bs]) for i in range(0, len(chunks), bs)])
    seconds = time.perf_counter() - start
    return seconds, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2, "
                   "de-quantized to a float folder, so both sides read the same weights)")
    p.add_argument("--num-chunks", type=int, default=512)
    p.add_argument("--chunk-tokens", type=int, default=200)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--result-json", default=None)
    args = p.parse_args()
    if args.model is None:
        args.model = str(loader.convert_gguf(loader.embedded_gguf_path()))
    vocab = loader.load_config(Path(args.model)).vocab_size
    chunks = make_chunks(args.num_chunks, args.chunk_tokens, vocab)
    result = {"num_chunks": len(chunks), "tokens": sum(map(len, chunks)),
              "device": args.device, "dtype": args.dtype,
              "torch_threads": torch.get_num_threads()}
    ps_s, ps_vecs = asyncio.run(run_pagedserve(args, chunks))
    result["pagedserve_s"] = round(ps_s, 3)
    result["pagedserve_embeddings_per_s"] = round(len(chunks) / ps_s, 2)
    if not args.skip_transformers:
        hf_s, hf_vecs = run_transformers(args, chunks)
        result["transformers_s"] = round(hf_s, 3)
        result["transformers_embeddings_per_s"] = round(len(chunks) / hf_s, 2)
        result["speedup"] = round(hf_s / ps_s, 2)
        diff = (torch.tensor(ps_vecs[:16]) - hf_vecs[:16]).abs().max().item()
        result["max_abs_diff_first_16"] = diff
    print(json.dumps(result, indent=2))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
