"""The served LoRA adapters: ``--lora-modules``, ``/v1/models``' adapter cards, and vLLM's
``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (``vllm/entrypoints/openai/
serving_models.py``), the latter two only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` set.

A request picks an adapter by its ``model`` field; the registry turns the name into the
``LoRARequest`` that travels with the request to the runners, which load the weights on first
use. Every adapter is checked against the base model when it is registered (folder, files,
rank within ``--max-lora-rank``, target modules, shapes), so a bad one is refused here and
never reaches a step.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from pagedserve.gpu.lora.config import LoRAConfig
from pagedserve.gpu.lora.request import LoRARequest
from pagedserve.server.errors import OpenAIError

if TYPE_CHECKING:  # server/config.py imports this module: --help must not wait for torch
    from transformers import PretrainedConfig

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclass(slots=True, frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry: ``name=path`` or ``{"name", "path", "base_model_name"}``."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """``name=path`` or vLLM's JSON form. Raises ``ValueError`` with what is expected."""
    text = text.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules {text!r}: invalid JSON ({e})") from None
        if not isinstance(obj, dict) or not obj.get("name") or not obj.get("path"):
            raise ValueError(f"--lora-modules {text!r}: the JSON form needs \"name\" and "
                             "\"path\" (and may give \"base_model_name\")")
        return LoRAModulePath(str(obj["name"]), str(obj["path"]), obj.get("base_model_name"))
    name, eq, path = text.partition("=")
    if not eq or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: expected name=path or "
                         '\'{"name": ..., "path": ..., "base_model_name": ...}\'')
    return LoRAModulePath(name, path)


def runtime_updating_allowed() -> bool:
    return os.environ.get(RUNTIME_UPDATING_ENV, "").lower() in ("1", "true", "yes")


class LoRARegistry:
    """Adapter name -> ``LoRARequest``, each load under a new ``lora_int_id``.

    Args:
        lora: the engine's LoRA limits, ``None`` when ``--enable-lora`` is off.
        base_config: the base model's config (adapters are checked against it).
        base_name: the first served name (an adapter's default ``parent``).
        reserved: the served model names (an adapter may not take one).
    """

    def __init__(self, lora: LoRAConfig | None, base_config: PretrainedConfig,
                 base_name: str, reserved: tuple[str, ...]):
        self.lora, self.base_config = lora, base_config
        self.base_name, self.reserved = base_name, reserved
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def get(self, name: str | None) -> LoRARequest | None:
        return None if name is None else self.adapters.get(name)

    def load(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Check and register an adapter. Raises ``OpenAIError``: LoRA off, name taken
        (400), folder or files missing (404), rank, target modules or shapes wrong (400)."""
        if self.lora is None:
            raise OpenAIError("LoRA adapters are not enabled: start the server with "
                              "--enable-lora", param="lora_name")
        if name in self.adapters or name in self.reserved:
            raise OpenAIError(f"The LoRA adapter '{name}' has already been loaded: unload it "
                              "first or pick another name", param="lora_name")
        from pagedserve.gpu.lora.peft import LoRAAdapterError, check_adapter

        try:
            check_adapter(Path(path), self.base_config, self.lora.max_lora_rank)
        except LoRAAdapterError as e:
            raise OpenAIError(str(e), status=e.status, param="lora_path") from e
        lora = LoRARequest(name, next(self._ids), str(path), base_model_name or self.base_name)
        self.adapters[name] = lora
        return lora

    def unload(self, name: str) -> None:
        """Raises ``OpenAIError`` (404) for a name not loaded."""
        if self.adapters.pop(name, None) is None:
            raise OpenAIError(f"The LoRA adapter '{name}' cannot be found", status=404,
                              param="lora_name")

    def cards(self, created: int) -> list[dict]:
        """``/v1/models``' entries for the adapters (vLLM's: ``root`` the folder,
        ``parent`` the base model)."""
        return [{"id": a.lora_name, "object": "model", "created": created,
                 "owned_by": "pagedserve", "root": a.lora_path, "parent": a.base_model_name}
                for a in self.adapters.values()]


def _names(body: dict, need_path: bool) -> tuple[str, str | None]:
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not name or (need_path and (not isinstance(path, str)
                                                                or not path)):
        fields = "'lora_name' and 'lora_path'" if need_path else "'lora_name'"
        raise OpenAIError(f"{fields} must be given (strings)", param="lora_name")
    return name, path


async def _json(request: Request) -> dict:
    try:
        body = json.loads(await request.body() or b"{}")
    except json.JSONDecodeError as e:
        raise OpenAIError(f"the body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise OpenAIError("the body must be a JSON object")
    return body


def lora_routes(registry: LoRARegistry) -> list[Route]:
    """The runtime load/unload routes, when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is set."""
    if not runtime_updating_allowed():
        return []

    async def load(request: Request) -> PlainTextResponse:
        name, path = _names(await _json(request), need_path=True)
        registry.load(name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(request: Request) -> PlainTextResponse:
        name, _ = _names(await _json(request), need_path=False)
        registry.unload(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return [Route("/v1/load_lora_adapter", load, methods=["POST"]),
            Route("/v1/unload_lora_adapter", unload, methods=["POST"])]

