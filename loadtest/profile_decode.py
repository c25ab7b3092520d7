r"""Where a decode step's time goes: the model runner alone (no HTTP, no actors).

Prefills ``--batch`` sequences of ``--context`` tokens, then times ``--steps`` decode steps of
the whole batch and prints the median step time, the tokens/s that implies, and optionally
torch.profiler's table of the most expensive operators (``--profile``) or the step split into
linear layers, our C++ kernels (which torch.profiler cannot see), KV writes, sampling and the
rest (``--breakdown``). ``--quantization gguf,none`` compares keeping the GGUF file's blocks
with de-quantized weights; ``--prefill`` also times a step prefilling the batch's prompts.

    .venv/bin/python loadtest/profile_decode.py --batch 1,8,32 --dtype float32,bfloat16
    .venv/bin/python loadtest/profile_decode.py --batch 1,8 --dtype bfloat16 \
        --quantization gguf,none --breakdown
    .venv/bin/python loadtest/profile_decode.py --batch 8 --context 256 --dtype bfloat16 \
        --quantization gguf --prefill --breakdown
    .venv/bin/python loadtest/profile_decode.py --model /tmp/shape-1.7b/Q4_K_M.gguf \
        --batch 1,32 --dtype bfloat16 --quantization gguf --breakdown
"""

from __future__ import annotations

# ruff: noqa: E402  (cap_torch_env() must run before torch is imported)
import argparse
import contextlib
import itertools
import os
import statistics
import time

from pagedserve.gpu.cpu.threads import openmp_defaults
from pagedserve.kernels.cpu_isa import cap_torch_env

# PAGEDSERVE_CPU_ISA=avx2 caps torch (ATen, oneDNN, MKL) as well as our kernels, so an AVX-512
# machine measures the AVX2 tier; torch reads those caps only if they are set before its import.
# The server's OpenMP spin bound too (server/cli.py), so a step is timed as the server runs it.
os.environ.update(openmp_defaults())
cap_torch_env()

import torch

from pagedserve.gpu import gguf_linear
from pagedserve.gpu import model_runner as model_runner_module
from pagedserve.gpu.attention import CpuAttentionBackend, TorchAttentionBackend
from pagedserve.gpu.batch import ScheduledRequest, SchedulerOutput
from pagedserve.gpu.config import CacheConfig, ModelConfig
from pagedserve.gpu.cpu import gemm as cpu_gemm
from pagedserve.gpu.model_runner import ModelRunner
from pagedserve.gpu.sample.sampling_params import SamplingParams
from pagedserve.kernels import cpu_ops


def _requests(batch: int, context: int, block_size: int) -> list[dict]:
    per_seq = -(-(context + 512) // block_size)
    return [{"id": f"r{i}", "blocks": list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)),
             "tokens": [(7 * i + j) % 1000 + 100 for j in range(context)]} for i in range(batch)]


def _step(runner: ModelRunner, reqs: list[dict], prefill: bool) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    scheduled = []
    for r in reqs:
        toks = r["tokens"] if prefill else r["tokens"][-1:]
        start = 0 if prefill else len(r["tokens"]) - 1
        scheduled.append(ScheduledRequest(r["id"], toks, start, r["blocks"], params, True))
    out = runner.execute_model(SchedulerOutput(scheduled))
    for r in reqs:
        r["tokens"].append(out.sampled_token_ids[r["id"]][0])


# The clock of the breakdown (``--clock``): wall time, or this process's CPU time, which a
# loaded machine's preemption does not inflate (exact with ``--threads 1``: with more, it also
# counts the OpenMP threads' spinning).
_CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = time.perf_counter


