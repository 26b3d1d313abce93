"""Where a JSON value, or each member of a JSON object, begins and ends in a text that may stop
short of it.

The tool-call parsers read a model's output as it grows: a call is reported once its name is
whole, and its arguments go out as their text arrives. What a prefix of the text shows here never
changes as the text grows (where a value starts, where a complete one ends, a member's key), so
what a stream has sent stays true. A complete value is checked with ``json.loads``; an open one
only for its structure (brackets, strings, literals), which is what a longer text could not mend.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from router.tool_parsers.base import ParsedCall


class NotJSON(ValueError):
    """The text cannot be, or begin, what was expected here, however it goes on."""


_SPACE = re.compile(r"[ \t\n\r]*")
# A run of a string's characters that need no second look: no quote, backslash or control
# character.
_STRING_PLAIN = re.compile(r'[^"\\\x00-\x1f]*')
_NUMBER_CHARS = re.compile(r"[0-9eE+\-.]*")
_LITERALS = ("true", "false", "null")


def skip_space(text: str, i: int) -> int:
    """The index of the first character at or after ``i`` that is not JSON whitespace."""
    match = _SPACE.match(text, i)
    assert match is not None  # the pattern matches the empty string
    return match.end()


def string_end(text: str, i: int) -> int | None:
    """Just past the JSON string whose opening quote is at ``i``; None when the text ends
    inside it. Raises ``NotJSON`` on a raw control character, which JSON strings cannot hold."""
    end = i + 1
    while True:
        plain = _STRING_PLAIN.match(text, end)
        assert plain is not None  # the pattern matches the empty string
        end = plain.end()
        if end >= len(text):
            return None  # the text ends inside the string
        if text[end] == '"':
            return end + 1
        if text[end] != "\\":
            raise NotJSON(f"a control character in a string at {end}")
        if end + 1 >= len(text):
            return None  # inside an escape
        end += 2


def value_end(text: str, start: int) -> int | None:
    """Just past the JSON value that begins at ``start`` (its first character, not whitespace);
    None when the text ends inside it. Raises ``NotJSON`` where no JSON value can begin or go on.
    """
    stack: list[str] = []  # the open "{" and "["
    # What may come next: a value, a value or "]", a key, a key or "}", a colon, or what follows
    # a value (a comma or a closing bracket).
    expect = "value"
    i = start
    while True:
        if expect == "after" and not stack:
            _check(text, start, i)
            return i
        i = skip_space(text, i)
        if i >= len(text):
            return None
        c = text[i]
        if expect in ("value", "value_or_close"):
            if c == "]" and expect == "value_or_close":
                stack.pop()
                i, expect = i + 1, "after"
            elif c == "{":
                stack.append(c)
                i, expect = i + 1, "key_or_close"
            elif c == "[":
                stack.append(c)
                i, expect = i + 1, "value_or_close"
            elif c == '"':
                end = string_end(text, i)
                if end is None:
                    return None
                i, expect = end, "after"
            elif c == "-" or c.isdigit():
                number = _NUMBER_CHARS.match(text, i)
                assert number is not None
                if number.end() >= len(text):
                    return None  # a number may go on with the next character
                i, expect = number.end(), "after"
            elif c in "tfn":
                literal = next(word for word in _LITERALS if word[0] == c)
                piece = text[i : i + len(literal)]
                if not literal.startswith(piece):
                    raise NotJSON(f"not a JSON literal at {i}")
                if len(piece) < len(literal):
                    return None
                i, expect = i + len(literal), "after"
            else:
                raise NotJSON(f"no JSON value can begin with {c!r} at {i}")
        elif expect in ("key", "key_or_close"):
            if c == "}" and expect == "key_or_close":
                stack.pop()
                i, expect = i + 1, "after"
            elif c == '"':
                end = string_end(text, i)
                if end is None:
                    return None
                i, expect = end, "colon"
            else:
                raise NotJSON(f"an object key must be a string, got {c!r} at {i}")
        elif expect == "colon":
            if c != ":":
                raise NotJSON(f"expected ':' at {i}, got {c!r}")
            i, expect = i + 1, "value"
        elif c == ",":
            i, expect = i + 1, "key" if stack[-1] == "{" else "value"
        elif (c, stack[-1]) in (("}", "{"), ("]", "[")):
            stack.pop()
            i += 1
        else:
            raise NotJSON(f"expected ',' or a closing bracket at {i}, got {c!r}")


@dataclass(slots=True)
class Member:
    """One member of a JSON object: its key, and where its value starts and ends in the text."""

    key: str
    value_start: int
    value_end: int | None  # None: the text ends inside the value

    def value_text(self, text: str) -> str:
        """The value's text, as far as ``text`` goes."""
        return text[self.value_start : self.value_end]

    def value(self, text: str) -> object:
        """The complete value, decoded."""
        assert self.value_end is not None
        return _decoded(text[self.value_start : self.value_end])


