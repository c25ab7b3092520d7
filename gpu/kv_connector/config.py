"""``--kv-transfer-config`` (JSON, vLLM's keys) → ``KVTransferConfig``, with 1-line errors.

vLLM's ``KVTransferConfig`` (``vllm/config/kv_transfer.py``) has more keys than a connector
here reads; those (``kv_buffer_device``, ``kv_ip``, ...) are accepted and ignored, so a vLLM
command line still starts. ``kv_hold_timeout_s`` is ours: vLLM sets that timeout with the
``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` environment variable instead.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pagedserve.gpu.kv_connector.base import KVRole, KVTransferConfig, LoadFailurePolicy
from pagedserve.gpu.kv_connector.registry import connector_entry

FLAG = "--kv-transfer-config"
# vLLM's keys that no connector here reads.
IGNORED_VLLM_KEYS = frozenset({
    "kv_buffer_device", "kv_buffer_size", "kv_rank", "kv_parallel_size", "kv_ip", "kv_port",
    "kv_connector_module_path", "enable_permute_local_kv",
})


def _choice(raw: dict[str, Any], key: str, enum_type: type, default: Any) -> Any:
    value = raw.get(key, default.value)
    try:
        return enum_type(value)
    except ValueError:
        choices = ", ".join(repr(e.value) for e in enum_type)
        raise ValueError(f"{FLAG}: {key} {value!r} is not one of {choices}") from None


def parse_kv_transfer_config(text: str) -> KVTransferConfig:
    """Parse the flag's JSON. Raises ``ValueError`` with what is wrong (not JSON, not an
    object, an unknown key or connector, a bad role / policy / timeout)."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{FLAG} is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{FLAG} must be a JSON object")
    known = set(KVTransferConfig.__slots__)
    unknown = sorted(set(raw) - known - IGNORED_VLLM_KEYS)
    if unknown:
        raise ValueError(f"{FLAG}: unknown keys {unknown}; known: {sorted(known)}")
    name = raw.get("kv_connector")
    if not isinstance(name, str):
        raise ValueError(f'{FLAG}: "kv_connector" (a connector name) is required')
    connector_entry(name)  # an unknown name is a usage error now, not at start-up
    extra = raw.get("kv_connector_extra_config", {})
    if not isinstance(extra, dict):
        raise ValueError(f"{FLAG}: kv_connector_extra_config must be a JSON object")
    timeout = raw.get("kv_hold_timeout_s", 120.0)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ValueError(f"{FLAG}: kv_hold_timeout_s must be a number of seconds > 0")
    engine_id = raw.get("engine_id") or uuid.uuid4().hex
    return KVTransferConfig(
        kv_connector=name,
        kv_role=_choice(raw, "kv_role", KVRole, KVRole.BOTH),
        kv_connector_extra_config=extra,
        kv_load_failure_policy=_choice(raw, "kv_load_failure_policy", LoadFailurePolicy,
                                       LoadFailurePolicy.RECOMPUTE),
        kv_hold_timeout_s=float(timeout),
        engine_id=str(engine_id),
    )
