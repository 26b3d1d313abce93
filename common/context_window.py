"""What a model's config says about its context: how many positions it has, and which of its
layers attend through a sliding window, read as ``transformers`` reads them.

A sliding-window layer lets the query at position ``p`` attend to positions ``j`` with
``p - window < j <= p``: itself and the ``window - 1`` before it (``transformers``'
``sliding_window_overlay``). Which layers slide depends on the family:

- Mistral: every layer, whenever ``sliding_window`` is set (its model ignores ``layer_types``);
- Qwen2 and Qwen3: none unless ``use_sliding_window``; then the layers that ``layer_types``
  names ``sliding_attention``, or, without that list, those from ``max_window_layers`` on;
- Llama: none (its attention reads no window);
- any other config: the layers ``layer_types`` names, or every layer.

``sliding_window`` null or 0 means no window. Torch-free: the router reads it as the workers do.
"""

from __future__ import annotations

from typing import Any

DEFAULT_MAX_POSITIONS = 4096
SLIDING_ATTENTION = "sliding_attention"
FULL_ATTENTION = "full_attention"
# Qwen2Config's and Qwen3Config's default, where a config leaves the field out.
QWEN_MAX_WINDOW_LAYERS = 28


def max_positions(config: dict[str, Any]) -> int:
    """The positions the model has: the longest context, prompt and answer together."""
    return int(config.get("max_position_embeddings") or DEFAULT_MAX_POSITIONS)


def layer_windows(config: dict[str, Any]) -> tuple[int | None, ...]:
    """Each layer's sliding window, in layer order; None for a layer that attends to every
    earlier position. Raises ``ValueError`` for a window or layer list that makes no sense."""
    num_layers = config.get("num_hidden_layers")
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
        raise ValueError(f"num_hidden_layers must be a positive integer, got {num_layers!r}")
    window = _window(config)
    model_type = config.get("model_type")
    if window is None or model_type == "llama":
        return (None,) * num_layers
    if model_type == "mistral":
        return (window,) * num_layers
    layer_types = config.get("layer_types")
    if model_type in ("qwen2", "qwen3") or "use_sliding_window" in config:
        if not config.get("use_sliding_window", False):
            return (None,) * num_layers
        if layer_types is None:
            first = config.get("max_window_layers", QWEN_MAX_WINDOW_LAYERS)
            if not isinstance(first, int) or isinstance(first, bool) or first < 0:
                raise ValueError(f"max_window_layers must be an integer >= 0, got {first!r}")
            layer_types = [
                SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(num_layers)
            ]
    elif layer_types is None:
        return (window,) * num_layers
    _check_layer_types(layer_types, num_layers)
    return tuple(window if kind == SLIDING_ATTENTION else None for kind in layer_types)


def all_layers_slide(windows: tuple[int | None, ...]) -> bool:
    """Whether every layer has a window: only then may a sequence's oldest pages go."""
    return bool(windows) and all(window is not None for window in windows)


def _window(config: dict[str, Any]) -> int | None:
    window = config.get("sliding_window")
    if window is None or window == 0:
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise ValueError(f"sliding_window must be a positive integer or null, got {window!r}")
    return window


def _check_layer_types(layer_types: Any, num_layers: int) -> None:
    kinds = (SLIDING_ATTENTION, FULL_ATTENTION)
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise ValueError(f"layer_types must list each of the {num_layers} layers")
    unknown = sorted({str(kind) for kind in layer_types if kind not in kinds})
    if unknown:
        raise ValueError(f"layer_types may hold {' and '.join(kinds)} only, not {unknown}")
