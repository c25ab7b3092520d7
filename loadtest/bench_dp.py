"""Data parallelism against one engine on the same CPU threads (issue 14), in one run.

For each stream count (default 8 and 32) and each layout, a fresh ``pagedserve serve`` (the
embedded SmolLM2-135M unless ``--model``) and one loadgen run (``../shared/bench/loadgen.py``:
seeded plain-English prompts, greedy, EOS ignored, every server the same workload):

- ``dp=1``: one engine with ``--threads`` (default 2) forward-pass threads;
- ``dp=2``: two in-process engines behind the router (``--data-parallel-routing``, default
  ``prefix``), ``--threads / 2`` threads each.

Both run with ``PAGEDSERVE_CPU_THREADS=--threads`` (fixed: no thread governor, so the two
layouts get the same cores). Prints a markdown table (output tok/s, TTFT p50/p99, ITL p50,
errors) and, with ``--json``, writes the loadgen summaries.

Usage: ``.venv/bin/python loadtest/bench_dp.py [--streams 8,32] [--threads 2]
[--requests-per-stream 3] [--max-tokens 64] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from pagedserve.server.launch import start_server_process

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
             args.served_name, "--num-requests", str(streams * args.requests_per_stream),
             "--concurrency", str(streams), "--seed", "0", "--min-words", "20",
             "--max-words", str(args.max_words), "--min-tokens", str(args.max_tokens // 2),
             "--max-tokens", str(args.max_tokens), "--label", f"{layout['name']} x{streams}"],
            capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--served-name", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--streams", default="8,32")
    p.add_argument("--threads", type=int, default=2, help="forward-pass threads in all")
    p.add_argument("--routing", default="prefix")
    p.add_argument("--requests-per-stream", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-words", type=int, default=200)
    p.add_argument("--loadgen", type=Path, default=LOADGEN)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    layouts = [
        {"name": f"dp=1, {args.threads} threads", "flags": []},
        {"name": f"dp=2, {max(1, args.threads // 2)} thread(s) each ({args.routing})",
         "flags": ["--data-parallel-size", "2", "--data-parallel-routing", args.routing]},
    ]
    rows = []
    for streams in (int(s) for s in args.streams.split(",")):
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
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
