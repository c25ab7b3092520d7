"""What tensor and pipeline parallelism cost on this machine (issue 13), in one run.

1. Collectives, between two spawned gloo ranks on the CPU: one ``all_reduce`` of a decode's
   hidden states ``[S, hidden]`` float32 (two per layer), and the step's broadcast of a pickled
   32-request decode ``SchedulerOutput``: over pipes (what the mp executor does) and, for
   comparison, with ``torch.distributed.broadcast_object_list`` over gloo.
2. The engine in this process, greedy, EOS ignored, ``--output-tokens`` per request, at 1 / 8 /
   32 concurrent streams: output tok/s, mean TTFT and ITL, for tp=1 (all the threads), tp=2
   and pp=2 (``threads / ranks`` each), and the mp executor's measured broadcast per step.

The model: a random Llama of SmolLM2-135M's width (hidden 576, MLP 1536, vocab 49152) with 8
heads and 4 KV heads (SmolLM2's 9 heads do not split in two) and ``--layers`` layers.

Usage: ``.venv/bin/python loadtest/bench_parallel.py [--layers 12] [--output-tokens 32]
[--streams 1,8,32] [--json out.json]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import pickle
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pagedserve.actors.config import SchedulerConfig
from pagedserve.actors.engine import AsyncEngine, EngineConfig
from pagedserve.gpu.batch import ScheduledRequest, SchedulerOutput
from pagedserve.gpu.config import CacheConfig, ModelConfig, ParallelConfig
from pagedserve.gpu.cpu_threads import cpu_threads
from pagedserve.gpu.parallel.comm import free_port
from pagedserve.gpu.sampling_params import SamplingParams

HIDDEN = 576


def build_model(layers: int, path: Path) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from pagedserve.gpu import loader

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=1536, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, vocab_size=49152,
                         max_position_embeddings=2048, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(loader.resolve_model(None).path).save_pretrained(path)
    return path


def decode_step(num_reqs: int = 32) -> SchedulerOutput:
    greedy = SamplingParams(temperature=0.0, max_tokens=256)
    return SchedulerOutput([ScheduledRequest(f"req-{i}", [1234], 300, list(range(20)), greedy,
                                             True, 200) for i in range(num_reqs)])


def _collective_rank(rank: int, port: int, results, iters: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    out = {}
    for rows in (1, 32):
        x = torch.randn(rows, HIDDEN)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        out[f"all_reduce_us_{rows}x{HIDDEN}"] = (time.perf_counter() - start) / iters * 1e6
    so = decode_step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        obj = [so if rank == 0 else None]
        dist.broadcast_object_list(obj, src=0)
    out["gloo_broadcast_object_us"] = (time.perf_counter() - start) / iters * 1e6
    if rank == 0:
        results.put(out)
    dist.destroy_process_group()


def _pipe_echo(conn, iters: int) -> None:
    for _ in range(iters):
        conn.recv()
        conn.send_bytes(b"k")


def collectives(iters: int = 300) -> dict:
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_collective_rank, args=(r, port, results, iters)) for r in (0, 1)]
    for p in procs:
        p.start()
    out = results.get(timeout=300)
    for p in procs:
        p.join()
    # The mp executor's way: pickle once, write the bytes to the pipe; the worker unpickles.
    parent, child = ctx.Pipe()
    echo = ctx.Process(target=_pipe_echo, args=(child, iters))
    echo.start()
    so = decode_step()
    start = time.perf_counter()
    for _ in range(iters):
        parent.send_bytes(pickle.dumps(("step", so), protocol=pickle.HIGHEST_PROTOCOL))
        parent.recv_bytes()
    out["pipe_broadcast_roundtrip_us"] = (time.perf_counter() - start) / iters * 1e6
    echo.join()
    out["decode_step_pickle_bytes"] = len(pickle.dumps(("step", so), pickle.HIGHEST_PROTOCOL))
    return out


async def _one(engine, i: int, prompt: list[int], n: int) -> tuple[float, list[float]]:
    start, times = time.perf_counter(), []
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    async for delta in engine.generate(f"b{i}-{time.time_ns()}", prompt, params):
        times.extend([time.perf_counter()] * len(delta.token_ids))
    return times[0] - start, [b - a for a, b in zip(times, times[1:])]


async def serve_level(engine, streams: int, n: int) -> dict:
    prompts = [[1, *range(100 + 7 * i, 164 + 7 * i)] for i in range(streams)]
    start = time.perf_counter()
    got = await asyncio.gather(*(_one(engine, i, p, n) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - start
    itl = [x for _, gaps in got for x in gaps]
    return {"streams": streams, "output_tok_s": round(streams * n / wall, 1),
            "ttft_ms": round(statistics.mean(t for t, _ in got) * 1e3, 1),
            "itl_ms": round(statistics.mean(itl) * 1e3, 2)}


async def bench_layout(path: Path, tp: int, pp: int, streams: list[int], n: int) -> dict:
    config = EngineConfig(
        model=ModelConfig(model=str(path), dtype="float32", max_model_len=512),
        cache=CacheConfig(num_gpu_blocks_override=1200),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048),
        parallel=ParallelConfig(tp, pp))
    engine = await AsyncEngine.start(config)
    try:
        await serve_level(engine, 1, 4)  # warm-up
        ex = engine.executor
        b0, s0 = getattr(ex, "broadcast_seconds", 0.0), getattr(ex, "num_steps", 0)
        levels = [await serve_level(engine, s, n) for s in streams]
        steps = getattr(ex, "num_steps", 0) - s0
        bcast = (getattr(ex, "broadcast_seconds", 0.0) - b0) / steps * 1e6 if steps else None
    finally:
        await engine.shutdown()
    return {"tp": tp, "pp": pp, "levels": levels,
            "broadcast_us_per_step": None if bcast is None else round(bcast, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    result = {"cpu_threads": cpu_threads(), "collectives": collectives()}
    print(json.dumps(result["collectives"], indent=1), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(args.layers, Path(tmp))
        result["layouts"] = []
        for tp, pp in ((1, 1), (2, 1), (1, 2)):
            r = asyncio.run(bench_layout(path, tp, pp, streams, args.output_tokens))
            print(json.dumps(r), flush=True)
            result["layouts"].append(r)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
