"""The executor actor over Ray actors (``--distributed-executor-backend ray``; vLLM's
``RayDistributedExecutor``, read to learn only): the same ``gpu.worker.Worker`` per rank
(behind ``ray_worker.RayWorker``, which keeps a checkout's ``kernels/`` folder from shadowing
Hugging Face's package in the worker processes) and the same torch.distributed groups as the
mp backend, placed by a placement group of one bundle per rank (one CPU, or one GPU on CUDA)
across the machines of a running Ray cluster
(``RAY_ADDRESS``, or ``ray start --head`` on this machine), else on a local Ray instance that
this executor starts and stops.

Each step the ``SchedulerOutput`` goes to every actor (Ray serialises it once into its object
store); the sampled tokens come back from the driver rank. Any rank that raises or dies ends
the step with ``WorkerFailed``, as with the mp backend.
"""

from __future__ import annotations

import os
import queue
import time

import structlog

from pagedserve.actors.executor.multiproc import MultiprocExecutor, WorkerFailed, merge_infos
from pagedserve.actors.executor.ray_worker import RayWorker
from pagedserve.gpu.batch import ModelRunnerOutput, SchedulerOutput
from pagedserve.gpu.model_info import ModelInfo

log = structlog.get_logger(__name__)


def import_ray():
    """``ray``, or a one-line ``ValueError`` saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ValueError("--distributed-executor-backend ray needs Ray: pip install "
                         "'pagedserve[ray]' (or pip install ray)") from None
    return ray


class RayExecutor(MultiprocExecutor):
    """``MultiprocExecutor``'s step loop and failure handling, with Ray actors for ranks."""

    name = "executor"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ray = import_ray()
        self.actors: list = []
        self.placement_group = None
        self._started_ray = False
        self._pending: queue.Queue[list | None] = queue.Queue()  # steps sent, oldest first

    def _load(self) -> ModelInfo:
        ray = self.ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False)
            self._started_ray = True
        cuda = self.specs[0].model_config.device == "cuda"
        bundle = {"GPU": 1} if cuda else {"CPU": 1}
        self.placement_group = placement_group([bundle] * len(self.specs), strategy="PACK")
        ray.get(self.placement_group.ready(), timeout=300)
        remote = ray.remote(num_gpus=1 if cuda else 0, num_cpus=0 if cuda else 1)(RayWorker)
        self.actors = [remote.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            self.placement_group, placement_group_bundle_index=s.rank)).remote(s)
            for s in self.specs]
        init_method = self._get([self.actors[0].rendezvous.remote()])[0]
        self._get([a.init.remote(init_method) for a in self.actors])
        replies = self._get([a.load.remote() for a in self.actors])
        info = merge_infos(replies)
        for lay in info.parallel_layout or ():
            log.info("parallel_rank", backend="ray", **lay)
        return info

    def _get(self, refs: list) -> list:
        """Every result, in order; the first error or dead actor raises ``WorkerFailed``."""
        ray, pending = self.ray, list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(ready[0])
            except Exception as e:  # RayActorError (died), RayTaskError (raised)
                rank = refs.index(ready[0]) if len(refs) == len(self.actors) else 0
                self._fail(f"worker rank {rank}: {type(e).__name__}: {e}".splitlines()[0])
        return ray.get(refs)

    def broadcast(self, scheduler_output: SchedulerOutput) -> None:
        """Hand one step to every actor (the sender thread, steps in order); the waiter takes
        its result refs from ``_pending`` (``None``: there will be no result)."""
        if self.failure is not None:
            self._pending.put(None)
            return
        start = time.perf_counter()
        try:
            ref = self.ray.put(scheduler_output)  # serialised once, read by every rank
            refs = [a.execute.remote(ref) for a in self.actors]
        except Exception as e:  # the waiter would wait for refs that never come
            self._pending.put(None)
            self._fail(f"broadcast of a step failed: {type(e).__name__}: {e}")
        self._pending.put(refs)
        self.broadcast_seconds += time.perf_counter() - start
        self.num_steps += 1

    def wait_output(self) -> ModelRunnerOutput:
        """The oldest unanswered step's output, from the driver rank (the waiter thread)."""
        refs = self._pending.get()
        if refs is None or self.failure is not None:
            raise WorkerFailed(self.failure or "the step was not sent")
        return self._get(refs)[self.driver_rank]

    def _shutdown_workers(self, grace_s: float = 0.0) -> None:
        ray = self.ray
        for a in self.actors:
            ray.kill(a)
        self.actors = []
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
            self.placement_group = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