@dataclass(slots=True)
class ObjectScan:
    """What a text shows of a JSON object: the members whose values have begun, and where the
    object ends (None while it is open)."""

    members: list[Member]
    end: int | None

    def get(self, *keys: str) -> Member | None:
        """The first member named by one of ``keys``, in the order the keys are given."""
        for key in keys:
            for member in self.members:
                if member.key == key:
                    return member
        return None


def scan_object(text: str, start: int) -> ObjectScan:
    """The JSON object whose ``{`` is at ``start``, as far as the text goes. Raises ``NotJSON``
    where the text cannot be one."""
    if not text.startswith("{", start):
        raise NotJSON(f"expected '{{' at {start}")
    members: list[Member] = []
    i, expect = start + 1, "key_or_close"
    while True:
        i = skip_space(text, i)
        if i >= len(text):
            return ObjectScan(members, None)
        c = text[i]
        if expect in ("key", "key_or_close"):
            if c == "}" and expect == "key_or_close":
                return ObjectScan(members, _closed(text, start, i))
            if c != '"':
                raise NotJSON(f"an object key must be a string, got {c!r} at {i}")
            end = string_end(text, i)
            if end is None:
                return ObjectScan(members, None)
            key = _decoded(text[i:end])
            assert isinstance(key, str)  # a JSON string decodes to one
            i = skip_space(text, end)
            if i >= len(text):
                return ObjectScan(members, None)
            if text[i] != ":":
                raise NotJSON(f"expected ':' at {i}, got {text[i]!r}")
            i = skip_space(text, i + 1)
            if i >= len(text):
                return ObjectScan(members, None)
            member = Member(key, i, value_end(text, i))
            members.append(member)
            if member.value_end is None:
                return ObjectScan(members, None)
            i, expect = member.value_end, "comma_or_close"
        elif c == ",":
            i, expect = i + 1, "key"
        elif c == "}":
            return ObjectScan(members, _closed(text, start, i))
        else:
            raise NotJSON(f"expected ',' or '}}' at {i}, got {c!r}")


def _closed(text: str, start: int, brace: int) -> int:
    _check(text, start, brace + 1)
    return brace + 1


def _check(text: str, start: int, end: int) -> None:
    """A complete value must decode: the scan checks structure, ``json.loads`` the rest
    (escapes, numbers)."""
    _decoded(text[start:end])


def _decoded(piece: str) -> object:
    try:
        return json.loads(piece)
    except ValueError as exc:
        raise NotJSON(str(exc)) from None


def call_in(text: str, scan: ObjectScan, argument_keys: tuple[str, ...]) -> ParsedCall | None:
    """The tool call an object ``{"name": ..., <argument key>: {...}}`` shows: None until its
    name is whole and its arguments have begun. Raises ``NotJSON`` where the object cannot be a
    call: a name that is not a string, two argument keys, or a closed object without both."""
    name = scan.get("name")
    found = [member for member in scan.members if member.key in argument_keys]
    if len(found) > 1:
        raise NotJSON(f"a call with both {found[0].key!r} and {found[1].key!r}")
    if scan.end is not None and (name is None or not found):
        raise NotJSON(f"a call needs a name and {' or '.join(argument_keys)}")
    if name is None or name.value_end is None:
        return None
    function = name.value(text)
    if not isinstance(function, str):
        raise NotJSON(f"a call's name must be a string, got {function!r:.40}")
    if not found:
        return None
    return ParsedCall(function, found[0].value_text(text))


def next_call(
    text: str, i: int, argument_keys: tuple[str, ...], final: bool
) -> tuple[ParsedCall | None, int | None]:
    """The call in the JSON object at ``i`` (``call_in``) and the index after it; None for the
    index where the object is cut short: in a growing answer, the call so far (None until its
    name is whole); in a whole one, ``NotJSON``."""
    scan = scan_object(text, i)
    call = call_in(text, scan, argument_keys)
    if scan.end is None:
        if final:
            raise NotJSON("a call cut short")
        return call, None
    assert call is not None  # a closed object is a call, or call_in raised
    return call, scan.end
