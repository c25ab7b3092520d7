"""Serving benchmark for any OpenAI-compatible server, and a plain-transformers baseline.

The equivalent of ``vllm bench serve``: a seeded workload is sent as streamed chat requests
(``/v1/chat/completions``, ``stream: true``) at each ``--max-concurrency`` level (closed loop),
optionally paced by ``--request-rate`` (Poisson arrivals). It reports completed/failed requests,
request and output-token throughput, TTFT, TPOT, ITL and end-to-end latency (mean, median,
p99), writes them as JSON, and with a sweep (``--max-concurrency 1,8,32``) a PNG of throughput
and latency against concurrency.

``--noisy-neighbour`` runs each level quiet and then beside one busy-loop process pinned to
``--noisy-cpu`` (``loadtest/noisy_neighbour.py``), ``--rounds`` times alternating, and reports
the share of the quiet throughput kept (medians over the rounds), for whichever server
``--base-url`` names: pagedserve, llama.cpp or any other, in the same run.

``--backend hf`` runs the same workload through transformers' ``generate`` in static batches
(batch = concurrency), the baseline every figure is compared with. ``--backend both`` measures
the server and then the baseline in one run.

Datasets (``--dataset``):
  loadgen        the llama.cpp comparison workload: prompts of 20-400 words of plain English
                 (half short, half long) under one of six tasks, 32-256 output tokens, greedy
                 (or ``--temperature``), EOS ignored; the same requests as
                 ../shared/bench/loadgen.py for a seed (which itself is greedy only).
  random         random words, ``--input-len`` and ``--output-len`` ranges (``lo:hi``, words
                 and tokens).
  shared-prefix  ``random`` behind one long common system prompt (``--prefix-words``).
  sharegpt       a ShareGPT-style JSON file (``--dataset-path``): the first human turn of each
                 conversation; output length from ``--output-len``.

Example (pagedserve on :8000, baseline in the same run):
    .venv/bin/python loadtest/bench_serving.py --backend both --base-url http://127.0.0.1:8000/v1 \
        --dataset loadgen --max-concurrency 1,8,32 --num-prompts 4,16,64 --ignore-eos \
        --result-json artifacts/bench.json --plot artifacts/bench.png

Under a noisy neighbour (a server launched for the run, 1 and 8 streams, 3 rounds):
    .venv/bin/python loadtest/bench_serving.py --launch --noisy-neighbour --rounds 3 \
        --dataset loadgen --max-concurrency 1,8 --num-prompts 8,16 --ignore-eos
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import shlex
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx
from bench_samples import Sample, acceptance_length, summarize
from noisy_neighbour import busy_neighbour, default_cpu, kept
from workloads import BenchRequest, build_workload

from pagedserve.server.launch import start_server_process

# -- one measured request ---------------------------------------------------------------------


async def _one(client: httpx.AsyncClient, args, req: BenchRequest) -> Sample:
    body = {"model": args.model, "messages": req.messages, "max_tokens": req.max_tokens,
            "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    if args.ignore_eos:
        body["ignore_eos"] = True
    s = Sample()
    start = last = time.perf_counter()
    deltas = usage = ids = 0
    try:
        async with client.stream("POST", "/chat/completions", json=body) as r:
            if r.status_code != 200:
                s.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return s
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    s.error = f"stream error: {str(chunk['error'])[:200]}"
                    return s
                if chunk.get("usage"):
                    usage = chunk["usage"].get("completion_tokens") or 0
                for c in chunk.get("choices") or []:
                    ids += len(c.get("token_ids") or [])
                    if not (c.get("delta") or {}).get("content"):
                        continue
                    now = time.perf_counter()
                    if s.ttft is None:
                        s.ttft = now - start
                    else:
                        s.itls.append(now - last)
                    last = now
                    deltas += 1
        s.e2e = time.perf_counter() - start
        s.output_tokens = usage or ids or deltas
        s.ok = s.ttft is not None
        if not s.ok:
            s.error = "no content received"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        s.error = f"{type(e).__name__}: {e}"[:200]
    return s


async def run_server_level(args, reqs: list[BenchRequest], concurrency: int) -> dict:
    limits = httpx.Limits(max_connections=concurrency + 2)
    timeout = httpx.Timeout(args.timeout, connect=30)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed)
    async with httpx.AsyncClient(base_url=args.base_url.rstrip("/"), limits=limits,
                                 timeout=timeout, headers=headers, trust_env=False) as client:
        for _ in range(args.warmup):  # not measured
            await _one(client, args, BenchRequest([{"role": "user", "content": "Hello!"}], 8))
        spec = await _spec_decode(client)
        sem = asyncio.Semaphore(concurrency)

        async def limited(req: BenchRequest) -> Sample:
            async with sem:
                return await _one(client, args, req)

        tasks = []
        t0 = time.perf_counter()
        for req in reqs:
            tasks.append(asyncio.create_task(limited(req)))
            if args.request_rate != math.inf:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        samples = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        spec = acceptance_length(spec, await _spec_decode(client))
    return summarize(samples, wall, backend="server", max_concurrency=concurrency,
                     num_prompts=len(reqs), request_rate=args.request_rate,
                     temperature=args.temperature, acceptance_length=spec)


async def _spec_decode(client: httpx.AsyncClient) -> dict | None:
    """pagedserve's speculative-decoding totals (``/admin/stats``); ``None`` elsewhere."""
    try:
        r = await client.get(str(client.base_url).rstrip("/").removesuffix("/v1") + "/admin/stats")
        return r.json()["scheduler"]["spec_decode"] if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError):
        return None


