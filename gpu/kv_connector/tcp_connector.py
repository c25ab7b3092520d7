"""``TCPConnector``: the decode instance pulls exactly a prompt's KV blocks from the prefill
instance that computed them, over TCP (vLLM's NixlConnector is the model: the producer holds
the blocks and says where they are, the consumer reads them, then says done).

- **Producer** (``kv_producer`` / ``kv_both``, the prefill instance): a request sent with
  ``kv_transfer_params.do_remote_decode`` keeps its prompt's blocks when it ends; the response's
  ``kv_transfer_params`` say where they are (``remote_engine_id``, ``remote_request_id``,
  ``remote_block_ids``, ``remote_host``, ``remote_port``). Each rank's worker half serves its
  KV tensors' blocks from a server thread on ``kv_connector_extra_config`` ``host`` and
  ``port + rank`` (``tcp_transfer.BlockServer``) until the consumer is done
  (``finished_sending``: the scheduler frees them) or the hold times out (the offer is
  withdrawn first, so a late pull never reads a reused block).
- **Consumer** (``kv_consumer`` / ``kv_both``, the decode instance): a request carrying
  ``do_remote_prefill`` loads its prompt's full blocks (all but the last token's, which is
  computed to sample) past its own prefix-cache hits, asynchronously (``load_async``): the
  request waits in ``WAITING_FOR_REMOTE_KVS`` while the other requests keep decoding; each rank
  pulls its own heads (rank r from the producer's rank r) on a worker pool thread
  (``tcp_transfer.pull_blocks``), writes them into the blocks the scheduler allocated and checks
  one xxh3-64 checksum per block. A bad checksum, a dead producer or a socket timeout
  (``timeout_s``, default 10) is a failed load (``get_failed_loads``), never a hang.
- **Under tp/pp** only the driver rank's report reaches the scheduler, so each rank reports a
  transfer (loaded, failed, or sent) only once every rank's part of it has ended, asking the
  producer's ranks over the same socket protocol (``_peers_settled``).

Why TCP and not torch.distributed point-to-point (gloo): a gloo ``send``/``recv`` pair needs both
instances in one process group, formed up front with a fixed world size and a rendezvous;
prefill and decode instances come and go independently, any decode may pull from any prefill,
and a dead peer makes a gloo collective hang or abort the group, while a socket just times out
or is refused: one failed load, handled by the failure policy. On the CPU the bytes are copied
through the kernel either way, so gloo would buy nothing. On CUDA the bulk bytes belong on the
GPU fabric instead: the same handshake over this socket, then an NCCL (or NIXL/UCX) transfer of
the blocks from the producer's device tensors into the consumer's, where ``_receive_blocks``
and ``BlockServer._serve_pull`` now move host bytes.

Layers as they are ready: the producer streams one layer's blocks at a time and the consumer
writes each into its KV tensors as it arrives, so no copy of the whole prompt is staged. A
per-layer handoff into the decode's own forward pass would pay only if the pull started while
the prefill ran; here it starts after the prefill's response (the proxy's order), when every
layer is ready, and the load overlaps with the decode instance's other requests instead.

``kv_connector_extra_config``: ``host`` (default ``127.0.0.1``), ``port`` (producer: required;
rank r listens on ``port + r``), ``timeout_s`` (socket timeout, default 10).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from pagedserve.gpu.kv_connector.base import (
    ConnectorRequest,
    KVConnectorMetadata,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVRole,
    KVTransferConfig,
)
from pagedserve.gpu.kv_connector.tcp_transfer import (
    BlockServer,
    TransferError,
    peer_state,
    pull_blocks,
    send_release,
)

log = structlog.get_logger(__name__)

DEFAULT_TIMEOUT_S = 10.0
_PEER_WAIT_TIMEOUTS = 6  # under tp: how many socket timeouts a rank waits for the others
_PEER_POLL_S = 0.005
_HOLD_MARGIN_S = 1.0  # offers are withdrawn this long before the scheduler frees the blocks


def _extra(config: KVTransferConfig) -> tuple[str, int | None, float]:
    extra = config.kv_connector_extra_config
    port = extra.get("port")
    return (str(extra.get("host", "127.0.0.1")), int(port) if port is not None else None,
            float(extra.get("timeout_s", DEFAULT_TIMEOUT_S)))


@dataclass(slots=True)
class TCPLoad:
    """One request's pull: remote blocks → local blocks, on every rank."""

    request_id: str
    remote_request_id: str
    host: str
    port: int  # the producer's rank 0; rank r pulls from port + r
    remote_block_ids: list[int]
    local_block_ids: list[int]


