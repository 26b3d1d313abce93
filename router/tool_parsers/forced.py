"""The answers of a forced tool call, which a JSON schema constrains (router/tool_request.py):
``tool_choice: "required"`` gives a JSON list of ``{"name": ..., "parameters": {...}}``, a named
function gives that function's arguments alone. Neither has content; vLLM reads them so.
"""

from __future__ import annotations

import json

from router.tool_parsers.base import Parsed, ParsedCall, ToolParser
from router.tool_parsers.json_text import NotJSON, next_call, skip_space


class RequiredCallsParser(ToolParser):
    """``tool_choice: "required"``: the answer is the list of calls. One that does not parse
    (cut short by ``max_tokens`` or a stop string) gives no calls, as in vLLM."""

    def parse(self, text: str, final: bool) -> Parsed:
        try:
            return Parsed("", _listed_calls(text, final))
        except NotJSON:
            return Parsed("")


class NamedCallParser(ToolParser):
    """A named function: the answer is its arguments, taken as they are (as vLLM does), once
    anything but whitespace has come. A whole answer whose arguments are not a complete JSON
    value (cut short) gives no call, as a required one does, so that a client never reads
    half an object as the call's arguments (as OpenAI answers, and vLLM's own tests expect)."""

    def __init__(self, function: str) -> None:
        self.function = function

    def parse(self, text: str, final: bool) -> Parsed:
        start = skip_space(text, 0)
        if start >= len(text):
            return Parsed("")
        arguments = text[start:]
        if final and not _is_json(arguments):
            return Parsed("")
        return Parsed("", [ParsedCall(self.function, arguments)])


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _listed_calls(text: str, final: bool) -> list[ParsedCall]:
    calls: list[ParsedCall] = []
    i = skip_space(text, 0)
    if i >= len(text):
        return _unfinished(calls, final)
    if text[i] != "[":
        raise NotJSON(f"the calls must be a JSON list, got {text[i]!r}")
    i = skip_space(text, i + 1)
    while i < len(text):
        call, end = next_call(text, i, ("parameters",), final)
        if end is None or call is None:
            return calls + ([call] if call else [])
        calls.append(call)
        i = skip_space(text, end)
        if i >= len(text):
            break
        if text[i] == "]":
            if skip_space(text, i + 1) < len(text):
                raise NotJSON("text after the list of calls")
            return calls
        if text[i] != ",":
            raise NotJSON(f"expected ',' or ']' after a call, got {text[i]!r}")
        i = skip_space(text, i + 1)
    return _unfinished(calls, final)


def _unfinished(calls: list[ParsedCall], final: bool) -> list[ParsedCall]:
    if final:
        raise NotJSON("the list of calls is cut short")
    return calls