# -- the transformers baseline ----------------------------------------------------------------


class _StepClock:
    """A stopping criterion that never stops: it timestamps every generated token of the batch."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def run_hf_level(args, reqs: list[BenchRequest], batch: int, model, tok) -> dict:
    """Static batches of ``batch`` requests, left-padded, each batch generating until its longest
    request is done; a request's tokens come at the batch's steps, its end at its own last token."""
    import torch
    from transformers import StoppingCriteriaList

    samples: list[Sample] = []
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch):
        group = reqs[i : i + batch]
        texts = [tok.apply_chat_template(r.messages, tokenize=False, add_generation_prompt=True)
                 for r in group]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        longest = max(r.max_tokens for r in group)
        clock = _StepClock()
        start = time.perf_counter()
        kw = {"min_new_tokens": longest} if args.ignore_eos else {}
        with torch.inference_mode():
            sampling = ({"do_sample": True, "temperature": args.temperature}
                        if args.temperature > 0 else {"do_sample": False})
            model.generate(**enc, max_new_tokens=longest, **sampling,
                           stopping_criteria=StoppingCriteriaList([clock]),
                           pad_token_id=tok.pad_token_id, **kw)
        for r in group:
            n = min(r.max_tokens, len(clock.times))
            steps = clock.times[:n]
            gaps = [b - a for a, b in zip(steps, steps[1:], strict=False)]
            samples.append(Sample(ok=True, ttft=steps[0] - start, e2e=steps[-1] - start,
                                  output_tokens=n, itls=gaps))
    wall = time.perf_counter() - t0
    return summarize(samples, wall, backend="hf", max_concurrency=batch, num_prompts=len(reqs),
                     dtype=args.hf_dtype)


def load_hf(args):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = args.hf_model
    if path is None:  # the embedded default, converted once by pagedserve's loader
        from pagedserve.gpu import loader

        path = str(loader.resolve_model(None).path)
    # As the server's forward pass: all cores but one unless told (see gpu/model_runner.py).
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(args.threads or max(1, (cores or 1) - 1))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.hf_dtype]
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return model, tok


# -- a server of our own ----------------------------------------------------------------------


@contextmanager
def launched_server(args):
    """``--launch``: run ``pagedserve serve`` (next to this Python) on a free port for the run."""
    log = open(args.server_log, "w") if args.server_log else subprocess.DEVNULL
    try:
        proc, url = start_server_process(shlex.split(args.server_args), timeout=300,
                                         stdout=log, stderr=subprocess.STDOUT)
    except RuntimeError as e:
        sys.exit(f"bench_serving: {e} (see --server-log)")
    try:
        yield f"{url}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


# -- report -----------------------------------------------------------------------------------


def _row(r: dict) -> str:
    label = r.get("dtype") or r.get("neighbour", "")
    return (f"{r['backend']:>6} {label:>8} c={r['max_concurrency']:<3} "
            f"n={r['completed']}/{r['num_prompts']} out={r['output_throughput']:7.1f} tok/s "
            f"TTFT p50/p99 {r['ttft_ms']['median']}/{r['ttft_ms']['p99']} ms "
            f"ITL p50/p99 {r['itl_ms']['median']}/{r['itl_ms']['p99']} ms "
            f"TPOT p50 {r['tpot_ms']['median']} ms E2E p50 {r['e2e_ms']['median']} ms"
            + (f" accept-len {r['acceptance_length']}" if r.get("acceptance_length") else ""))


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for backend in sorted({r["backend"] for r in results}):
        rs = sorted((r for r in results if r["backend"] == backend),
                    key=lambda r: r["max_concurrency"])
        xs = [r["max_concurrency"] for r in rs]
        ax1.plot(xs, [r["output_throughput"] for r in rs], "o-", label=backend)
        ax2.plot(xs, [r["ttft_ms"]["p99"] for r in rs], "o-", label=f"{backend} TTFT p99")
        ax2.plot(xs, [r["itl_ms"]["p99"] for r in rs], "s--", label=f"{backend} ITL p99")
    ax1.set(xscale="log", xlabel="max concurrency", ylabel="output tokens/s",
            title="throughput")
    ax2.set(xscale="log", yscale="log", xlabel="max concurrency", ylabel="ms", title="latency")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["openai", "hf", "both"], default="openai")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--launch", action="store_true",
                   help="start `pagedserve serve` on a free port for the run (ignores --base-url)")
    p.add_argument("--server-args", default="", help="extra flags for the launched server")
    p.add_argument("--server-log", default=None, help="file for the launched server's log")
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--api-key", default="")
    p.add_argument("--dataset", default="loadgen",
                   choices=["loadgen", "random", "shared-prefix", "sharegpt"])
    p.add_argument("--dataset-path", default=None, help="ShareGPT JSON file")
    p.add_argument("--input-len", default="20:400", help="words, lo:hi (random datasets)")
    p.add_argument("--output-len", default="32:256", help="tokens, lo:hi")
    p.add_argument("--prefix-words", type=int, default=1000, help="shared-prefix length, words")
    p.add_argument("--num-prompts", default="32",
                   help="requests per level; one value or one per --max-concurrency level")
    p.add_argument("--max-concurrency", default="8", help="one level or a sweep: 1,8,32")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s, Poisson arrivals (default: all at once)")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every request (0 = greedy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests per level")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--hf-model", default=None, help="baseline model dir (default: embedded)")
    p.add_argument("--hf-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads for the baseline (default: cores - 1, as the server)")
    p.add_argument("--noisy-neighbour", action="store_true",
                   help="run each level quiet, then beside a busy loop pinned to --noisy-cpu, "
                        "and report the throughput kept")
    p.add_argument("--noisy-cpu", type=int, default=None,
                   help="CPU the busy loop is pinned to (default: the last one we may use)")
    p.add_argument("--rounds", type=int, default=1,
                   help="--noisy-neighbour: quiet/busy pairs per level (medians reported)")
    p.add_argument("--result-json", default=None)
    p.add_argument("--plot", default=None, help="PNG of the sweep")
    return p.parse_args(argv)


@contextmanager
def _given(url: str):
    yield url


def _reset_prefix_cache(base_url: str, api_key: str) -> None:
    """Each level starts with a cold prefix cache: level n's prompts include level n-1's, and
    a server that kept them would skip part of the prefill the baseline has to do. vLLM and
    pagedserve take ``POST /reset_prefix_cache``; others (404) are left as they are."""
    root = base_url.removesuffix("/").removesuffix("/v1")
    try:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        httpx.post(f"{root}/reset_prefix_cache", headers=headers, timeout=30)
    except httpx.HTTPError:
        pass


def run_server_levels(args, url: str, levels: list[int], counts: list[int]) -> list[dict]:
    """Every level against ``url``; with ``--noisy-neighbour`` each one ``--rounds`` times
    quiet then busy, alternating (a shared machine drifts: neighbours in time compare best)."""
    sides = ("quiet", "busy") if args.noisy_neighbour else (None,)
    rounds = args.rounds if args.noisy_neighbour else 1
    cpu = default_cpu() if args.noisy_cpu is None else args.noisy_cpu
    results = []
    for c, n in zip(levels, counts, strict=True):
        for _, side in itertools.product(range(rounds), sides):
            _reset_prefix_cache(url, args.api_key)
            with busy_neighbour(cpu) if side == "busy" else _given(url):
                r = asyncio.run(run_server_level(args, build_workload(args, n), c))
            if side is not None:
                r.update(neighbour=side, noisy_cpu=cpu)
            print(_row(r), flush=True)
            results.append(r)
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    levels = [int(c) for c in args.max_concurrency.split(",")]
    counts = [int(n) for n in args.num_prompts.split(",")]
    if len(counts) == 1:
        counts *= len(levels)
    if len(counts) != len(levels):
        sys.exit("bench_serving: give one --num-prompts or one per --max-concurrency level")
    results = []
    if args.backend in ("openai", "both"):
        with launched_server(args) if args.launch else _given(args.base_url) as url:
            args.base_url = url
            results += run_server_levels(args, url, levels, counts)
    if args.backend in ("hf", "both"):
        model, tok = load_hf(args)
        run_hf_level(args, build_workload(args, 1)[:1], 1, model, tok)  # warm-up
        for c, n in zip(levels, counts, strict=True):
            r = run_hf_level(args, build_workload(args, n), c, model, tok)
            print(_row(r), flush=True)
            results.append(r)
    report = {"dataset": args.dataset, "seed": args.seed, "ignore_eos": args.ignore_eos,
              "temperature": args.temperature,
              "base_url": args.base_url, "results": results}
    if args.noisy_neighbour:
        report["noisy_neighbour"] = kept([r for r in results if r["backend"] == "server"])
        for row in report["noisy_neighbour"]:
            print(f"noisy neighbour c={row['max_concurrency']}: quiet {row['quiet_tok_s']} "
                  f"busy {row['busy_tok_s']} tok/s, kept {row['kept']} "
                  f"(medians of {row['rounds']})", flush=True)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        plot(results, args.plot)
    return 0 if all(r["failed"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
