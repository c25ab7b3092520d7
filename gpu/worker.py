"""One rank of a tensor/pipeline-parallel model: a spawned process that owns its shard of the
weights and of the KV cache and runs the ordinary ``ModelRunner`` on it (vLLM's
``vllm/v1/executor/multiproc_executor.py`` ``WorkerProc``; read to learn only).

The executor (``actors/multiproc_executor.py``) talks to each worker over one pipe:

- ``("load",)`` → every worker loads; each answers ``("ok", (ModelInfo, layout, pid))``;
- ``("step", SchedulerOutput)`` → every worker runs the step; only the rank that samples (the
  last stage's first rank) answers ``("ok", ModelRunnerOutput)``;
- ``("stop",)`` → the worker leaves its process group and exits 0.

A worker whose step raises answers ``("error", "Type: message")`` and exits 1 (its peers are
stuck in a collective by then; the executor ends them). A worker whose parent dies gets
SIGKILL from the kernel (``PR_SET_PDEATHSIG``), so none outlives the server.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection

from pagedserve.gpu.config import CacheConfig, ModelConfig


@dataclass(slots=True)
class WorkerSpec:
    """What a worker needs to start (pickled into the spawned process)."""

    rank: int
    tp_size: int
    pp_size: int
    init_method: str  # the process group's rendezvous, ``tcp://127.0.0.1:PORT``
    model_config: ModelConfig
    cache_config: CacheConfig
    max_num_batched_tokens: int
    max_num_seqs: int
    threads: int  # torch threads of this rank


def _die_with_parent() -> None:
    """SIGKILL this process when its parent exits, however it exits (Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the pipe's EOF still ends the worker


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """The spawned process's entry point; returns only to exit 0."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the server, which stops us
    os.environ["PAGEDSERVE_CPU_THREADS"] = str(spec.threads)  # fixed: no thread governor
    import torch

    torch.set_num_threads(spec.threads)
    try:
        runner = _start(spec)
    except Exception as e:  # the model, the layout or the rendezvous: tell the executor
        conn.send(("error", f"{type(e).__name__}: {e}"))
        sys.exit(1)
    _serve(runner, conn)


def _start(spec: WorkerSpec):
    import torch

    from pagedserve.gpu import loader
    from pagedserve.gpu.model_runner import ModelRunner
    from pagedserve.gpu.parallel.comm import ParallelContext
    from pagedserve.gpu.parallel.layout import rank_layout

    mc = spec.model_config
    config = loader.load_config(loader.resolve_model(mc.model).path)
    layout = rank_layout(config, spec.tp_size, spec.pp_size, spec.rank)
    device = torch.device(mc.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    parallel = ParallelContext.init(layout, spec.init_method, device)
    return ModelRunner(mc, spec.cache_config, spec.max_num_batched_tokens, spec.max_num_seqs,
                       parallel)


def _serve(runner, conn: Connection) -> None:
    layout = runner.parallel.layout
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the executor is gone
            break
        kind = msg[0]
        if kind == "stop":
            break
        try:
            if kind == "load":
                info = runner.load()
                conn.send(("ok", (info, layout.describe(), os.getpid())))
            elif kind == "step":
                out = runner.execute_model(msg[1])
                if layout.is_driver:
                    conn.send(("ok", out))
        except Exception as e:
            conn.send(("error", f"rank {layout.rank}: {type(e).__name__}: {e}"))
            sys.exit(1)
    runner.parallel.destroy()
