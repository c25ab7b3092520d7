"""Multi-LoRA throughput: 8 streams spread over 4 adapters against the base model at 8
streams, the two engines alternating round after round in one run.

Issue 31's bar: the LoRA run's output tok/s >= 0.8x the base model's. The base model is the
embedded SmolLM2-135M-Instruct (its GGUF, kept quantized on the CPU as ``serve`` runs it); the
adapters are random rank-8 PEFT adapters on all seven projections (``--max-loras 4``). The
machine may be shared: the medians over ``--rounds`` are what to read, and say so.

Each engine runs in a process of its own, as ``pagedserve serve`` runs one, with the server's
OpenMP settings. Two engines in one process (``--one-process``, how this benchmark first ran)
give libgomp more threads than cores, so it stops spinning between parallel regions and every
region pays a thread wake-up: the base model's step took ~25 ms there against ~17 ms alone
(``profile_lora.py``'s runner at 8 rows, 2 threads), and both figures stopped being the
server's.

Usage: ``.venv/bin/python loadtest/bench_lora.py [--rounds 3] [--output-tokens 64]
[--streams 8] [--adapters 4] [--one-process]``; one JSON line per measurement, then the
medians and ratio.
"""

from __future__ import annotations

# ruff: noqa: E402  (the OpenMP settings must be in the environment before torch loads)
import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

from pagedserve.gpu.cpu.threads import openmp_defaults

os.environ.update(openmp_defaults())  # as server/cli.py; inherited by the engine processes

from pagedserve.actors.core.config import SchedulerConfig
from pagedserve.actors.engine.async_engine import AsyncEngine
from pagedserve.actors.engine.config import EngineConfig
from pagedserve.gpu import loader
from pagedserve.gpu.config import CacheConfig, ModelConfig
from pagedserve.gpu.lora.config import LoRAConfig
from pagedserve.gpu.lora.request import LoRARequest
from pagedserve.gpu.sample.sampling_params import SamplingParams

PROMPT = "Tell me a long story about a lighthouse keeper and the sea, number "


def make_adapters(n: int, out: Path) -> list[Path]:
    """``n`` random rank-8 adapters of SmolLM2 (PEFT, nonzero B), saved under ``out``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folder = loader.convert_gguf(loader.embedded_gguf_path())
    paths = []
    for i in range(n):
        torch.manual_seed(i)
        model = get_peft_model(
            AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
            LoraConfig(r=8, lora_alpha=16, target_modules=[
                "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(0.0, 0.02)
        model.save_pretrained(out / f"adapter{i}")
        paths.append(out / f"adapter{i}")
    return paths


async def start(max_loras: int | None) -> AsyncEngine:
    lora = None if max_loras is None else LoRAConfig(enable_lora=True, max_loras=max_loras,
                                                     max_lora_rank=8)
    return await AsyncEngine.start(EngineConfig(
        model=ModelConfig(max_model_len=1024, lora=lora),
        cache=CacheConfig(num_gpu_blocks_override=1024),
        scheduler=SchedulerConfig(max_loras=max_loras or 0)))


async def run_round(engine: AsyncEngine, loras: list[LoRARequest | None], tokens: int,
                    tag: str) -> float:
    """Output tok/s of ``len(loras)`` concurrent greedy streams (one per entry)."""
    tok = engine.tokenizer

    async def one(i: int, lora: LoRARequest | None) -> int:
        ids = tok.encode(f"{PROMPT}{i} ({tag})")
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        n = 0
        extra = {} if lora is None else {"lora_request": lora}
        async for d in engine.generate(f"{tag}-{i}-{time.monotonic_ns()}", ids, params,
                                       **extra):
            n += len(d.token_ids)
        return n

    start = time.perf_counter()
    done = await asyncio.gather(*(one(i, lora) for i, lora in enumerate(loras)))
    return sum(done) / (time.perf_counter() - start)


class InProcess:
    """An engine in this process; ``round(tokens, tag)`` runs one round on it."""

    def __init__(self, max_loras: int | None, loras: list[LoRARequest | None]):
        self.max_loras, self.loras, self.engine = max_loras, loras, None

    async def open(self) -> None:
        self.engine = await start(self.max_loras)
        await run_round(self.engine, self.loras, 4, "warmup")  # kernels, adapter loads

    async def round(self, tokens: int, tag: str) -> float:
        return await run_round(self.engine, self.loras, tokens, tag)

    async def close(self) -> None:
        await self.engine.shutdown()


def _engine_process(conn, max_loras: int | None, loras: list[LoRARequest | None]) -> None:
    """A child's loop: start and warm the engine, then run each ``(tokens, tag)`` received
    and send back its tok/s, until ``None``."""

    async def serve() -> None:
        engine = InProcess(max_loras, loras)
        await engine.open()
        conn.send("ready")
        try:
            while (job := await asyncio.to_thread(conn.recv)) is not None:
                conn.send(await engine.round(*job))
        finally:
            await engine.close()

    asyncio.run(serve())


class OwnProcess:
    """An engine in a spawned process of its own (``_engine_process``), as ``serve`` runs."""

    def __init__(self, max_loras: int | None, loras: list[LoRARequest | None]):
        self.conn, child = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(target=_engine_process,
                                                    args=(child, max_loras, loras))
        self.proc.start()

    async def open(self) -> None:
        if await asyncio.to_thread(self._recv) != "ready":
            raise RuntimeError("the engine process did not start")

    async def round(self, tokens: int, tag: str) -> float:
        self.conn.send((tokens, tag))
        return await asyncio.to_thread(self._recv)

    async def close(self) -> None:
        if self.proc.is_alive():
            self.conn.send(None)
        self.proc.join(timeout=60)
        if self.proc.is_alive():
            self.proc.kill()

    def _recv(self):
        while not self.conn.poll(1.0):
            if not self.proc.is_alive():
                raise RuntimeError(f"the engine process exited ({self.proc.exitcode})")
        return self.conn.recv()


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(args.adapters, Path(tmp))
        adapters = [LoRARequest(f"adapter{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        streams = {"base": [None] * args.streams,
                   "lora": [adapters[i % len(adapters)] for i in range(args.streams)]}
        kind = InProcess if args.one_process else OwnProcess
        engines = {"base": kind(None, streams["base"]),
                   "lora": kind(args.adapters, streams["lora"])}
        try:
            for engine in engines.values():
                await engine.open()
            results: dict[str, list[float]] = {"base": [], "lora": []}
            for r in range(args.rounds):
                for name in ("base", "lora") if r % 2 == 0 else ("lora", "base"):
                    tps = await engines[name].round(args.output_tokens, f"r{r}")
                    results[name].append(tps)
                    print(json.dumps({"round": r, "mode": name, "streams": args.streams,
                                      "output_tok_s": round(tps, 1)}), flush=True)
        finally:
            for engine in engines.values():
                await engine.close()
    med = {k: statistics.median(v) for k, v in results.items()}
    print(json.dumps({"median_output_tok_s": {k: round(v, 1) for k, v in med.items()},
                      "lora_over_base": round(med["lora"] / med["base"], 3),
                      "adapters": args.adapters, "streams": args.streams,
                      "engines": "one process" if args.one_process else "a process each",
                      "note": "one shared machine: noisy"}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--one-process", action="store_true",
                        help="both engines in this process (libgomp then barely spins)")
    asyncio.run(main(parser.parse_args()))
