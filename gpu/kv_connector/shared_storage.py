"""``SharedStorageConnector``: KV blocks through a directory (vLLM's example connector of the
same name, ``vllm/distributed/kv_transfer/kv_connector/v1/shared_storage_connector.py``; read
to learn only).

A producer (``kv_producer`` or ``kv_both``) writes each full prompt block, in the step whose
forward pass completes it, to ``kv_connector_extra_config.shared_storage_path``; a consumer
(``kv_consumer`` or ``kv_both``) admitting a request loads the prompt's full blocks found there
after its local prefix-cache hits, in the same step, before the forward pass, and computes only
the rest. Files are named by the block's prefix-cache hash (which chains over every earlier
token and the cache salt), so equal names mean equal prefixes: the directory is also a KV cache
that outlives a restart, and one instance can be producer and consumer of its own blocks.
Both instances must use the same model, dtype, block size and hash algorithm
(``--prefix-caching-hash-algo``; prefix caching on, as by default: the hashes come from it).

One file per block and rank (``<hash>.r<rank>.kv``), all of the rank's layers' K and V, written
to a temporary name and renamed, so a reader never sees half a file. A file starts with a
header (magic, layers, block shape, dtype, payload bytes, BLAKE2b digest of the payload); a
file that is missing, truncated, corrupt or of another shape fails the request's load, which
the scheduler recomputes or fails (``kv_load_failure_policy``), never a wrong answer.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from pagedserve.gpu.kv_connector.base import (
    ConnectorRequest,
    KVConnectorMetadata,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVRole,
    KVTransferConfig,
)

if TYPE_CHECKING:
    import torch

    from pagedserve.gpu.batch import ScheduledRequest

log = structlog.get_logger(__name__)

MAGIC = b"PAGEDSERVE-KV-1\n"
PATH_KEY = "shared_storage_path"


def storage_path(config: KVTransferConfig) -> Path:
    """The directory (created if missing). Raises ``ValueError`` when it is not configured."""
    path = config.kv_connector_extra_config.get(PATH_KEY)
    if not isinstance(path, str) or not path:
        raise ValueError(f'--kv-transfer-config: SharedStorageConnector needs '
                         f'kv_connector_extra_config {{"{PATH_KEY}": DIR}}')
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    return out


def block_file(root: Path, block_hash: bytes, rank: int = 0) -> Path:
    return root / f"{block_hash.hex()}.r{rank}.kv"


@dataclass(slots=True)
class BlockTransfer:
    """One request's blocks to load or save: ``block_ids[i]`` holds the block hashed
    ``block_hashes[i]``."""

    req_id: str
    block_ids: list[int]
    block_hashes: list[bytes]


@dataclass(slots=True)
class SharedStorageMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


class SharedStorageScheduler(KVConnectorScheduler):
    """Finds a prompt's blocks on disk (rank 0's file stands for all ranks) and says which
    blocks each step saves."""

    def __init__(self, config: KVTransferConfig, block_size: int):
        super().__init__(config, block_size)
        self.root = storage_path(config)
        self.consumes = config.kv_role in (KVRole.CONSUMER, KVRole.BOTH)
        self.produces = config.kv_role in (KVRole.PRODUCER, KVRole.BOTH)
        self._matched: dict[str, int] = {}  # request → first block to load
        self._producing: dict[str, ConnectorRequest] = {}
        self._saved_upto: dict[str, int] = {}  # request → prompt blocks saved so far
        self._meta = SharedStorageMetadata()

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int,
    ) -> tuple[int, bool]:
        if not self.consumes:
            return 0, False
        start = num_computed_tokens // self.block_size
        end = min((len(request.prompt_token_ids) - 1) // self.block_size,
                  len(request.block_hashes))
        n = start
        while n < end and block_file(self.root, request.block_hashes[n]).exists():
            n += 1
        self._matched[request.request_id] = start
        return (n - start) * self.block_size, False  # loaded in the step, before the forward

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int,
    ) -> None:
        rid = request.request_id
        start = self._matched.pop(rid, 0)
        if num_external_tokens:
            end = start + num_external_tokens // self.block_size
            self._meta.loads.append(BlockTransfer(
                rid, block_ids[start:end], list(request.block_hashes[start:end])))
        if self.produces:
            self._producing[rid] = request

    def on_step_scheduled(self, scheduled: list[ScheduledRequest]) -> None:
        """Save the prompt blocks this step completes (those not on disk yet)."""
        if not self.produces:
            return
        for scheduled_request in scheduled:
            request = self._producing.get(scheduled_request.req_id)
            if request is None:
                continue
            end = scheduled_request.num_computed_tokens + len(scheduled_request.token_ids)
            full = min(scheduled_request.num_prompt_tokens, end) // self.block_size
            full = min(full, len(request.block_hashes), len(scheduled_request.block_ids))
            begin = self._saved_upto.get(scheduled_request.req_id, 0)
            todo = [i for i in range(begin, full)
                    if not block_file(self.root, request.block_hashes[i]).exists()]
            if todo:
                self._meta.saves.append(BlockTransfer(
                    scheduled_request.req_id, [scheduled_request.block_ids[i] for i in todo],
                    [request.block_hashes[i] for i in todo]))
            self._saved_upto[scheduled_request.req_id] = max(begin, full)

    def build_connector_meta(self) -> KVConnectorMetadata | None:
        if not (self._meta.loads or self._meta.saves):
            return None
        meta, self._meta = self._meta, SharedStorageMetadata()
        return meta

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[int],
    ) -> tuple[bool, dict[str, Any] | None]:
        """Nothing to hold: the blocks went to disk in the steps that computed them. A request
        that asked for a remote decode gets vLLM's fields for the decode instance back."""
        rid = request.request_id
        self._matched.pop(rid, None)
        self._producing.pop(rid, None)
        self._saved_upto.pop(rid, None)
        params = request.kv_transfer_params or {}
        if not (self.produces and params.get("do_remote_decode")):
            return False, None
        return False, {"do_remote_prefill": True, "do_remote_decode": False,
                       "remote_engine_id": self.config.engine_id, "remote_block_ids": block_ids,
                       "remote_host": None, "remote_port": None}


