"""Starting and stopping data-parallel engines: the API server's path and a ``--headless``
node's (vLLM's ``vllm/v1/engine/utils.py`` launch and ``serve --headless``, read to learn only).

- ``start_engine``: ``--data-parallel-size 1`` (and no ``--headless``) is the in-process
  ``AsyncEngine``, as before; more engines are engine-core processes
  (``actors/engine_core/proc.py``) behind an ``EngineCoreHub``, this node's spawned here, the
  others registering from ``--headless`` nodes; the front serves once every rank has
  registered, through ``DataParallelEngine`` (``actors/dp/engine.py``: routed by
  ``--data-parallel-routing``, fed by each core's forwarded KV events) over their
  ``EngineCoreClient``s.
- ``run_headless``: spawn this node's engines, pointed at the front's address, and wait until
  they have all exited (the front's shutdown stops them) or SIGTERM / Ctrl-C stops them.

Each local engine process gets its share of this process's cores as its thread count
(``gpu/cpu/threads.py``: 2 cores, 2 engines → 1 thread each) and its own KV pool (the cache
flags apply per engine, as vLLM's do). Every engine process dies with the process that
started it (``PR_SET_PDEATHSIG``) and is stopped by it: ``ShutdownMsg`` or SIGTERM, then
SIGKILL after ``STOP_TIMEOUT_S``.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import sys
from pathlib import Path
from typing import Any

import structlog

from pagedserve.actors.dp.config import DataParallelConfig
from pagedserve.actors.dp.engine import DataParallelEngine
from pagedserve.actors.engine.async_engine import AsyncEngine
from pagedserve.actors.engine.config import EngineConfig
from pagedserve.actors.engine.protocol import EngineClient
from pagedserve.actors.engine_core.client import EngineCoreClient
from pagedserve.actors.engine_core.hub import EngineCoreHub
from pagedserve.actors.engine_core.messages import CoreSpec
from pagedserve.actors.engine_core.proc import SPEC_ENV, spec_to_env
from pagedserve.gpu import loader
from pagedserve.gpu.cpu.threads import THREADS_ENV, cpu_threads

log = structlog.get_logger(__name__)

STOP_TIMEOUT_S = 15.0  # an engine's grace to finish its shutdown before SIGKILL
# `python -m` puts the current directory first on sys.path; started from a pagedserve checkout,
# its kernels/ folder would then shadow Hugging Face's `kernels` package that transformers
# imports. -P (Python 3.11+) leaves it out.
SAFE_PATH: tuple[str, ...] = ("-P",) if sys.version_info >= (3, 11) else ()


def threads_per_engine(num_local: int) -> int:
    """This process's cores (``PAGEDSERVE_CPU_THREADS`` or the affinity and quota) shared out
    among its local engines, one thread at least each."""
    return max(1, cpu_threads() // max(1, num_local))


class LocalEngine:
    """One engine-core process this node started."""

    def __init__(self, rank: int, proc: asyncio.subprocess.Process):
        self.rank = rank
        self.proc = proc
        self.exited = asyncio.ensure_future(proc.wait())

    @classmethod
    async def spawn(cls, spec: CoreSpec, threads: int) -> LocalEngine:
        env = dict(os.environ)
        env[SPEC_ENV] = spec_to_env(spec)
        env[THREADS_ENV] = str(threads)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *SAFE_PATH, "-m", "pagedserve.actors.engine_core.proc",
            f"--engine-index={spec.engine_index}", env=env)
        log.info("engine_process_started", engine=spec.engine_index, pid=proc.pid,
                 threads=threads)
        return cls(spec.engine_index, proc)

    def exit_reason(self) -> str:
        code = self.proc.returncode
        how = (f"signal {signal.Signals(-code).name}" if code is not None and code < 0
               else f"status {code}")
        return f"its process (pid {self.proc.pid}) exited with {how}"

    async def stop(self, sig: signal.Signals | None = None) -> None:
        """Until the process has exited: ``sig`` first if given (else it was told by message),
        SIGKILL after ``STOP_TIMEOUT_S``."""
        if self.proc.returncode is None and sig is not None:
            self.proc.send_signal(sig)
        try:
            await asyncio.wait_for(asyncio.shield(self.exited), STOP_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("engine_process_killed", engine=self.rank, pid=self.proc.pid)
            self.proc.kill()
            await self.exited


async def spawn_local(config: EngineConfig, dp: DataParallelConfig, address: str,
                      log_level: str) -> list[LocalEngine]:
    threads = threads_per_engine(dp.size_local)
    engines = []
    try:
        for rank in dp.local_ranks:
            engines.append(await LocalEngine.spawn(
                CoreSpec(config, rank, address, log_level), threads))
    except BaseException:
        await asyncio.gather(*(e.stop(signal.SIGKILL) for e in engines))
        raise
    return engines


async def start_engine(config: EngineConfig, dp: DataParallelConfig,
                       log_level: str = "info") -> EngineClient:
    """The engine the API server serves: an ``AsyncEngine`` in this process for one engine,
    else the router over every rank's ``EngineCoreClient``.

    Raises:
        ValueError: a layout that cannot be served (a pooling model's too), or an engine
            that failed to start.
    """
    dp.check()
    if not dp.in_processes:
        return await AsyncEngine.start(config)
    if config.model.runner == "pooling" or config.model.convert == "embed":
        raise ValueError("a pooling model (--runner pooling, --convert embed) is not served "
                         "with data parallelism yet: drop -dp")
    return await start_engine_processes(config, dp, log_level)


async def start_engine_processes(config: EngineConfig, dp: DataParallelConfig,
                                 log_level: str = "info") -> DataParallelEngine:
    """Every rank as an engine-core process (``dp=1`` too: ``loadtest/bench_dp.py`` measures
    the split's cost with it); the router over their clients once all have registered."""
    remote = dp.size_local < dp.data_parallel_size
    hub = EngineCoreHub(dp.data_parallel_address if remote else "127.0.0.1",
                        dp.data_parallel_rpc_port if remote else 0)
    local: list[LocalEngine] = []
    # A folder's tokenizer loads here while the engines load; a .gguf or a hub id is resolved
    # (converted, downloaded) by the engines first, then found in the cache.
    folder = config.model.model is not None and Path(config.model.model).is_dir()
    tokenizer = asyncio.ensure_future(asyncio.to_thread(_load_tokenizer, config)
                                      if folder else asyncio.sleep(0))
    try:
        local = await spawn_local(config, dp, hub.address, log_level)
        for local_engine in local:
            local_engine.exited.add_done_callback(functools.partial(_lost, hub, local_engine))
        registered = await hub.wait_for_engines(dp.data_parallel_size)
        if not folder:
            tokenizer = asyncio.ensure_future(asyncio.to_thread(_load_tokenizer, config))
        await tokenizer
    except BaseException:
        tokenizer.cancel()
        await asyncio.gather(*(e.stop(signal.SIGKILL) for e in local))
        hub.close()
        raise
    by_rank = {e.rank: e for e in local}
    clients = [EngineCoreClient(hub, registered[i], config, tokenizer.result(),
                                by_rank[i].stop if i in by_rank else None)
               for i in range(dp.data_parallel_size)]
    group = DataParallelEngine(clients, dp.data_parallel_routing)
    log.info("data_parallel_ready", size=dp.data_parallel_size, routing=dp.data_parallel_routing,
             local_ranks=list(dp.local_ranks))
    return group


def _lost(hub: EngineCoreHub, engine: LocalEngine, _: object) -> None:
    """A local engine's process exited: the hub fails what it held."""
    hub.lose(engine.rank, engine.exit_reason())


def _load_tokenizer(config: EngineConfig) -> Any:
    """The model's tokenizer, resolved on this node as the engines resolve the model."""
    return loader.load_tokenizer(loader.resolve_model(config.model.model).path)


async def run_headless(config: EngineConfig, dp: DataParallelConfig,
                       log_level: str = "info") -> int:
    """Run this node's engines until they have all exited or SIGTERM / SIGINT; returns the
    exit status (1 when an engine failed)."""
    dp.check()
    host = dp.data_parallel_address
    address = f"tcp://{f'[{host}]' if ':' in host else host}:{dp.data_parallel_rpc_port}"
    engines = await spawn_local(config, dp, address, log_level)
    log.info("headless_serving", ranks=list(dp.local_ranks), front=address,
             data_parallel_size=dp.data_parallel_size)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    all_exited = asyncio.gather(*(asyncio.shield(e.exited) for e in engines))
    waits: list[asyncio.Future[Any]] = [asyncio.ensure_future(stop.wait()), all_exited]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await asyncio.gather(*(e.stop(signal.SIGTERM) for e in engines))
        log.info("headless_stopped", exits=[e.proc.returncode for e in engines])
    return 0 if all(e.proc.returncode == 0 for e in engines) else 1
