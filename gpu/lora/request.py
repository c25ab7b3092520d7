"""Which adapter a request runs with: vLLM's ``LoRARequest`` (``vllm/lora/request.py``).

It travels with the request from the HTTP layer to every rank's model runner (inside each
``ScheduledRequest``), so a runner can load an adapter it has not seen, or has evicted, from
``lora_path`` on its own: no separate "load" message has to reach the workers first.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class LoRARequest:
    """An adapter by name, id and folder.

    Attributes:
        lora_name: the name requests pick it by (their ``model`` field).
        lora_int_id: unique per load (>= 1; a reload under the same name gets a new one), so
            the prefix cache and the runners' caches never mix two loads.
        lora_path: folder with PEFT's ``adapter_config.json`` and ``adapter_model.safetensors``.
        base_model_name: the served model it is an adapter of (``/v1/models``' ``parent``).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None
