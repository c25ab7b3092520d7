"""Data parallelism's two costs and gains (issue 14), in one script; ``--part`` picks
``split``, ``dp`` or ``both`` (default).

``split``: the cost of running the engine in its own process: the same engine in the API
process (``AsyncEngine``) and as one engine-core process behind ZeroMQ (``EngineCoreClient``
under ``DataParallelEngine``, what ``--data-parallel-size`` > 1 runs for every rank), with the
same threads, alternated over ``--rounds``:

1. output tokens/s with 1 and 8 concurrent greedy requests (EOS ignored, ``--output-tokens``
   each), read as the HTTP layer reads them (``engine.generate``'s deltas);
2. microseconds per message: encoding + decoding one ``OutputsMsg`` (1 and 8 streams' deltas
   of one token each), and a round trip front → core → front (a ``wait_idle`` call on an idle
   engine).

``dp``: for each stream count (default 8 and 32), ``--rounds`` times, each layout in turn: a
fresh ``pagedserve serve`` (the embedded SmolLM2-135M unless ``--model``) and one loadgen run
(``../shared/bench/loadgen.py``: seeded plain-English prompts, greedy, EOS ignored, every
server the same workload):

- ``dp=1``: one in-process engine with ``--threads`` (default 2) forward-pass threads;
- ``dp=2``: two engine-core processes behind the router (``--data-parallel-routing``, default
  ``prefix``), ``--threads / 2`` threads each.

Both run with ``PAGEDSERVE_CPU_THREADS=--threads`` (fixed: no thread governor, so the two
layouts get the same cores). Prints markdown tables (``split``: each round's figure; ``dp``:
each run's output tok/s, TTFT p50/p99, ITL p50, errors, then the medians and their ratio)
and, with ``--json``, writes the loadgen summaries.

Usage: ``.venv/bin/python loadtest/bench_dp.py [--part both|split|dp] [--model PATH]
[--threads 2] [--output-tokens 64] [--rounds 2] [--streams 8,32] [--requests-per-stream N]
[--min-tokens 32] [--max-tokens 256] [--max-words 400] [--json out.json]``. The loadgen
workload defaults to loadgen's own lengths and ``side_by_side.sh``'s request counts, the
workload behind the llama.cpp figures; the earlier, shorter one is ``--requests-per-stream 3
--max-tokens 64 --min-tokens 32 --max-words 200``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from pagedserve.server.launch import start_server_process


async def tokens_per_s(engine, streams: int, output_tokens: int, tag: str) -> float:
    from pagedserve.gpu.sample.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    ids = engine.tokenizer.encode("Write a short story about a lighthouse keeper.")

    async def one(i: int) -> int:
        n = 0
        async for delta in engine.generate(f"{tag}-{streams}-{i}", ids, params):
            n += len(delta.token_ids)
        return n

    await one(-1)  # warm-up
    start = time.perf_counter()
    total = sum(await asyncio.gather(*(one(i) for i in range(streams))))
    return total / (time.perf_counter() - start)


def codec_us(items: int, repeat: int = 20000) -> float:
    from pagedserve.actors.engine.protocol import GenerationDelta
    from pagedserve.actors.engine_core import messages as m

    msg = m.OutputsMsg([m.StreamItem(i, GenerationDelta(" word", [1234], None, 20, 5))
                        for i in range(items)])
    start = time.perf_counter()
    for _ in range(repeat):
        m.decode(m.encode(msg))
    return (time.perf_counter() - start) / repeat * 1e6


async def round_trip_us(client, repeat: int = 300) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        await client.wait_idle()
    return (time.perf_counter() - start) / repeat * 1e6


async def split_part(args: argparse.Namespace) -> None:
    os.environ["PAGEDSERVE_CPU_THREADS"] = str(args.threads)  # the same, fixed, for both
    from pagedserve.actors.dp.config import DataParallelConfig
    from pagedserve.actors.dp.launch import start_engine_processes
    from pagedserve.actors.engine.async_engine import AsyncEngine
    from pagedserve.actors.engine.config import EngineConfig
    from pagedserve.gpu.config import ModelConfig

    config = EngineConfig(model=ModelConfig(model=args.model, max_model_len=1024))
    rows: dict[str, list[float]] = {}
    for _ in range(args.rounds):  # alternate, so a noisy neighbour hits both alike
        for kind in ("in-process", "engine-core process"):
            engine = (await AsyncEngine.start(config) if kind == "in-process"
                      else await start_engine_processes(config, DataParallelConfig(1)))
            try:
                for streams in (1, 8):
                    rate = await tokens_per_s(engine, streams, args.output_tokens, kind[:2])
                    rows.setdefault(f"{kind}, {streams} stream(s), tok/s", []).append(rate)
                if kind != "in-process":
                    rtt = await round_trip_us(engine.engines[0])
                    rows.setdefault("round trip front→core→front, µs", []).append(rtt)
            finally:
                await engine.shutdown()
    for items in (1, 8):
        rows[f"encode+decode OutputsMsg of {items} delta(s), µs"] = [codec_us(items)]
    for name, values in rows.items():
        print(f"| {name} | {' / '.join(f'{v:.1f}' for v in values)} |", flush=True)


# ../shared/bench/loadgen.py beside the checkout, or one level up (a worktree in a folder).
LOADGEN = next((p for p in (Path(__file__).resolve().parents[i] / "shared" / "bench" /
                            "loadgen.py" for i in (2, 3)) if p.exists()),
               Path("../shared/bench/loadgen.py"))


def run_one(layout: dict, streams: int, args: argparse.Namespace) -> dict:
    """A fresh server with ``layout``'s flags, one loadgen run at ``streams``, the summary."""
    env = {**os.environ, "PAGEDSERVE_CPU_THREADS": str(args.threads)}
    serve_args = [*([args.model] if args.model else []), "--log-level", "warning",
                  "--disable-access-log", *layout["flags"]]
    proc, url = start_server_process(serve_args, env=env, stderr=subprocess.DEVNULL)
    try:
        out = subprocess.run(
            [sys.executable, str(args.loadgen), "--base-url", f"{url}/v1", "--model",
             args.served_name, "--num-requests", str(num_requests(streams, args)),
             "--concurrency", str(streams), "--seed", "0", "--min-words", "20",
             "--max-words", str(args.max_words), "--min-tokens", str(args.min_tokens),
             "--max-tokens", str(args.max_tokens), "--label", f"{layout['name']} x{streams}"],
            capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def num_requests(streams: int, args: argparse.Namespace) -> int:
    """side_by_side.sh's scenarios b (64 requests at 8 streams) and c (128 at 32), else
    ``--requests-per-stream`` per stream."""
    if args.requests_per_stream is None:
        return {8: 64, 32: 128}.get(streams, 4 * streams)
    return streams * args.requests_per_stream


def dp_part(args: argparse.Namespace) -> None:
    layouts = [
        {"name": f"dp=1, {args.threads} threads", "flags": []},
        {"name": f"dp=2, {max(1, args.threads // 2)} thread(s) each ({args.routing})",
         "flags": ["--data-parallel-size", "2", "--data-parallel-routing", args.routing]},
    ]
    rows = []
    for streams in (int(s) for s in args.streams.split(",")):
        for _ in range(args.rounds):  # layouts alternated: a noisy spell hits both alike
            for layout in layouts:
                summary = run_one(layout, streams, args)
                rows.append(summary)
                print(json.dumps(summary), file=sys.stderr, flush=True)
    print("| layout | streams | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | errors |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        name, _, streams = r["label"].rpartition(" x")
        print(f"| {name} | {streams} | {r['output_tok_per_s']} | {r['ttft_ms_p50']} | "
              f"{r['ttft_ms_p99']} | {r['itl_ms_p50']} | {r['errors']} |")
    print(f"\nMedians of {args.rounds} round(s):\n")
    print("| streams | dp=1 tok/s | dp=2 tok/s | dp=2 / dp=1 | TTFT p99 ms dp=1 → dp=2 |")
    print("|---|---|---|---|---|")
    for streams in sorted({r["label"].rpartition(" x")[2] for r in rows}, key=int):
        med = [_median(rows, layout["name"], streams) for layout in layouts]
        print(f"| {streams} | {med[0][0]:.1f} | {med[1][0]:.1f} | {med[1][0] / med[0][0]:.2f}x "
              f"| {med[0][1]:.0f} → {med[1][1]:.0f} |")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


def _median(rows: list[dict], name: str, streams: str) -> tuple[float, float]:
    """Median output tok/s and TTFT p99 of one layout's runs at one stream count."""
    mine = [r for r in rows if r["label"] == f"{name} x{streams}"]
    return (statistics.median(r["output_tok_per_s"] for r in mine),
            statistics.median(r["ttft_ms_p99"] for r in mine))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("both", "split", "dp"), default="both")
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--threads", type=int, default=2, help="forward-pass threads in all")
    p.add_argument("--output-tokens", type=int, default=64, help="split: tokens per request")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds, layouts alternated (dp: medians over them)")
    p.add_argument("--served-name", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--streams", default="8,32", help="dp: loadgen concurrencies")
    p.add_argument("--routing", default="prefix", help="dp: dp=2's --data-parallel-routing")
    p.add_argument("--requests-per-stream", type=int, default=None,
                   help="default: side_by_side.sh's 64 requests at 8 streams, 128 at 32")
    p.add_argument("--min-tokens", type=int, default=32, help="loadgen's default")
    p.add_argument("--max-tokens", type=int, default=256, help="loadgen's default")
    p.add_argument("--max-words", type=int, default=400, help="loadgen's default")
    p.add_argument("--loadgen", type=Path, default=LOADGEN)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if args.part in ("both", "split"):
        print("| split: in-process vs engine-core process | round 1 / round 2 ... |")
        print("|---|---|")
        asyncio.run(split_part(args))
    if args.part in ("both", "dp"):
        dp_part(args)


if __name__ == "__main__":
    main()
