r"""Where a LoRA decode step's extra time goes: the model runner alone (no HTTP, no actors).

Two runners in one process, the base model and the same model with ``--enable-lora``, each
decoding ``--batch`` sequences (spread over ``--adapters`` random rank-8 adapters on the LoRA
runner), alternating round after round so a shared machine's load falls on both alike. Prints
each one's median step, their ratio (what ``bench_lora.py`` measures through the engine), and
the LoRA step split into the wrapped linears' base products, the deltas (C++ kernel and its
Python call), the per-step slot mapping (``LoRAManager.set_step``) and the rest.

    .venv/bin/python loadtest/profile_lora.py --batch 8 --adapters 4 --threads 2
    .venv/bin/python loadtest/profile_lora.py --dtype float32 --threads 1
"""

from __future__ import annotations

# ruff: noqa: E402  (the OpenMP spin bound must be set before torch is imported)
import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pagedserve.gpu.cpu.threads import openmp_defaults

os.environ.update(openmp_defaults())  # as the server runs (server/cli.py)

import torch

from pagedserve.gpu.batch import ScheduledRequest, SchedulerOutput
from pagedserve.gpu.config import CacheConfig, ModelConfig
from pagedserve.gpu.lora import layers as lora_layers
from pagedserve.gpu.lora import manager as lora_manager
from pagedserve.gpu.lora.config import LoRAConfig
from pagedserve.gpu.lora.request import LoRARequest
from pagedserve.gpu.model_runner import ModelRunner
from pagedserve.gpu.sample.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from bench_lora import make_adapters  # noqa: E402


def _runner(dtype: str, adapters: int) -> ModelRunner:
    lora = LoRAConfig(enable_lora=True, max_loras=adapters, max_lora_rank=8) if adapters else None
    runner = ModelRunner(ModelConfig(dtype=dtype, max_model_len=1024, lora=lora),
                         CacheConfig(num_gpu_blocks_override=1024))
    runner.load()
    return runner


def _decoder(runner: ModelRunner, loras: list[LoRARequest | None], context: int):
    """A step function decoding one token for each of ``len(loras)`` sequences (prefilled
    first with ``context`` tokens)."""
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    per_seq = -(-(context + 1024) // runner.block_size)
    seqs = [{"id": f"r{i}", "blocks": list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)),
             "tokens": [(7 * i + j) % 1000 + 100 for j in range(context)], "lora": lora}
            for i, lora in enumerate(loras)]

    def step(prefill: bool = False) -> None:
        scheduled = [ScheduledRequest(
            s["id"], s["tokens"] if prefill else s["tokens"][-1:],
            0 if prefill else len(s["tokens"]) - 1, s["blocks"], params, True,
            lora_request=s["lora"]) for s in seqs]
        out = runner.execute_model(SchedulerOutput(scheduled))
        for s in seqs:
            s["tokens"].append(out.sampled_token_ids[s["id"]][0])

    step(prefill=True)
    return step


def _split(step, steps: int) -> dict[str, float]:
    """ms per step of the LoRA layers' base products, their deltas, ``set_step``, the rest."""
    totals = {"base linears (wrapped)": 0.0, "lora delta (kernel + call)": 0.0,
              "set_step (slot mapping)": 0.0}
    forward, set_step = lora_layers.LoRALinear.forward, lora_manager.LoRAManager.set_step

    def timed_forward(self, x):
        start = time.perf_counter()
        y = self.base(x)
        mid = time.perf_counter()
        y = self.add_delta(y, x)
        totals["base linears (wrapped)"] += mid - start
        totals["lora delta (kernel + call)"] += time.perf_counter() - mid
        return y

    def timed_set_step(self, reqs):
        start = time.perf_counter()
        set_step(self, reqs)
        totals["set_step (slot mapping)"] += time.perf_counter() - start

    lora_layers.LoRALinear.forward = timed_forward
    lora_manager.LoRAManager.set_step = timed_set_step
    try:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        total = time.perf_counter() - start
    finally:
        lora_layers.LoRALinear.forward, lora_manager.LoRAManager.set_step = forward, set_step
    totals["rest of the step"] = total - sum(totals.values())
    return {k: v / steps * 1e3 for k, v in totals.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--dtype", default="auto", help="auto: the server's choice on this CPU")
    p.add_argument("--context", type=int, default=100)
    p.add_argument("--steps", type=int, default=10, help="decode steps per round and runner")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=0,
                   help="torch/OpenMP threads (0: the server's adaptive default)")
    args = p.parse_args()
    if args.threads:  # read by ModelRunner.load
        os.environ["PAGEDSERVE_CPU_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(args.adapters, Path(tmp))
        loras = [LoRARequest(f"adapter{i}", i + 1, str(path)) for i, path in enumerate(paths)]
        base, lora = _runner(args.dtype, 0), _runner(args.dtype, args.adapters)
        steps = {"base": _decoder(base, [None] * args.batch, args.context),
                 "lora": _decoder(lora, [loras[i % len(loras)] for i in range(args.batch)],
                                  args.context)}
        times: dict[str, list[float]] = {"base": [], "lora": []}
        for r in range(args.rounds):
            for name in ("base", "lora") if r % 2 == 0 else ("lora", "base"):
                start = time.perf_counter()
                for _ in range(args.steps):
                    steps[name]()
                times[name].append((time.perf_counter() - start) / args.steps * 1e3)
        split = _split(steps["lora"], args.steps * 2)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"dtype={lora.dtype} threads={torch.get_num_threads()} batch={args.batch} "
          f"adapters={args.adapters} kernel={lora.lora.holder.kernel} "
          f"load1={os.getloadavg()[0]:.2f}")
    print(f"  decode step median: base {med['base']:.2f} ms, lora {med['lora']:.2f} ms, "
          f"base/lora {med['base'] / med['lora']:.3f} ({args.rounds} rounds x {args.steps})")
    print("  lora step split (ms/step, one run after the rounds):")
    for label, ms in split.items():
        print(f"    {label:30s} {ms:7.2f}")


if __name__ == "__main__":
    main()
