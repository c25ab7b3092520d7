"""The worker half of a KV connector around one model-runner step (vLLM's
``KVConnectorModelRunnerMixin`` in ``vllm/v1/worker/kv_connector_model_runner_mixin.py``; read
to learn only): loads before the forward pass, saves after it, and the finished / failed
transfers reported on the step's ``ModelRunnerOutput``.

The runner calls ``build_worker_connector`` once, after its KV tensors exist, and
``run_step`` in place of its plain step when a connector is configured; without one it never
comes here (no calls at all).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

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
) -> KVConnectorWorker | None:
    """The rank's worker half with its KV tensors registered, or ``None`` without a config.
    ``parallel``: this rank's place under tp/pp (``None``: the only rank)."""
    layout = parallel.layout if parallel is not None else None
    rank, world_size = (layout.rank, layout.world_size) if layout is not None else (0, 1)
    connector = make_worker_connector(config, rank, world_size)
    if connector is not None:
        connector.register_kv_caches(kv_caches)
        log.info("kv_connector", connector=config.kv_connector, role=config.kv_role.value,
                 rank=rank, world_size=world_size)
    return connector


def run_step(connector: KVConnectorWorker, so: SchedulerOutput,
             execute: Callable[[SchedulerOutput], ModelRunnerOutput]) -> ModelRunnerOutput:
    """``execute(so)`` between the connector's load and save; a step with no requests (the
    scheduler polling its transfers) only moves blocks and reports.

    A load that fails is reported in ``failed_recving``; the forward pass still runs (the
    request's K/V past its local hits is not valid, so the scheduler drops what it sampled).
    """
    meta = so.kv_connector_metadata
    if meta is not None:
        connector.start_load_kv(meta)
    out = execute(so)
    if meta is not None:
        connector.save_kv(meta)
    if out is None:  # a rank that does not sample: its connector still reports
        out = ModelRunnerOutput({})
    out.finished_sending, out.finished_recving = connector.get_finished()
    out.failed_recving = connector.get_failed_loads()
    return out
