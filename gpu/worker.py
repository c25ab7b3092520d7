"""One rank of a tensor/pipeline-parallel model: a spawned process that owns its shard of the
weights and of the KV cache and runs the ordinary ``ModelRunner`` on it (vLLM's
``vllm/v1/executor/multiproc_executor.py`` ``WorkerProc``; read to learn only).

The executor (``actors/executor/multiproc.py``) talks to each worker over one pipe:

- ``("load",)`` → every worker loads; each answers ``("ok", (ModelInfo, its layout))``;
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
from pathlib import Path

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


class Worker:
    """One rank: its ``ModelRunner`` over its shard. The same class runs in a spawned process
    (``worker_main``, the mp backend) and as a Ray actor (the ray backend)."""

    def __init__(self, spec: WorkerSpec):
        os.environ["PAGEDSERVE_CPU_THREADS"] = str(spec.threads)  # fixed: no thread governor
        import torch

        torch.set_num_threads(spec.threads)
        self.spec = spec
        self.runner = None

    def node_address(self) -> str:
        """This machine's address as the other ranks reach it (the rendezvous of rank 0)."""
        import socket

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect(("10.255.255.255", 1))  # no packet is sent: picks the routed interface
                return s.getsockname()[0]
            except OSError:
                return "127.0.0.1"

    def rendezvous(self) -> str:
        """A ``tcp://`` address on this machine that the other ranks can reach (rank 0's)."""
        from pagedserve.gpu.parallel.comm import free_port

        return f"tcp://{self.node_address()}:{free_port('0.0.0.0')}"

    def init(self, init_method: str | None = None) -> None:
        """Join the process group (``init_method`` overrides the spec's) and build the runner."""
        import torch

        from pagedserve.gpu import loader
        from pagedserve.gpu.model_runner import ModelRunner
        from pagedserve.gpu.parallel.comm import ParallelContext
        from pagedserve.gpu.parallel.layout import rank_layout

        spec, mc = self.spec, self.spec.model_config
        config = loader.load_config(loader.resolve_model(mc.model).path)
        layout = rank_layout(config, spec.tp_size, spec.pp_size, spec.rank)
        device = torch.device(mc.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        parallel = ParallelContext.init(layout, init_method or spec.init_method, device)
        self.runner = ModelRunner(mc, spec.cache_config, spec.max_num_batched_tokens,
                                  spec.max_num_seqs, parallel=parallel)

    def load(self):
        """``(ModelInfo, RankLayout.describe() with the pid and whether this rank captured
        CUDA graphs)``."""
        info = self.runner.load()
        return info, {**self.runner.parallel.layout.describe(), "pid": os.getpid(),
                      "cuda_graphs": self.runner.cuda_graphs is not None}

    def execute(self, scheduler_output):
        """The step's ``ModelRunnerOutput`` on the rank that samples, ``None`` elsewhere."""
        runner_output = self.runner.execute_model(scheduler_output)
        return runner_output if self.runner.parallel.layout.is_driver else None

    def stop(self) -> None:
        if self.runner is not None:
            self.runner.parallel.destroy()


def _one_gpu_per_rank(rank: int) -> None:
    """Before CUDA starts in this process: let it see only this rank's GPU (the ``rank``-th of
    those the server sees), so every rank's ``cuda`` is its own device and NCCL finds one GPU
    per rank (vLLM's way; Ray does the same for its actors). No effect without CUDA."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        devices = [d for d in visible.split(",") if d]
    else:  # counted without starting CUDA (which would fix what this process sees)
        devices = [str(i) for i in range(len(list(Path("/dev").glob("nvidia[0-9]*"))))]
    if rank < len(devices):  # else the ranks share devices, and NCCL says so at start
        os.environ["CUDA_VISIBLE_DEVICES"] = devices[rank]


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """The spawned process's entry point (mp backend); exits 0 when told to stop."""
    _die_with_parent()
    if spec.model_config.device in (None, "cuda"):
        _one_gpu_per_rank(spec.rank)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the server, which stops us
    worker = Worker(spec)
    try:
        worker.init()
    except Exception as e:  # the model, the layout or the rendezvous: tell the executor
        conn.send(("error", f"rank {spec.rank}: {type(e).__name__}: {e}"))
        sys.exit(1)
    _serve(worker, conn)


def _serve(worker: Worker, conn: Connection) -> None:
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
                conn.send(("ok", worker.load()))
            elif kind == "step":
                runner_output = worker.execute(msg[1])
                if runner_output is not None:
                    conn.send(("ok", runner_output))
        except Exception as e:
            conn.send(("error", f"rank {worker.spec.rank}: {type(e).__name__}: {e}"))
            sys.exit(1)
    worker.stop()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # not the interpreter's shutdown: it would wait on torch's and gloo's threads
