"""vLLM's ``llama3_json`` parser (``llama4_json`` too): an answer that is one or more calls
``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), separated by ``;``, optionally after
``<|python_tag|>``, as Llama 3.1+ writes them with its JSON tool template.

An answer that begins with anything else is content. Text after the last complete call is
dropped, as vLLM drops it; an object that is no call makes the whole answer content.
"""

from __future__ import annotations

from router.tool_parsers.base import Parsed, ParsedCall, ToolParser
from router.tool_parsers.json_text import NotJSON, next_call, skip_space

PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("parameters", "arguments")


class Llama3JsonToolParser(ToolParser):
    keeps_special_tokens = True

    def parse(self, text: str, final: bool) -> Parsed:
        i = skip_space(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_space(text, i + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[i:]):
            return Parsed("")  # only whitespace so far, or the start of the tag
        if i >= len(text):
            return Parsed(text if final else "")
        if text[i] != "{":
            return Parsed(text)
        try:
            return Parsed("", self._calls(text, i, final))
        except NotJSON:
            return Parsed(text)

    def _calls(self, text: str, i: int, final: bool) -> list[ParsedCall]:
        calls: list[ParsedCall] = []
        while True:
            call, end = next_call(text, i, ARGUMENT_KEYS, final)
            if end is None or call is None:
                return calls + ([call] if call else [])
            calls.append(call)
            after = skip_space(text, end)
            if after >= len(text) or text[after] != ";":
                return calls  # the end, or text after the calls
            i = skip_space(text, after + 1)
            if i >= len(text) or text[i] != "{":
                return calls
