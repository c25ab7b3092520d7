"""``--speculative-config``: the settings of speculative decoding (n-gram or draft model) and
their parser.

Apart from ``spec_decode`` (which needs torch) so that building ``pagedserve serve``'s flags
imports no tensor library: ``serve --help`` answers at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(slots=True)
class SpeculativeConfig:
    """``--speculative-config``, vLLM's JSON keys.

    Attributes:
        method: ``ngram`` or ``draft_model``.
        model: the draft model (``draft_model``): a folder, ``.gguf`` file or hub id whose
            tokenizer is the target's.
        num_speculative_tokens: drafts per step and request at most (k).
        prompt_lookup_max, prompt_lookup_min: the longest and shortest n-gram matched.
        disable_by_batch_size: no drafts while more requests than this run (a large batch is
            compute-bound already, and the drafts would only add work); ``None`` = never.
    """

    method: str = "ngram"
    model: str | None = None
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int | None = None


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """Parse ``--speculative-config``. Raises ``ValueError`` with what is wrong."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError("--speculative-config must be a JSON object")
    known = set(SpeculativeConfig.__slots__)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"--speculative-config: unknown keys {unknown}; known: {sorted(known)}")
    config = SpeculativeConfig(**raw)
    if config.method not in ("ngram", "draft_model"):
        raise ValueError(f"--speculative-config: method {config.method!r} is not supported "
                         "(choose 'ngram' or 'draft_model')")
    if (config.method == "draft_model") != (config.model is not None):
        raise ValueError("--speculative-config: 'model' (the draft model) goes with method "
                         "'draft_model', and only with it")
    ints = ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
    if not all(isinstance(getattr(config, k), int) and getattr(config, k) >= 1 for k in ints):
        raise ValueError(f"--speculative-config: {', '.join(ints)} must be integers >= 1")
    if config.prompt_lookup_min > config.prompt_lookup_max:
        raise ValueError("--speculative-config: prompt_lookup_min > prompt_lookup_max")
    limit = config.disable_by_batch_size
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError("--speculative-config: disable_by_batch_size must be an integer >= 1")
    return config
