"""vLLM's ``pythonic`` parser: an answer that is a Python list of calls with keyword arguments,
``[get_weather(city="Paris", days=3), search(q='x')]`` (Llama 3.2, Llama 4, ToolACE).

Each argument is a Python literal (strings, numbers, ``True``/``False``/``None`` and JSON's
``true``/``false``/``null``, lists, tuples, sets, dicts, negative numbers); the arguments become
a JSON object, ``json.dumps`` of the keywords in order, as vLLM makes it. In a stream an argument
goes out once its value is complete. An answer that begins with anything but ``[`` is content; one
that is not wholly such a list (a positional argument, an expression, text after the ``]``) is
content too, as vLLM answers.
"""

from __future__ import annotations

import ast
import json
import re

from router.tool_parsers.base import Parsed, ParsedCall, ToolParser


class NotCalls(ValueError):
    """The text cannot be a list of calls, however it goes on."""


_SPACE = re.compile(r"\s*")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*", re.ASCII)
_KEYWORD = re.compile(r"[A-Za-z_]\w*", re.ASCII)
# A string literal's body after its opening quote(s), up to where its closing quote(s) must be:
# escapes skipped, and no line break in a one-quote string.
_STRING_BODY = {
    "'": re.compile(r"(?:[^'\\\n]|\\.)*", re.DOTALL),
    '"': re.compile(r'(?:[^"\\\n]|\\.)*', re.DOTALL),
    "'''": re.compile(r"(?:[^'\\]|\\.|'(?!''))*", re.DOTALL),
    '"""': re.compile(r'(?:[^"\\]|\\.|"(?!""))*', re.DOTALL),
}
_CLOSERS = {")": "(", "]": "[", "}": "{"}
_JSON_NAMES = {"true": True, "false": False, "null": None}


class PythonicToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> Parsed:
        i = _space(text, 0)
        if i >= len(text):
            return Parsed(text if final else "")
        if text[i] != "[":
            return Parsed(text)
        try:
            return Parsed("", _calls(text, i + 1, final))
        except NotCalls:
            return Parsed(text)


def _calls(text: str, i: int, final: bool) -> list[ParsedCall]:
    """The calls of the list whose ``[`` is just before ``i``."""
    calls: list[ParsedCall] = []
    while True:
        i = _space(text, i)
        name = _NAME.match(text, i)
        if name is None:
            if i < len(text):
                raise NotCalls(f"a call must begin with a name, got {text[i]!r}")
            return _unfinished(calls, final)
        if name.end() >= len(text):
            return _unfinished(calls, final)  # the name may go on
        if text[name.end()] != "(" or not _DOTTED.fullmatch(name.group()):
            raise NotCalls(f"not a call: {name.group()!r:.40}")
        call, after = _arguments(text, name.group(), name.end() + 1)
        calls.append(call)
        if after is None:
            return _unfinished(calls, final)
        i = _space(text, after)
        if i >= len(text):
            return _unfinished(calls, final)
        if text[i] == "]":
            if _space(text, i + 1) < len(text):
                raise NotCalls("text after the list of calls")
            return calls
        if text[i] != ",":
            raise NotCalls(f"expected ',' or ']' after a call, got {text[i]!r}")
        i += 1


def _arguments(text: str, name: str, i: int) -> tuple[ParsedCall, int | None]:
    """The call ``name(`` whose arguments begin at ``i``, and the index after its ``)`` (None
    while the text ends inside it). Its arguments' JSON holds each argument whose value is
    complete, and the closing brace once the call is."""
    members: list[str] = []
    keys: set[str] = set()
    while True:
        i = _space(text, i)
        if i >= len(text):
            break
        if text[i] == ")":
            return ParsedCall(name, "{" + ", ".join(members) + "}"), i + 1
        keyword = _KEYWORD.match(text, i)
        if keyword is None:
            raise NotCalls(f"{name}: arguments must be keyword arguments")
        equals = _space(text, keyword.end())
        if equals >= len(text):
            break
        if text[equals] != "=" or text.startswith("==", equals):
            raise NotCalls(f"{name}: arguments must be keyword arguments")
        start = _space(text, equals + 1)
        end = _value_end(text, start)
        if end is None:
            break
        key = keyword.group()
        if key in keys:
            raise NotCalls(f"{name}: argument {key!r} given twice")
        keys.add(key)
        value = _literal(text[start:end])
        members.append(f"{json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}")
        i = end + 1 if text[end] == "," else end
    return ParsedCall(name, "{" + ", ".join(members)), None


def _value_end(text: str, i: int) -> int | None:
    """The index of the ``,`` or ``)`` that ends the argument value beginning at ``i``; None when
    the text ends first."""
    open_brackets: list[str] = []
    while i < len(text):
        c = text[i]
        if c in "'\"":
            quote = text[i : i + 3] if text[i : i + 3] in ("'''", '"""') else c
            body = _STRING_BODY[quote].match(text, i + len(quote))
            assert body is not None  # the pattern matches the empty string
            end = body.end()
            if end >= len(text) or text[end:] == "\\" or quote.startswith(text[end:]):
                return None  # the text ends inside the string
            if not text.startswith(quote, end):
                raise NotCalls("a line break inside a string")
            i = end + len(quote)
            continue
        if c in "([{":
            open_brackets.append(c)
        elif c in _CLOSERS:
            if not open_brackets:
                if c == ")":
                    return i
                raise NotCalls(f"an unmatched {c!r}")
            if open_brackets.pop() != _CLOSERS[c]:
                raise NotCalls(f"an unmatched {c!r}")
        elif c == "," and not open_brackets:
            return i
        i += 1
    return None


def _literal(source: str) -> object:
    """An argument's value: a Python literal (or JSON's true/false/null) as a JSON value."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
    except SyntaxError:
        raise NotCalls(f"not a Python literal: {source!r:.40}") from None
    value = _value(node)
    try:
        json.dumps(value, allow_nan=False)
    except (ValueError, TypeError):  # inf or nan; a bytes key
        raise NotCalls(f"a value JSON cannot hold: {source!r:.40}") from None
    return value


def _value(node: ast.expr) -> object:
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, str | int | float):
            return node.value
    elif isinstance(node, ast.Dict):
        if all(isinstance(key, ast.Constant) for key in node.keys):
            return {
                key.value: _value(value)  # type: ignore[union-attr]  # checked: constants
                for key, value in zip(node.keys, node.values, strict=True)
            }
    elif isinstance(node, ast.List | ast.Tuple | ast.Set):
        return [_value(element) for element in node.elts]
    elif isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = _value(node.operand)
        if isinstance(operand, int | float) and not isinstance(operand, bool):
            return -operand if isinstance(node.op, ast.USub) else operand
    elif isinstance(node, ast.JoinedStr) and all(
        isinstance(part, ast.Constant) for part in node.values
    ):
        return "".join(str(part.value) for part in node.values)  # type: ignore[attr-defined]
    raise NotCalls(f"not a literal: {ast.dump(node):.60}")


def _unfinished(calls: list[ParsedCall], final: bool) -> list[ParsedCall]:
    if final:
        raise NotCalls("the list of calls is cut short")
    return calls


def _space(text: str, i: int) -> int:
    match = _SPACE.match(text, i)
    assert match is not None  # the pattern matches the empty string
    return match.end()