class SharedStorageWorker(KVConnectorWorker):
    """Reads and writes this rank's block files, synchronously, on the runner's thread."""

    def __init__(self, config: KVTransferConfig, rank: int = 0, world_size: int = 1):
        super().__init__(config, rank, world_size)
        self.root = storage_path(config)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._failed: set[str] = set()

    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.kv_caches = kv_caches

    def _header(self, block_hash: bytes, nbytes: int, digest: str) -> dict[str, Any]:
        key = self.kv_caches[0][0]
        return {"hash": block_hash.hex(), "layers": len(self.kv_caches),
                "shape": list(key.shape[1:]), "dtype": str(key.dtype).removeprefix("torch."),
                "nbytes": nbytes, "digest": digest}

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Load every block of each request in ``metadata.loads``; a request's first bad file
        stops its load and reports it in ``get_failed_loads``."""
        for t in metadata.loads:  # type: ignore[attr-defined]
            for block_id, block_hash in zip(t.block_ids, t.block_hashes, strict=True):
                problem = self._load_block(block_id, block_hash)
                if problem is not None:
                    log.warning("kv_block_load_failed", request_id=t.req_id,
                                file=block_file(self.root, block_hash, self.rank).name,
                                problem=problem)
                    self._failed.add(t.req_id)
                    break

    def _load_block(self, block_id: int, block_hash: bytes) -> str | None:
        """Copy one block file into ``block_id``; returns what is wrong with it, if anything."""
        import torch

        try:
            data = block_file(self.root, block_hash, self.rank).read_bytes()
        except OSError as e:
            return f"unreadable: {e.strerror or e}"
        if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
            return "not a KV block file"
        (hlen,) = struct.unpack_from("<I", data, len(MAGIC))
        body = len(MAGIC) + 4 + hlen
        try:
            header = json.loads(data[len(MAGIC) + 4 : body])
        except ValueError:
            return "corrupt header"
        payload = data[body:]
        if len(payload) != header.get("nbytes"):
            return f"truncated: {len(payload)} of {header.get('nbytes')} payload bytes"
        want = self._header(block_hash, len(payload), hashlib.blake2b(payload).hexdigest())
        if header != want:
            bad = sorted(k for k in want if header.get(k) != want[k])
            return f"mismatch in {', '.join(bad)}"
        key = self.kv_caches[0][0]
        blocks = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(key.dtype)
        blocks = blocks.view(len(self.kv_caches), 2, *key.shape[1:])
        for layer, (k, v) in enumerate(self.kv_caches):
            k[block_id].copy_(blocks[layer, 0])
            v[block_id].copy_(blocks[layer, 1])
        return None

    def save_kv(self, metadata: KVConnectorMetadata) -> None:
        """Write each block in ``metadata.saves`` that is not on disk yet (tmp file + rename:
        readers see the whole file or none)."""
        import torch

        for t in metadata.saves:  # type: ignore[attr-defined]
            for block_id, block_hash in zip(t.block_ids, t.block_hashes, strict=True):
                path = block_file(self.root, block_hash, self.rank)
                if path.exists():
                    continue
                blocks = torch.stack([torch.stack((k[block_id], v[block_id]))
                                      for k, v in self.kv_caches])
                payload = blocks.cpu().contiguous().view(torch.uint8).numpy().tobytes()
                header = json.dumps(self._header(block_hash, len(payload),
                                                 hashlib.blake2b(payload).hexdigest())).encode()
                tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
                tmp.write_bytes(MAGIC + struct.pack("<I", len(header)) + header + payload)
                os.replace(tmp, path)

    def get_failed_loads(self) -> set[str]:
        failed, self._failed = self._failed, set()
        return failed
