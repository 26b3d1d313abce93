"""Reasoning parsers by vLLM's names (``--reasoning-parser``), each module imported only when
chosen; what they do is in ``router/reasoning/base.py``."""

from __future__ import annotations

import importlib

from router.reasoning.base import ReasoningParser

# name -> "module:Class"
_PARSERS = {
    "deepseek_r1": "router.reasoning.deepseek_r1:DeepSeekR1ReasoningParser",
    "qwen3": "router.reasoning.qwen3:Qwen3ReasoningParser",
}


def reasoning_parser_names() -> list[str]:
    return sorted(_PARSERS)


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    if name not in _PARSERS:
        choices = ", ".join(reasoning_parser_names())
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {choices}")
    module, _, cls = _PARSERS[name].partition(":")
    return getattr(importlib.import_module(module), cls)
