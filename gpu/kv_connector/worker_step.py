"""The worker half of a KV connector around one model-runner step (vLLM's
``KVConnectorModelRunnerMixin`` in ``vllm/v1/worker/kv_connector_model_runner_mixin.py``; read
to learn only): loads before the forward pass, saves after it, and the finished / failed
transfers reported on the step's ``ModelRunnerOutput``.

The runner calls ``build_worker_connector`` once, after its KV tensors exist, and
``ConnectorStep.run`` in place of its plain step when a connector is configured; without one
it never comes here (no calls at all).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog
import torch

from pagedserve.gpu.batch import ModelRunnerOutput, SchedulerOutput
from pagedserve.gpu.kv_connector.base import KVConnectorWorker, KVTransferConfig
from pagedserve.gpu.kv_connector.registry import make_worker_connector

if TYPE_CHECKING:
    from pagedserve.gpu.parallel.comm import ParallelContext

log = structlog.get_logger(__name__)


def build_worker_connector(
    config: KVTransferConfig | None, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    parallel: ParallelContext | None = None,
) -> ConnectorStep | None:
    """The rank's worker half with its KV tensors registered, or ``None`` without a config.
    ``parallel``: this rank's place under tp/pp (``None``: the only rank)."""
    layout = parallel.layout if parallel is not None else None
    rank, world_size = (layout.rank, layout.world_size) if layout is not None else (0, 1)
    connector = make_worker_connector(config, rank, world_size)
    if connector is None:
        return None
    connector.register_kv_caches(kv_caches)
    log.info("kv_connector", connector=config.kv_connector, role=config.kv_role.value,
             rank=rank, world_size=world_size)
    return ConnectorStep(connector, world_size)


class ConnectorStep:
    """One rank's connector around its steps. Under tp/pp every rank runs the same step on its
    own shard, and only the sampling rank answers the scheduler, so the ranks' reports are
    gathered (over the world group, every step: all ranks take the same path): a failed load on
    any rank fails the request, and a transfer is finished once every rank has reported it
    (vLLM's ``KVOutputAggregator``), whatever step each rank saw it in."""

    def __init__(self, connector: KVConnectorWorker, world_size: int = 1):
        self.connector = connector
        self.world_size = world_size
        self._sending: Counter[str] = Counter()  # request → ranks that reported it so far
        self._recving: Counter[str] = Counter()

    def run(self, scheduler_output: SchedulerOutput,
            execute: Callable[[SchedulerOutput], ModelRunnerOutput]) -> ModelRunnerOutput:
        """``execute(so)`` between the connector's load and save; a step with no requests
        (the scheduler polling its transfers) only moves blocks and reports.

        A load that fails is reported in ``failed_recving``; the forward pass still runs (the
        request's K/V past its local hits is not valid, so the scheduler drops what it
        sampled)."""
        meta = scheduler_output.kv_connector_metadata
        if meta is not None:
            self.connector.start_load_kv(meta)
        runner_output = execute(scheduler_output)
        if meta is not None:
            self.connector.save_kv(meta)
        sending, recving = self.connector.get_finished()
        failed = self.connector.get_failed_loads()
        if self.world_size > 1:
            sending, recving, failed = self._gather(sending, recving, failed)
        runner_output.finished_sending = sending
        runner_output.finished_recving = recving
        runner_output.failed_recving = failed
        return runner_output

    def _gather(self, sending: set[str], recving: set[str],
                failed: set[str]) -> tuple[set[str], set[str], set[str]]:
        import torch.distributed as dist

        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, (sending, recving, failed))
        return (self._all_ranks(self._sending, [p[0] for p in parts]),
                self._all_ranks(self._recving, [p[1] for p in parts]),
                set().union(*(p[2] for p in parts)))

    def _all_ranks(self, counts: Counter[str], reports: list[set[str]]) -> set[str]:
        for ids in reports:
            counts.update(ids)
        done = {rid for rid, n in counts.items() if n >= self.world_size}
        for rid in done:
            del counts[rid]
        return done
