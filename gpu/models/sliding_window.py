"""Which layers attend over a sliding window, read from a transformers config, as
transformers' own modeling code decides it (the oracle):

- a config with ``layer_types`` (Qwen2/Qwen3 with ``use_sliding_window`` and
  ``max_window_layers``, Gemma 2/3): ``config.sliding_window`` on its ``"sliding_attention"``
  layers, the others global;
- otherwise ``config.sliding_window`` on every layer (Mistral v0.1's 4096, Phi-3's 2047),
  unless ``use_sliding_window`` is False.

A window ``W`` lets a query at position ``i`` see keys ``i - W < j <= i``
(``transformers.masking_utils.sliding_window_overlay``).
"""

from __future__ import annotations

from transformers import PretrainedConfig


def config_window(config: PretrainedConfig) -> int | None:
    """``config.sliding_window`` when it is a positive int and not switched off by
    ``use_sliding_window: false``, else None."""
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return window


def layer_sliding_windows(config: PretrainedConfig) -> list[int | None]:
    """The window of each of the ``num_hidden_layers`` layers in tokens, None for a global one.

    Raises:
        ValueError: ``layer_types`` does not have one entry per layer.
    """
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    n = config.num_hidden_layers
    if layer_types is not None:
        if len(layer_types) != n:
            raise ValueError(f"config.layer_types has {len(layer_types)} entries for {n} layers")
        ok = isinstance(window, int) and window > 0
        return [window if ok and t == "sliding_attention" else None for t in layer_types]
    return [config_window(config)] * n


def kv_sliding_window(config: PretrainedConfig) -> int | None:
    """The window past which no layer reads a block, when every layer has one (the largest);
    None when any layer is global: then every block stays (the windows only mask)."""
    windows = layer_sliding_windows(config)
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)
