"""vLLM's ``hermes`` parser: calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(Hermes 2 Pro and 3, Qwen2.5, Qwen3).

The content is the text before the first ``<tool_call>``; text between and after calls is dropped,
as vLLM drops it. The last call may lack its closing tag. A call that does not parse makes the
whole answer content.
"""

from __future__ import annotations

from router.tool_parsers.base import Parsed, ParsedCall, ToolParser, partial_marker
from router.tool_parsers.json_text import NotJSON, next_call, skip_space

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(ToolParser):
    keeps_special_tokens = True

    def __init__(self) -> None:
        # Calls whose closing tag has come are not read again; reading goes on from there.
        self._settled: list[ParsedCall] = []
        self._search_from = 0

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(START)
        if first == -1:
            return Parsed(text if final else text[: len(text) - partial_marker(text, START)])
        try:
            calls = self._calls(text, final)
        except NotJSON:
            return Parsed(text)
        return Parsed(text[:first], calls)

    def _calls(self, text: str, final: bool) -> list[ParsedCall]:
        calls = list(self._settled)
        start = text.find(START, self._search_from)
        while start != -1:
            i = skip_space(text, start + len(START))
            if i >= len(text):
                if final:
                    raise NotJSON("a <tool_call> tag with no call in it")
                return calls
            call, end = next_call(text, i, ("arguments",), final)
            if end is None or call is None:
                return calls + ([call] if call else [])
            after = skip_space(text, end)
            if after >= len(text) or (not final and END.startswith(text[after:])):
                # The closing tag may still come; a whole answer may end without it.
                return [*calls, call]
            if not text.startswith(END, after):
                raise NotJSON("text after a call, inside its tags")
            calls.append(call)
            self._settled = list(calls)
            self._search_from = after + len(END)
            start = text.find(START, self._search_from)
        return calls
