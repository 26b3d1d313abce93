"""vLLM's ``mistral`` parser: calls after ``[TOOL_CALLS]``, in either of Mistral's formats.

- Before tokenizer v11: a JSON list (or one object) of ``{"name": ..., "arguments": {...}}``.
- From v11: ``name[ARGS]{...}``, each further call after another ``[TOOL_CALLS]`` (the
  ``[ARGS]`` marker may be missing: ``name{...}``).

The content is the text before ``[TOOL_CALLS]``; what follows the calls is dropped, as vLLM drops
it. A call that does not parse makes the whole answer content. Call ids are nine letters and
digits, as Mistral's templates require.
"""

from __future__ import annotations

import re
import secrets
import string

from router.tool_parsers.base import Parsed, ParsedCall, ToolParser, partial_marker
from router.tool_parsers.json_text import NotJSON, next_call, skip_space, value_end

BOT = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")
_ID_ALPHABET = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    keeps_special_tokens = True

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(BOT)
        if first == -1:
            return Parsed(text if final else text[: len(text) - partial_marker(text, BOT)])
        try:
            return Parsed(text[:first], self._calls(text, first + len(BOT), final))
        except NotJSON:
            return Parsed(text)

    def new_call_id(self) -> str:
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))

    def _calls(self, text: str, i: int, final: bool) -> list[ParsedCall]:
        i = skip_space(text, i)
        if i >= len(text):
            if final:
                raise NotJSON(f"{BOT} with no call after it")
            return []
        if text[i] == "[":
            return self._json_list(text, i + 1, final)
        if text[i] == "{":
            return self._json_objects(text, i, final, in_list=False)
        return self._named_calls(text, i, final)

    def _json_list(self, text: str, i: int, final: bool) -> list[ParsedCall]:
        i = skip_space(text, i)
        if i >= len(text):
            if final:
                raise NotJSON("a list of calls cut short")
            return []
        return self._json_objects(text, i, final, in_list=True)

    def _json_objects(self, text: str, i: int, final: bool, in_list: bool) -> list[ParsedCall]:
        calls: list[ParsedCall] = []
        while True:
            call, end = next_call(text, i, ("arguments",), final)
            if end is None or call is None:
                return calls + ([call] if call else [])
            calls.append(call)
            if not in_list:
                return calls
            i = skip_space(text, end)
            if i >= len(text):
                if final:
                    raise NotJSON("a list of calls cut short")
                return calls
            if text[i] == "]":
                return calls
            if text[i] != ",":
                raise NotJSON(f"expected ',' or ']' after a call, got {text[i]!r}")
            i = skip_space(text, i + 1)
            if i >= len(text):
                if final:
                    raise NotJSON("a list of calls cut short")
                return calls

    def _named_calls(self, text: str, i: int, final: bool) -> list[ParsedCall]:
        calls: list[ParsedCall] = []
        while True:
            match = _NAME.match(text, i)
            assert match is not None  # the pattern matches the empty string
            name_end = match.end()
            if name_end >= len(text) or (not final and ARGS.startswith(text[name_end:])):
                if final:
                    raise NotJSON("a call cut short")
                return calls  # the name may go on
            if name_end == i:
                raise NotJSON(f"a call's name must come after {BOT}")
            name = text[i:name_end]
            if text.startswith(ARGS, name_end):
                start = skip_space(text, name_end + len(ARGS))
            else:
                start = name_end
            if start >= len(text):
                if final:
                    raise NotJSON("a call without arguments")
                return calls
            if text[start] != "{":
                raise NotJSON(f"a call's arguments must be an object, got {text[start]!r}")
            end = value_end(text, start)
            calls.append(ParsedCall(name, text[start:end]))
            if end is None:
                if final:
                    raise NotJSON("a call cut short")
                return calls
            after = skip_space(text, end)
            if not text.startswith(BOT, after):
                return calls  # the end, or text after the calls
            i = skip_space(text, after + len(BOT))
