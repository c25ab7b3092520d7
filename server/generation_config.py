"""Request defaults from a generation config: vLLM's ``--generation-config`` and
``--override-generation-config`` (``vllm/config/model.py``, ``get_diff_sampling_param``).

A model's ``generation_config.json`` carries its authors' sampling defaults; vLLM applies
``temperature``, ``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty`` to requests that omit
them, and ``max_new_tokens`` as the default ``max_tokens``. Where it comes from:

- ``auto``: the model's own file (none is an empty config), merged with the override;
- ``vllm``: no file, only the override;
- a folder: that folder's ``generation_config.json``, merged with the override.

``max_new_tokens`` caps every request's ``max_tokens`` (not only the default) when it comes from
``--override-generation-config`` or from a folder given to ``--generation-config``, as in vLLM;
from the model's own file (``auto``) it is only the default.

The embedded SmolLM2's GGUF has no generation config, so a chat without ``max_tokens`` would run
to ``--max-model-len`` (8,192 tokens, minutes on a CPU, mostly repetition): under ``auto`` it gets
``EMBEDDED_DEFAULTS`` (a default, not a cap), which the override replaces.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

# The generation-config keys vLLM turns into request defaults (max_new_tokens: max_tokens).
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
MAX_NEW_TOKENS = "max_new_tokens"
# Long enough for any answer SmolLM2-135M gives before it starts repeating itself (7.8 s for
# all 512 on two shared CPU cores); a request's own max_tokens goes up to the context.
EMBEDDED_DEFAULTS: dict[str, Any] = {MAX_NEW_TOKENS: 512}


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """What a request gets for the fields it omits: ``sampling`` (field → value), ``max_tokens``
    (the default ``max_tokens``), ``max_tokens_cap`` (the most any request gets)."""

    sampling: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None
    max_tokens_cap: int | None = None

    def max_tokens_for(self, asked: int | None, room: int) -> int:
        """``max_tokens`` of a request that asked for ``asked`` (``None``: not given), with
        ``room`` tokens left in the context: the smallest of what applies (vLLM's
        ``get_max_tokens``)."""
        default = asked if asked is not None else self.max_tokens
        return min(v for v in (room, default, self.max_tokens_cap) if v is not None)


def parse_override(text: str) -> dict[str, Any]:
    """``--override-generation-config``'s JSON object.

    Raises:
        ValueError: not JSON, or not an object.
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError('a JSON object is needed, e.g. \'{"max_new_tokens": 512}\'')
    return value


def _read(folder: Path, required: bool) -> dict[str, Any]:
    path = folder / "generation_config.json"
    if not path.is_file():
        if required:
            raise ValueError(f"--generation-config {folder}: no generation_config.json there")
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


def load_generation_defaults(setting: str, override: dict[str, Any] | None, model_dir: Path,
                             embedded: bool) -> GenerationDefaults:
    """The request defaults ``--generation-config setting`` and the override give for the
    model in ``model_dir`` (``embedded``: the embedded SmolLM2).

    Raises:
        ValueError: the folder has no ``generation_config.json``, or a value is not one a
            request could send (the message names it).
    """
    override = override or {}
    if setting == "vllm":
        config: dict[str, Any] = {}
    elif setting == "auto":
        config = {**(EMBEDDED_DEFAULTS if embedded else {}), **_read(model_dir, False)}
    else:
        config = _read(Path(setting).expanduser(), True)
    config = {**config, **override}
    cap = override.get(MAX_NEW_TOKENS) if setting in ("auto", "vllm") else config.get(
        MAX_NEW_TOKENS)
    defaults = GenerationDefaults(
        sampling={k: config[k] for k in SAMPLING_KEYS if config.get(k) is not None},
        max_tokens=config.get(MAX_NEW_TOKENS), max_tokens_cap=cap)
    _check(defaults)
    return defaults


def _check(defaults: GenerationDefaults) -> None:
    """Each default must be a value a request may send (checked by the request's own model)."""
    from pagedserve.server.openai.protocol import CompletionRequest

    bodies = [defaults.sampling] + [{"max_tokens": v} for v in (
        defaults.max_tokens, defaults.max_tokens_cap) if v is not None]
    for body in bodies:
        try:
            CompletionRequest.model_validate({**body, "prompt": "x"})
        except ValidationError as e:
            err = e.errors()[0]
            name = MAX_NEW_TOKENS if err["loc"][0] == "max_tokens" else err["loc"][0]
            raise ValueError(f"generation config: {name}={err.get('input')!r}: "
                             f"{err['msg']}") from None
