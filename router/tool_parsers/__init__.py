"""Tool-call parsers by vLLM's names (``--tool-call-parser``), each module imported only when
chosen. The contract is in ``router/tool_parsers/base.py``; the forced calls' parsers (``required``
and a named function, which need no flag) are in ``router/tool_parsers/forced.py``."""

from __future__ import annotations

import importlib

from router.tool_parsers.base import ToolParser

# name -> "module:Class"
_PARSERS = {
    "hermes": "router.tool_parsers.hermes:HermesToolParser",
    "llama3_json": "router.tool_parsers.llama3_json:Llama3JsonToolParser",
    "llama4_json": "router.tool_parsers.llama3_json:Llama3JsonToolParser",
    "mistral": "router.tool_parsers.mistral:MistralToolParser",
    "pythonic": "router.tool_parsers.pythonic:PythonicToolParser",
}


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)


def tool_parser_class(name: str) -> type[ToolParser]:
    if name not in _PARSERS:
        raise ValueError(
            f"unknown tool-call parser {name!r}; choose one of {', '.join(tool_parser_names())}"
        )
    module, _, cls = _PARSERS[name].partition(":")
    return getattr(importlib.import_module(module), cls)
