"""The executor actor over ``tp × pp`` worker processes (vLLM's ``MultiprocExecutor``, read to
learn only): still the scheduler's only peer, with ``Executor``'s interface, but each step it
broadcasts the ``SchedulerOutput`` to every rank and waits for the sampled tokens of the rank
that samples (the last stage's first rank).

The broadcast: the output is pickled once and its bytes written to one pipe per worker. A
worker waits for the next step blocked in ``recv`` (no spinning, which two cores cannot spare,
and no collective timeout while the server idles); the executor waits on the driver's pipe
and on every worker's pipe and process sentinel at once, so a worker that raises or dies ends
the wait at once with its reason (``WorkerFailed``) instead of hanging in a collective.

Under ``--async-scheduling`` pipeline parallelism keeps ``pp`` batches in flight
(``pipeline_depth``; the scheduler's side is ``actors/core/inflight.py``): a step is broadcast as
soon as it arrives, from a thread of its own, while another thread waits for the replies in
order, so stage 1 starts batch k+1 while stage 2 still computes batch k.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp
import pickle
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import structlog

from pagedserve.actors.actor import Actor
from pagedserve.actors.messages import ExecuteModel, ExecutorMessage
from pagedserve.gpu.batch import ModelRunnerOutput, SchedulerOutput
from pagedserve.gpu.config import CacheConfig, ModelConfig, ParallelConfig
from pagedserve.gpu.cpu.threads import cpu_threads
from pagedserve.gpu.model_info import ModelInfo
from pagedserve.gpu.parallel.comm import free_port
from pagedserve.gpu.parallel.shm_all_reduce import process_exited
from pagedserve.gpu.worker import WorkerSpec, worker_main

log = structlog.get_logger(__name__)

STOP_TIMEOUT_S = 10.0  # a worker's grace to leave its group and exit before SIGKILL


class WorkerFailed(RuntimeError):
    """A worker raised or died; the message says which rank and why. The engine cannot go on:
    the other ranks hold half a step (``/health`` answers 503, the server exits 1)."""


@dataclass(slots=True)
class WorkerHandle:
    rank: int
    process: mp.process.BaseProcess
    conn: Connection


def worker_specs(model: ModelConfig, cache: CacheConfig, parallel: ParallelConfig,
                 max_num_batched_tokens: int, max_num_seqs: int,
                 init_method: str) -> list[WorkerSpec]:
    """One spec per rank; the machine's threads shared out (one at least per rank)."""
    world = parallel.world_size
    threads = max(1, cpu_threads() // world)
    return [WorkerSpec(rank, parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                       init_method, model, cache, max_num_batched_tokens, max_num_seqs, threads)
            for rank in range(world)]


def merge_infos(replies: list[tuple[ModelInfo, dict]]) -> ModelInfo:
    """The engine's ``ModelInfo``: the driver's, with the blocks every rank has (the fewest),
    the KV bytes of all ranks, and each rank's layout."""
    driver = next(info for info, lay in replies if lay["pp_rank"] == max(
        x["pp_rank"] for _, x in replies) and lay["tp_rank"] == 0)
    return dataclasses.replace(
        driver, num_blocks=min(info.num_blocks for info, _ in replies),
        kv_cache_bytes=sum(info.kv_cache_bytes for info, _ in replies),
        parallel_layout=[lay for _, lay in replies])


class MultiprocExecutor(Actor[ExecutorMessage]):
    """``Executor``'s interface (``load``, the step loop, ``stop``) over spawned workers.

    ``failure``: why the workers are gone, once they are; ``dead`` is set then.
    """

    name = "executor"

    def __init__(self, model: ModelConfig, cache: CacheConfig, parallel: ParallelConfig,
                 max_num_batched_tokens: int, max_num_seqs: int):
        super().__init__()
        self.specs = worker_specs(model, cache, parallel, max_num_batched_tokens, max_num_seqs,
                                  f"tcp://127.0.0.1:{free_port()}")
        self.driver_rank = (parallel.pipeline_parallel_size - 1) * parallel.tensor_parallel_size
        self.workers: list[WorkerHandle] = []
        self.failure: str | None = None
        self.dead = asyncio.Event()
        self.broadcast_seconds = 0.0  # summed over steps: the pickling and the pipe writes
        self.num_steps = 0
        self.pipeline_depth = parallel.pipeline_parallel_size  # batches in flight at most
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedserve-executor")
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedserve-bcast")
        self._answers: set[asyncio.Task] = set()  # one per step in flight

    async def load(self) -> ModelInfo:
        """Spawn the workers, let them load, and merge what they report."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._thread, self._load)
        except WorkerFailed as e:  # the worker's one-line reason, as a usage error
            raise ValueError(f"a worker failed to start: {e}") from None
        except BaseException:
            await loop.run_in_executor(self._thread, self._shutdown_workers, 0.0)
            raise

    def _load(self) -> ModelInfo:
        ctx = mp.get_context("spawn")
        for spec in self.specs:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(spec, child), daemon=True,
                               name=f"pagedserve-rank{spec.rank}")
            proc.start()
            child.close()
            self.workers.append(WorkerHandle(spec.rank, proc, parent))
        self._send(("load",))
        replies = self._wait({w.rank for w in self.workers})
        info = merge_infos([replies[w.rank] for w in self.workers])
        for lay in info.parallel_layout or ():
            log.info("parallel_rank", **lay)
        return info

    def _send(self, msg) -> None:
        payload = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for w in self.workers:
            try:
                w.conn.send_bytes(payload)
            except OSError:  # its pipe is closed: it died; _wait says how
                pass

    def _wait(self, ranks: set[int]) -> dict:
        """The replies of ``ranks``; raises ``WorkerFailed`` when any worker errs or exits."""
        results: dict = {}
        by_conn: dict[Any, WorkerHandle] = {w.conn: w for w in self.workers}
        by_sentinel: dict[Any, WorkerHandle] = {w.process.sentinel: w for w in self.workers}
        while ranks - results.keys():
            for ready in wait([*by_conn, *by_sentinel]):
                w = by_conn.get(ready)
                if w is None:  # a process ended; read what it said first, if anything
                    w = by_sentinel[ready]
                    if not w.conn.poll():
                        w.process.join(timeout=1)  # reap it: its exit code is known then
                        self._fail(f"worker rank {w.rank} (pid {w.process.pid}) exited with "
                                   f"code {w.process.exitcode}")
                    continue
                try:
                    kind, payload = w.conn.recv()
                except (EOFError, OSError):
                    w.process.join(timeout=1)
                    self._fail(f"worker rank {w.rank} (pid {w.process.pid}) exited with code "
                               f"{w.process.exitcode}")
                if kind == "error":
                    self._fail(self._root_cause(w) or payload)
                results[w.rank] = payload
        return results

    def _root_cause(self, failed: WorkerHandle) -> str | None:
        """A peer that has exited, when ``failed`` reports an error: that exit is why it failed
        (a collective or shared-memory all-reduce that lost its peer), so the requests' error
        names it."""
        for w in self.workers:
            if w is not failed and process_exited(w.process.pid):
                w.process.join(timeout=1)
                return (f"worker rank {w.rank} (pid {w.process.pid}) exited with code "
                        f"{w.process.exitcode}")
        return None

    def _fail(self, reason: str) -> None:
        self.failure = reason
        log.error("worker_failed", reason=reason)
        self._shutdown_workers(grace_s=0.0)  # the others are stuck in a collective
        raise WorkerFailed(reason)

    def broadcast(self, scheduler_output: SchedulerOutput) -> None:
        """Send one step to every rank (on the sender thread, steps in order)."""
        if self.failure is not None:
            return  # the waiter raises
        start = time.perf_counter()
        try:
            self._send(("step", scheduler_output))
        except Exception as e:  # the waiter would wait for a reply that never comes
            self._fail(f"broadcast of a step failed: {type(e).__name__}: {e}")
        self.broadcast_seconds += time.perf_counter() - start
        self.num_steps += 1

    def wait_output(self) -> ModelRunnerOutput:
        """The oldest unanswered step's output, from the rank that samples (waiter thread)."""
        if self.failure is not None:
            raise WorkerFailed(self.failure)
        return self._wait({self.driver_rank})[self.driver_rank]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step on every rank, nothing else in flight (tools and tests)."""
        self.broadcast(scheduler_output)
        return self.wait_output()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            msg: ExecuteModel = await self.mailbox.get()
            sent = loop.run_in_executor(self._sender, self.broadcast, msg.scheduler_output)
            output = loop.run_in_executor(self._thread, self.wait_output)  # in arrival order
            task = loop.create_task(self._answer(msg, sent, output))
            self._answers.add(task)
            task.add_done_callback(self._answers.discard)

    async def _answer(self, msg: ExecuteModel, sent: asyncio.Future,
                      output: asyncio.Future) -> None:
        """Pass ``msg``'s output, or why there is none, to its reply."""
        try:
            await sent
            runner_output = await output
        except Exception as e:
            if isinstance(e, WorkerFailed):
                self.dead.set()
            if not msg.reply.done():
                msg.reply.set_exception(e)
            return
        if not msg.reply.done():
            msg.reply.set_result(runner_output)

    def _shutdown_workers(self, grace_s: float = STOP_TIMEOUT_S) -> None:
        """Ask every worker to stop, give them ``grace_s``, then SIGTERM, then SIGKILL what is
        left; reap them all."""
        self._send(("stop",))
        deadline = time.monotonic() + grace_s
        for w in self.workers:
            w.process.join(timeout=max(0.0, deadline - time.monotonic()))
        for w in self.workers:
            if w.process.is_alive():
                w.process.terminate()
                w.process.join(timeout=2)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            w.conn.close()
        self.workers = []

    async def stop(self) -> None:
        await super().stop()
        for task in list(self._answers):
            task.cancel()
        await asyncio.get_running_loop().run_in_executor(self._thread, self._shutdown_workers)
        self._thread.shutdown(wait=True, cancel_futures=True)
        self._sender.shutdown(wait=True, cancel_futures=True)