@contextlib.contextmanager
def _timed_parts(totals: dict[str, float]):
    """Wrap the step's parts with timers (``_clock``), adding seconds into ``totals``."""
    patches = [(cpu_ops, name) for name in ("rms_norm", "silu_and_mul", "rotary_embedding")]
    patches += [(model_runner_module, "sample"), (cpu_gemm.PackedLinear, "forward"),
                (torch.nn.Linear, "forward"), (gguf_linear.GGUFLinear, "forward")]
    saved = [(obj, name, obj.__dict__[name]) for obj, name in patches]
    # The backends' kernels are static attributes bound at class creation: patch them there.
    kernels = [(backend, name, backend.__dict__[name])
               for backend in (TorchAttentionBackend, CpuAttentionBackend)
               for name in ("decode", "reshape_and_cache", "prefill") if name in backend.__dict__]
    active: set[str] = set()

    def timed(label, fn):
        def wrapper(*args, **kwargs):
            if label in active:  # a GGUFLinear calling its dense layer: counted once
                return fn(*args, **kwargs)
            active.add(label)
            start = _clock()
            try:
                return fn(*args, **kwargs)
            finally:
                active.discard(label)
                totals[label] = totals.get(label, 0.0) + _clock() - start
        return wrapper

    try:
        for obj, name, fn in saved:
            label = "linear" if name == "forward" else name
            setattr(obj, name, timed(label, fn))
        for backend, name, fn in kernels:
            label = {"decode": "decode_attention", "prefill": "prefill_attention"}.get(name, name)
            setattr(backend, name, staticmethod(timed(label, fn.__func__)))
        yield
    finally:
        for obj, name, fn in [*saved, *kernels]:
            setattr(obj, name, fn)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="a model folder or .gguf file (default: the embedded SmolLM2-135M)")
    p.add_argument("--batch", default="1,8,32")
    p.add_argument("--dtype", default="float32,bfloat16")
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--profile", action="store_true", help="print torch.profiler's table")
    p.add_argument("--breakdown", action="store_true",
                   help="split the step into linear layers, our kernels, KV writes, sampling")
    p.add_argument("--prefill", action="store_true",
                   help="also time a step prefilling --batch prompts of --context tokens")
    p.add_argument("--quantization", default="gguf,none",
                   help="comma list: gguf (the file's quantized blocks) and/or none")
    p.add_argument("--cpu-linear-mode", default="auto", choices=("auto", "exact", "int8"),
                   help="GGUF linears (auto with --dtype float32 is exact, as in the server)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads (0: the server's default, see cpu_threads)")
    p.add_argument("--clock", choices=tuple(_CLOCKS), default="wall",
                   help="the breakdown's and prefill's clock: wall, or process CPU time (for a "
                        "loaded machine; exact with --threads 1)")
    args = p.parse_args()
    global _clock
    _clock = _CLOCKS[args.clock]
    if args.threads:  # read by ModelRunner.load, which sets torch's thread count
        os.environ["PAGEDSERVE_CPU_THREADS"] = str(args.threads)
    for dtype, quant in itertools.product(args.dtype.split(","), args.quantization.split(",")):
        extra = {"model": args.model} if args.model else {}
        runner = ModelRunner(ModelConfig(dtype=dtype, max_model_len=2048, quantization=quant,
                                         cpu_linear_mode=args.cpu_linear_mode,
                                         **extra),
                             CacheConfig(num_gpu_blocks_override=2400))
        runner.load()
        for batch in [int(b) for b in args.batch.split(",")]:
            reqs = _requests(batch, args.context, runner.block_size)
            for i in range(0, batch, 4):
                _step(runner, reqs[i:i + 4], prefill=True)
            for _ in range(3):
                _step(runner, reqs, prefill=False)
            wall, cpu = [], []
            for _ in range(args.steps):
                t, c = time.perf_counter(), time.process_time()
                _step(runner, reqs, prefill=False)
                wall.append(time.perf_counter() - t)
                cpu.append(time.process_time() - c)
            # CPU time is the steadier figure on a shared machine (exact with --threads 1).
            w, c = statistics.median(wall), statistics.median(cpu)
            print(f"isa={cpu_ops.isa()} torch={torch.backends.cpu.get_cpu_capability()} "
                  f"dtype={dtype} quantization={quant} batch={batch} decode step median wall "
                  f"{w * 1e3:.1f} ms ({batch / w:.0f} tok/s), cpu {c * 1e3:.1f} ms "
                  f"({batch / c:.0f} tok/s)",
                  flush=True)
            if args.profile:
                with torch.profiler.profile() as prof:
                    for _ in range(5):
                        _step(runner, reqs, prefill=False)
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
            if args.breakdown:
                _print_breakdown(lambda: _step(runner, reqs, prefill=False), args.steps)
            if args.prefill:
                _time_prefill(runner, batch, args)


def _print_breakdown(step_fn, steps: int) -> None:
    totals: dict[str, float] = {}
    start = _clock()
    with _timed_parts(totals):
        for _ in range(steps):
            step_fn()
    step = (_clock() - start) / steps
    totals["other (python, embedding, views)"] = step * steps - sum(totals.values())
    for label, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        ms = seconds / steps * 1e3
        print(f"  {label:34s} {ms:7.2f} ms  {ms / (step * 1e3):5.1%}")


def _time_prefill(runner: ModelRunner, batch: int, args) -> None:
    """A step prefilling ``batch`` fresh prompts of ``--context`` tokens (KV blocks reused)."""
    runs = iter(range(1_000_000))

    def step() -> None:
        reqs = _requests(batch, args.context, runner.block_size)
        run = next(runs)
        for r in reqs:
            r["id"] = f"{r['id']}-p{run}"
        _step(runner, reqs, prefill=True)

    step()
    wall = []
    for _ in range(max(3, args.steps // 4)):
        t = _clock()
        step()
        wall.append(_clock() - t)
    w = statistics.median(wall)
    print(f"  prefill {batch} x {args.context} tokens: median {w * 1e3:.0f} ms {args.clock} "
          f"({batch * args.context / w:.0f} tok/s)", flush=True)
    if args.breakdown:
        _print_breakdown(step, max(3, args.steps // 4))

if __name__ == "__main__":
    main()
