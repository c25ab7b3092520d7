"""The KV connector contract (vLLM's ``vllm/distributed/kv_transfer/kv_connector/v1/base.py``,
KVConnectorBase_V1): one connector class per transport, built twice per engine, once per role.

- The **scheduler half** (``KVConnectorScheduler``) runs inside the scheduler actor. It says how
  many of a waiting request's prompt tokens can be loaded from elsewhere, learns which blocks were
  allocated for them, describes each step's loads and saves in a ``KVConnectorMetadata`` that
  rides on the ``SchedulerOutput``, and decides whether a finished request's blocks must be held
  for a consumer.
- The **worker half** (``KVConnectorWorker``) runs next to the model runner (in every rank's
  process under tp/pp). It is given the KV cache tensors once, loads and saves blocks as the
  metadata says, and reports which requests finished loading / sending.

Both halves see requests only through ``ConnectorRequest`` (plain fields), so this module sits
in ``gpu/`` and the scheduler (``actors/``) imports it, never the other way.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # the flag parser reads KVTransferConfig and must not wait for torch
    import torch

    from pagedserve.gpu.batch import ScheduledRequest


class KVRole(str, enum.Enum):  # str: the effective config stays JSON
    PRODUCER = "kv_producer"  # prefill instance: saves / serves blocks
    CONSUMER = "kv_consumer"  # decode instance: loads blocks
    BOTH = "kv_both"


class LoadFailurePolicy(str, enum.Enum):
    """vLLM's ``kv_load_failure_policy``: what a consumer does when a load fails."""

    RECOMPUTE = "recompute"  # default: prefill the prompt locally, same output
    FAIL = "fail"  # finish the request with an error


@dataclass(slots=True)
class KVTransferConfig:
    """``--kv-transfer-config`` (JSON), vLLM's field names.

    Attributes:
        kv_connector: connector class name (e.g. ``"SharedStorageConnector"``).
        kv_role: producer, consumer or both.
        kv_connector_extra_config: the connector's own settings (paths, ports).
        kv_load_failure_policy: recompute (default) or fail.
        kv_hold_timeout_s: seconds a producer keeps a finished prefill's blocks for a consumer
            that has not confirmed (vLLM's ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 120 s there).
        engine_id: this instance's id in ``remote_engine_id`` (random when not given).
    """

    kv_connector: str
    kv_role: KVRole = KVRole.BOTH
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_load_failure_policy: LoadFailurePolicy = LoadFailurePolicy.RECOMPUTE
    kv_hold_timeout_s: float = 120.0
    engine_id: str = ""


class ConnectorRequest(Protocol):
    """What a connector may read of a request (``actors/core/request.py::Request`` satisfies it)."""

    @property
    def request_id(self) -> str: ...

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...

    @property
    def block_hashes(self) -> Sequence[bytes]: ...

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose K/V is in the request's blocks (before this step)."""
        ...

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None: ...


@dataclass(slots=True)
class KVConnectorMetadata:
    """Scheduler half → worker half, once per step, on ``SchedulerOutput.kv_connector_metadata``.
    Each connector subclasses it with what its workers need (block ids to load / save, remote
    addresses). Must pickle (it crosses to tp/pp worker processes)."""


class KVConnectorScheduler:
    """Scheduler half. All methods run on the scheduler actor's loop and must not block."""

    def __init__(self, config: KVTransferConfig, block_size: int):
        self.config = config
        self.block_size = block_size

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int,
    ) -> tuple[int, bool]:
        """Prompt tokens past ``num_computed_tokens`` (local prefix-cache hits) that can be loaded.

        Returns ``(num_tokens, load_async)``: with ``load_async`` the request is parked in
        ``WAITING_FOR_REMOTE_KVS`` until the worker half reports it in ``finished_recving``.
        ``num_tokens`` is a multiple of ``block_size`` and leaves at least one prompt token to
        compute (the last token's logits are needed to sample).
        """
        return 0, False

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int,
    ) -> None:
        """Blocks were allocated for the request; ``block_ids`` is its whole block table and the
        first ``num_external_tokens`` tokens past its local hits are to be loaded into them.
        Called at every admission while a connector is configured (``num_external_tokens`` may
        be 0), so a producer learns of the requests it will save."""

    def on_step_scheduled(self, scheduled: list[ScheduledRequest]) -> None:
        """This step's batch, just before ``build_connector_meta``: which requests compute
        which tokens into which blocks (a producer saves the prompt blocks a step completes)."""

    def build_connector_meta(self) -> KVConnectorMetadata | None:
        """This step's loads and saves (``None``: nothing to do; the worker half is not called)."""
        return None

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int],
    ) -> tuple[bool, dict[str, Any] | None]:
        """The request ended. Returns ``(hold_blocks, kv_transfer_params)``: with
        ``hold_blocks`` the scheduler frees ``block_ids`` only after ``finished_sending`` names
        the request or ``kv_hold_timeout_s`` passes; the params go back in the response."""
        return False, None


class KVConnectorWorker:
    """Worker half, on the model runner's thread (every rank)."""

    def __init__(self, config: KVTransferConfig, rank: int = 0, world_size: int = 1):
        self.config = config
        self.rank = rank
        self.world_size = world_size

    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The rank's KV tensors: per layer ``(key_cache, value_cache)``, each
        ``[num_blocks, block_size, kv_heads, head_size]`` (``gpu/kv_cache.allocate_kv_caches``);
        block ids index dim 0. Under tp each rank holds its own heads of the same block ids."""

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Begin this step's loads (before the forward pass)."""

    def save_kv(self, metadata: KVConnectorMetadata) -> None:
        """Blocks the step filled that the metadata says to save (after the forward pass)."""

    def get_finished(self) -> tuple[set[str], set[str]]:
        """``(finished_sending, finished_recving)`` request ids since the last call."""
        return set(), set()

    def get_failed_loads(self) -> set[str]:
        """Request ids whose load failed since the last call (a missing, truncated or corrupt
        block): their blocks hold nothing valid past the local hits, and the scheduler
        recomputes or fails them (``kv_load_failure_policy``)."""
        return set()

    def shutdown(self) -> None:
        """Close sockets, threads and files."""