@dataclass(slots=True)
class TCPConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker halves (plain lists: it pickles to tp/pp workers)."""

    loads: list[TCPLoad] = field(default_factory=list)
    releases: list[TCPLoad] = field(default_factory=list)  # "done" with nothing to pull
    offers: dict[str, list[int]] = field(default_factory=dict)  # producer: serve these
    withdrawals: list[str] = field(default_factory=list)  # producer: holds that timed out


class TCPConnectorScheduler(KVConnectorScheduler):
    """Scheduler half: decides loads (consumer) and holds (producer); no I/O here."""

    def __init__(self, config: KVTransferConfig, block_size: int):
        super().__init__(config, block_size)
        self.host, self.port, _ = _extra(config)
        self.produces = config.kv_role in (KVRole.PRODUCER, KVRole.BOTH)
        self.consumes = config.kv_role in (KVRole.CONSUMER, KVRole.BOTH)
        if self.produces and self.port is None:
            raise ValueError("TCPConnector as a producer needs kv_connector_extra_config "
                             "'port' (rank r of the prefill instance listens on port + r)")
        self._local_hits: dict[str, int] = {}  # consumer: tokens computed locally at match
        self._done: set[str] = set()  # consumer: requests whose load was already decided
        self._loads: list[TCPLoad] = []
        self._releases: list[TCPLoad] = []
        self._offers: dict[str, list[int]] = {}
        self._held: dict[str, float] = {}  # producer: request id → withdrawal time

    @staticmethod
    def _remote(request: ConnectorRequest) -> dict[str, Any] | None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or not params.get("remote_host"):
            return None
        return params

    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        params = self._remote(request) if self.consumes else None
        if params is None or request.request_id in self._done:
            return 0, False
        full = min(len(params["remote_block_ids"]),
                   (len(request.prompt_token_ids) - 1) // self.block_size)
        num = full * self.block_size - num_computed_tokens
        self._local_hits[request.request_id] = num_computed_tokens
        if num <= 0:  # all local hits: nothing to pull, but the producer may let go
            self._done.add(request.request_id)
            self._releases.append(self._load(request, params, [], []))
            return 0, False
        return num, True

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        params = self._remote(request)
        if params is None or num_external_tokens <= 0 or request.request_id in self._done:
            return
        first = self._local_hits.pop(request.request_id, 0) // self.block_size
        last = first + num_external_tokens // self.block_size
        self._done.add(request.request_id)
        self._loads.append(self._load(request, params, params["remote_block_ids"][first:last],
                                      block_ids[first:last]))

    @staticmethod
    def _load(request: ConnectorRequest, params: dict[str, Any], remote: list[int],
              local: list[int]) -> TCPLoad:
        return TCPLoad(request.request_id,
                       str(params.get("remote_request_id") or request.request_id),
                       str(params["remote_host"]), int(params["remote_port"]), list(remote),
                       list(local))

    def build_connector_meta(self) -> TCPConnectorMetadata | None:
        now = time.monotonic()
        expired = [rid for rid, t in self._held.items() if now >= t]
        for rid in expired:
            del self._held[rid]
        meta = TCPConnectorMetadata(self._loads, self._releases, self._offers, expired)
        self._loads, self._releases, self._offers = [], [], {}
        if not (meta.loads or meta.releases or meta.offers or meta.withdrawals):
            return None
        return meta

    def request_finished(self, request: ConnectorRequest,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._done.discard(request.request_id)
        self._local_hits.pop(request.request_id, None)
        params = request.kv_transfer_params
        # Only a prefill that computed its whole prompt has blocks worth a consumer's pull (one
        # aborted before that: none comes; if one does, it recomputes).
        if (not self.produces or not params or not params.get("do_remote_decode")
                or request.num_computed_tokens < len(request.prompt_token_ids)):
            return False, None
        held = block_ids[: len(request.prompt_token_ids) // self.block_size]
        if not held:
            return False, None
        self._offers[request.request_id] = list(held)
        self._held[request.request_id] = (time.monotonic() + self.config.kv_hold_timeout_s
                                          - min(_HOLD_MARGIN_S, self.config.kv_hold_timeout_s / 2))
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": self.config.engine_id, "remote_request_id": request.request_id,
            "remote_block_ids": list(held), "remote_host": self.host, "remote_port": self.port,
        }


class TCPConnectorWorker(KVConnectorWorker):
    """Worker half of one rank: the block server (producer) and the pulls (consumer)."""

    def __init__(self, config: KVTransferConfig, rank: int = 0, world_size: int = 1):
        super().__init__(config, rank, world_size)
        self.host, self.port, self.timeout_s = _extra(config)
        self.produces = config.kv_role in (KVRole.PRODUCER, KVRole.BOTH)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.server: BlockServer | None = None
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-tcp-pull")
        self._lock = threading.Lock()
        self._sent: set[str] = set()
        self._recved: set[str] = set()
        self._failed: dict[str, str] = {}
        self.failure_reasons: dict[str, str] = {}  # request id → why its load failed

    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.kv_caches = kv_caches
        if self.produces:
            if self.port is None:
                raise ValueError("TCPConnector as a producer needs kv_connector_extra_config "
                                 "'port'")
            self.server = BlockServer(kv_caches, self.host, self.port + self.rank,
                                      self.timeout_s, self._on_sent)
            log.info("kv_tcp_serving", host=self.host, port=self.port + self.rank,
                     rank=self.rank)

    def _on_sent(self, request_id: str) -> None:
        if self.world_size > 1:  # the blocks go only once every rank's consumer is done
            self._pool.submit(self._sent_everywhere, request_id)
            return
        with self._lock:
            self._sent.add(request_id)

    def _sent_everywhere(self, request_id: str) -> None:
        local = "127.0.0.1" if self.host in ("", "0.0.0.0", "::") else self.host
        self._peers_settled(local, self.port, request_id)
        with self._lock:
            self._sent.add(request_id)

    def _peers_settled(self, host: str, port: int, request_id: str) -> bool:
        """Under tp, wait until every other rank's transfer of ``request_id`` ended (as the
        producer's rank ``r`` at ``port + r`` sees it); returns whether all of them succeeded.

        Only one rank's report reaches the scheduler (the executor returns the driver rank's
        output), so each rank reports a transfer only once all ranks are done with it: a
        request never runs on blocks another rank is still writing, and a producer's blocks
        are never freed while another rank still reads them."""
        deadline = time.monotonic() + _PEER_WAIT_TIMEOUTS * self.timeout_s
        ok = True
        for r in range(self.world_size):
            if r == self.rank:
                continue
            while (state := peer_state(host, port + r, request_id, self.timeout_s)) in (
                    "pending", "unknown") and time.monotonic() < deadline:
                time.sleep(_PEER_POLL_S)
            ok = ok and state == "done"
        return ok

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        if not isinstance(metadata, TCPConnectorMetadata):
            return
        if self.server is not None:
            for rid in metadata.withdrawals:
                self.server.withdraw(rid)
            for rid, block_ids in metadata.offers.items():
                self.server.offer(rid, block_ids)
        for load in metadata.loads:
            self._pool.submit(self._pull, load)
        for load in metadata.releases:
            self._pool.submit(self._release, load)

    def _pull(self, load: TCPLoad) -> None:
        start = time.perf_counter()
        reason = None
        try:
            pull_blocks(self.kv_caches, load.host, load.port + self.rank, load.remote_request_id,
                        load.remote_block_ids, load.local_block_ids, self.rank, self.timeout_s)
        except (OSError, TransferError, ValueError, KeyError) as e:
            reason = (f"KV load from {load.host}:{load.port + self.rank} failed: "
                      f"{type(e).__name__}: {e}")
        # Under tp, even a failure is reported only once no other rank still writes the blocks
        # (the recompute that follows writes them too).
        if self.world_size > 1 and not self._peers_settled(load.host, load.port,
                                                           load.remote_request_id):
            reason = reason or "KV load failed on another tensor-parallel rank"
        if reason is not None:
            self._fail(load, reason)
            return
        log.debug("kv_loaded", request_id=load.request_id, blocks=len(load.local_block_ids),
                  seconds=round(time.perf_counter() - start, 4))
        with self._lock:
            self._recved.add(load.request_id)

    def _fail(self, load: TCPLoad, reason: str) -> None:
        log.warning("kv_load_failed", request_id=load.request_id, reason=reason)
        with self._lock:
            self._failed[load.request_id] = reason

    def _release(self, load: TCPLoad) -> None:
        try:
            send_release(load.host, load.port + self.rank, load.remote_request_id, self.timeout_s)
        except OSError as e:  # the producer's hold timeout frees them anyway
            log.info("kv_release_failed", request_id=load.request_id, error=str(e))

    def get_finished(self) -> tuple[set[str], set[str]]:
        with self._lock:
            sent, recved = self._sent, self._recved
            self._sent, self._recved = set(), set()
        return sent, recved

    def get_failed_loads(self) -> set[str]:
        """Loads that failed since the last call; why is logged and kept in
        ``failure_reasons`` (the last few hundred)."""
        with self._lock:
            failed, self._failed = self._failed, {}
        self.failure_reasons.update(failed)
        while len(self.failure_reasons) > 256:
            del self.failure_reasons[next(iter(self.failure_reasons))]
        return set(failed)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self.server is not None:
            self.server.close()
