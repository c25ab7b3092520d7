"""Connector names → their two halves (vLLM's ``KVConnectorFactory`` in
``vllm/distributed/kv_transfer/kv_connector/factory.py``; read to learn only).

An entry names a module and its scheduler-half and worker-half classes as strings, so that
``--kv-transfer-config`` can be checked (an unknown name is a 1-line usage error) without
importing torch or the connector's transport. A connector registers itself with one line here
(or, for a plugin, with ``register_connector`` before the engine starts).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from pagedserve.gpu.kv_connector.base import (
    KVConnectorScheduler,
    KVConnectorWorker,
    KVTransferConfig,
)


@dataclass(slots=True, frozen=True)
class ConnectorEntry:
    """Where a connector's halves live: ``module``, and the class names in it."""

    module: str
    scheduler: str
    worker: str


_REGISTRY: dict[str, ConnectorEntry] = {
    "SharedStorageConnector": ConnectorEntry(
        "pagedserve.gpu.kv_connector.shared_storage", "SharedStorageScheduler",
        "SharedStorageWorker"),
    "TCPConnector": ConnectorEntry(  # the network connector (tcp_connector.py)
        "pagedserve.gpu.kv_connector.tcp_connector", "TCPConnectorScheduler",
        "TCPConnectorWorker"),
}


def register_connector(name: str, entry: ConnectorEntry) -> None:
    """Make ``name`` a valid ``kv_connector`` (a later registration of a name replaces it)."""
    _REGISTRY[name] = entry


def connector_names() -> list[str]:
    return sorted(_REGISTRY)


def connector_entry(name: str) -> ConnectorEntry:
    """Raises ``ValueError`` (one line, the known names) for an unknown connector."""
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ValueError(f"--kv-transfer-config: unknown kv_connector {name!r}; known: "
                         f"{', '.join(connector_names())}")
    return entry


def make_scheduler_connector(config: KVTransferConfig | None,
                             block_size: int) -> KVConnectorScheduler | None:
    """The scheduler half for ``config`` (``None``: no connector, and no calls at all)."""
    if config is None:
        return None
    return _load_half(config, "scheduler")(config, block_size)


def make_worker_connector(config: KVTransferConfig | None, rank: int = 0,
                          world_size: int = 1) -> KVConnectorWorker | None:
    """The worker half for ``config`` on one rank (``None``: no connector)."""
    if config is None:
        return None
    return _load_half(config, "worker")(config, rank, world_size)


def _load_half(config: KVTransferConfig, half: str) -> type:
    entry = connector_entry(config.kv_connector)
    return getattr(importlib.import_module(entry.module), getattr(entry, half))
