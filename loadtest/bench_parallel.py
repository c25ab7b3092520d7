"""What tensor and pipeline parallelism cost on this machine (issue 13), in one run.

1. Collectives, between two spawned gloo ranks on the CPU: one ``all_reduce`` of a decode's
   hidden states ``[S, hidden]`` float32 (two per layer), over gloo and over shared memory
   (``gpu/parallel/shm_all_reduce.py``, what the model's runs on one machine), and the step's
   broadcast of a pickled 32-request decode ``SchedulerOutput``: over pipes (what the mp
   executor does) and, for comparison, with ``torch.distributed.broadcast_object_list``.
2. Where a tp=2 step goes: one rank's ``ModelRunner`` decode step of 1 and 32 requests
   (one thread a rank, two spawned ranks) against tp=1's (two threads), with the time inside
   its all-reduces (per call, and per step: two a layer and the embedding's) and in the
   logits gather, timed around ``ParallelContext``'s methods; medians over the steps.
3. The engine in this process, greedy, EOS ignored, ``--output-tokens`` per request, at 1 / 8 /
   32 concurrent streams: output tok/s, mean TTFT and ITL, for tp=1 (all the threads), tp=2
   and pp=2 (``threads / ranks`` each), and the mp executor's measured broadcast per step;
   ``--rounds`` times with the layouts alternating (tp=1, tp=2, pp=2, tp=1, ...), so a busy
   neighbour slows all of them alike, and the median of the rounds reported.

The model: a random Llama of SmolLM2-135M's width (hidden 576, MLP 1536, vocab 49152) with 8
heads and 4 KV heads (SmolLM2's 9 heads do not split in two) and ``--layers`` layers.

Usage: ``.venv/bin/python loadtest/bench_parallel.py [--layers 12] [--output-tokens 32]
[--streams 1,8,32] [--rounds 3] [--layouts 1x1,2x1,1x2] [--json out.json]``
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

from pagedserve.actors.core.config import SchedulerConfig
from pagedserve.actors.engine.async_engine import AsyncEngine
from pagedserve.actors.engine.config import EngineConfig
from pagedserve.gpu.batch import ScheduledRequest, SchedulerOutput
from pagedserve.gpu.config import CacheConfig, ModelConfig, ParallelConfig
from pagedserve.gpu.cpu.threads import cpu_threads
from pagedserve.gpu.parallel.comm import free_port
from pagedserve.gpu.parallel.shm_all_reduce import ShmAllReduce
from pagedserve.gpu.sample.sampling_params import SamplingParams

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
    shm = ShmAllReduce.create_for_group(dist.group.WORLD, [0, 1])
    for rows in (1, 32):
        x = torch.randn(rows, HIDDEN)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        out[f"all_reduce_us_{rows}x{HIDDEN}"] = (time.perf_counter() - start) / iters * 1e6
        if shm is not None:  # what ParallelContext.all_reduce runs on one CPU machine
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                shm.all_reduce(x)
            out[f"shm_all_reduce_us_{rows}x{HIDDEN}"] = ((time.perf_counter() - start)
                                                         / iters * 1e6)
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


def _decode_batch(num_reqs: int, ctx: int = 64) -> SchedulerOutput:
    """``num_reqs`` decodes at position ``ctx``, each with its own blocks."""
    from pagedserve.gpu.batch import order_batch

    greedy, per = SamplingParams(temperature=0.0), ctx // 16 + 1
    return SchedulerOutput(order_batch([
        ScheduledRequest(f"r{i}", [100 + i], ctx, list(range(i * per, (i + 1) * per)), greedy,
                         True, ctx) for i in range(num_reqs)]))


def _timed_steps(path: str, parallel, batches: list[int], iters: int) -> dict:
    """Median step ms per batch size, and (under tp) the µs inside all-reduce and gather."""
    from pagedserve.gpu.model_runner import ModelRunner
    from pagedserve.gpu.parallel.comm import ParallelContext

    spent = {"all_reduce": 0.0, "calls": 0, "gather": 0.0}
    for method, key in (("all_reduce", "all_reduce"), ("gather_logits", "gather")):
        inner = getattr(ParallelContext, method)

        def timed(self, *args, _inner=inner, _key=key):
            start = time.perf_counter()
            try:
                return _inner(self, *args)
            finally:
                spent[_key] += time.perf_counter() - start
                spent["calls"] += _key == "all_reduce"
        setattr(ParallelContext, method, timed)
    runner = ModelRunner(ModelConfig(model=path, dtype="float32", max_model_len=512),
                         CacheConfig(num_gpu_blocks_override=600), 2048, 64, parallel=parallel)
    runner.load()
    out = {}
    for b in batches:
        so, times = _decode_batch(b), []
        for i in range(iters + 3):  # three warm-up steps
            if i == 3:
                spent.update(all_reduce=0.0, calls=0, gather=0.0)
            start = time.perf_counter()
            runner.execute_model(so)
            times.append(time.perf_counter() - start)
        calls = max(spent["calls"], 1)
        out[b] = {"step_ms": round(statistics.median(times[3:]) * 1e3, 2),
                  "all_reduce_us_per_call": round(spent["all_reduce"] / calls * 1e6, 1),
                  "all_reduces_per_step": spent["calls"] / iters,
                  "all_reduce_ms_per_step": round(spent["all_reduce"] / iters * 1e3, 2),
                  "gather_ms_per_step": round(spent["gather"] / iters * 1e3, 2)}
    return out


def _breakdown_rank(path: str, rank: int, tp: int, port: int, batches, iters, results) -> None:
    import os

    from pagedserve.gpu import loader
    from pagedserve.gpu.parallel.comm import ParallelContext
    from pagedserve.gpu.parallel.layout import rank_layout

    threads = 2 if tp == 1 else 1
    os.environ["PAGEDSERVE_CPU_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    parallel = None
    if tp > 1:
        layout = rank_layout(loader.load_config(Path(path)), tp, 1, rank)
        parallel = ParallelContext.init(layout, f"tcp://127.0.0.1:{port}", torch.device("cpu"))
    try:
        out = _timed_steps(path, parallel, batches, iters)
    finally:
        if parallel is not None:
            parallel.destroy()
    if rank == 0:
        results.put(out)


def step_breakdown(path: Path, batches=(1, 32), iters: int = 30) -> dict:
    """``{"tp1": {batch: ...}, "tp2": {batch: ...}}`` (``_timed_steps``), tp=1 first."""
    ctx, out = mp.get_context("spawn"), {}
    for tp in (1, 2):
        results, port = ctx.Queue(), free_port()
        procs = [ctx.Process(target=_breakdown_rank,
                             args=(str(path), r, tp, port, list(batches), iters, results))
                 for r in range(tp)]
        for p in procs:
            p.start()
        out[f"tp{tp}"] = results.get(timeout=600)
        for p in procs:
            p.join()
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


def median_of_rounds(rounds: list[dict]) -> dict:
    """One layout's rounds → the median of each figure at each stream count."""
    levels = []
    for i, level in enumerate(rounds[0]["levels"]):
        levels.append({"streams": level["streams"], **{
            k: round(statistics.median(r["levels"][i][k] for r in rounds), 2)
            for k in ("output_tok_s", "ttft_ms", "itl_ms")}})
    bcast = [r["broadcast_us_per_step"] for r in rounds if r["broadcast_us_per_step"]]
    return {"tp": rounds[0]["tp"], "pp": rounds[0]["pp"], "rounds": len(rounds),
            "levels": levels,
            "broadcast_us_per_step": round(statistics.median(bcast), 1) if bcast else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layouts", default="1x1,2x1,1x2", help="TPxPP, comma-separated")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    layouts = [tuple(int(x) for x in lay.split("x")) for lay in args.layouts.split(",")]
    result = {"cpu_threads": cpu_threads(), "collectives": collectives()}
    print(json.dumps(result["collectives"], indent=1), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(args.layers, Path(tmp))
        result["step_breakdown"] = step_breakdown(path)
        print(json.dumps(result["step_breakdown"]), flush=True)
        runs: dict[tuple[int, int], list[dict]] = {lay: [] for lay in layouts}
        for rnd in range(args.rounds):
            for tp, pp in layouts:
                r = asyncio.run(bench_layout(path, tp, pp, streams, args.output_tokens))
                print(json.dumps({"round": rnd, **r}), flush=True)
                runs[(tp, pp)].append(r)
        result["rounds"] = [r for rs in runs.values() for r in rs]
        result["medians"] = [median_of_rounds(rs) for rs in runs.values()]
        for r in result["medians"]:
            print("median", json.dumps(r), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
