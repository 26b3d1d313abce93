"""How long a context a model's config lets pdserve answer exactly.

pdserve's attention reads every earlier token. A config with a sliding window (Mistral's
``sliding_window``; Qwen2's and Qwen3's with ``use_sliding_window``, on the layers from
``max_window_layers``; any config's ``layer_types`` naming ``sliding_attention``) has a layer
that reads only the last ``window`` tokens, which is the same arithmetic for every position
below the window and different past it. So the context is capped at the window: answers stay
exact, and a longer prompt is refused as too long for the model rather than answered wrongly.
Torch-free: the router reads it as the workers do.
"""

from __future__ import annotations

from typing import Any

DEFAULT_MAX_POSITIONS = 4096


def sliding_window(config: dict[str, Any]) -> int | None:
    """The window of the config's sliding-window layers; None where no layer has one."""
    window = config.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list):
        return window if "sliding_attention" in layer_types else None
    if "use_sliding_window" in config:  # Qwen2, Qwen3: off unless asked, from a layer on
        layers = config.get("num_hidden_layers") or 0
        first = config.get("max_window_layers")
        sliding = config["use_sliding_window"] and (first is None or first < layers)
        return window if sliding else None
    return window  # Mistral: every layer


def exact_context_length(config: dict[str, Any]) -> int:
    """Tokens of prompt and answer together that the model answers exactly: its position
    limit, and at most its sliding window."""
    positions = int(config.get("max_position_embeddings") or DEFAULT_MAX_POSITIONS)
    window = sliding_window(config)
    return positions if window is None else min(positions, window)
