"""The cost of running the engine in its own process (issue 14): the same engine in the API
process (``AsyncEngine``) and as one engine-core process behind ZeroMQ (``EngineCoreClient``,
``--data-parallel-size`` > 1 uses it for every rank), with the same threads.

1. Output tokens/s with 1 and 8 concurrent greedy requests (EOS ignored, ``--output-tokens``
   each), read as the HTTP layer reads them (``engine.generate``'s deltas).
2. Microseconds per message: encoding + decoding one ``OutputsMsg`` (1 and 8 streams' deltas
   of one token each), and a round trip front → core → front (a ``wait_idle`` call on an idle
   engine).

Usage: ``.venv/bin/python loadtest/bench_dp.py [--model PATH] [--output-tokens 64]
[--threads 2] [--rounds 2]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time


async def tokens_per_s(engine, streams: int, output_tokens: int, tag: str) -> float:
    from pagedserve.gpu.sampling_params import SamplingParams

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
    from pagedserve.actors import engine_core_messages as m
    from pagedserve.actors.request_stream import GenerationDelta

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


async def main(args: argparse.Namespace) -> None:
    os.environ["PAGEDSERVE_CPU_THREADS"] = str(args.threads)  # the same, fixed, for both
    from pagedserve.actors.dp_config import DataParallelConfig
    from pagedserve.actors.dp_launch import start_engine_processes
    from pagedserve.actors.engine import AsyncEngine, EngineConfig
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
        print(f"| {name} | {' / '.join(f'{v:.1f}' for v in values)} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    asyncio.run(main(parser.parse_args()))
