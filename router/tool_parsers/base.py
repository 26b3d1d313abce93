"""The tool-call parser's contract: one choice's output text read as content and tool calls.

A parser knows one output format (Hermes' ``<tool_call>`` tags, Mistral's ``[TOOL_CALLS]``, ...).
``ChatOutput`` (router/chat_output.py) makes one per choice and hands it the answer's text (after
any reasoning), growing, each time with what came before as its prefix, and last with
``final=True``: a stream diffs what the calls return into OpenAI's tool-call deltas, a whole
answer makes only the final call. Both then carry the same calls, by construction.
"""

from __future__ import annotations

import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(slots=True)
class ParsedCall:
    """One tool call as far as the text shows it: its function's name (whole), and its
    arguments' JSON text as the model wrote it (all of it once the call is complete)."""

    name: str
    arguments: str


@dataclass(slots=True)
class Parsed:
    """The text read: the content (what is not a call), and the calls."""

    content: str
    calls: list[ParsedCall] = field(default_factory=list)


def partial_marker(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker``: held back
    from a stream until the next text says whether the marker comes."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


class ToolParser(ABC):
    """Reads one choice's answer as content and tool calls, in one format.

    ``parse`` is called from the router's event loop, with the text so far (each time longer,
    the text before its prefix) and last with ``final=True`` (the whole answer). A parser may keep
    what it has read (a settled call is not read again), so it serves one choice.

    What it returns grows with the text wherever the answer is well-formed for the format: the
    content only grows, calls are only added, each call's name stays and its arguments only grow
    (a call is returned once its name is whole and its arguments have begun). Text that could
    still be a marker is held back until it is known. An answer that turns out malformed (a call
    that does not parse, one cut short) is all content in the final reading, with no calls, as
    vLLM answers; a stream, which never takes back what it sent, keeps the calls it announced.
    """

    # Whether the format's markers are special tokens that decoding would otherwise drop (the
    # answer is then decoded with them, as vLLM does for these parsers).
    keeps_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def parse(self, text: str, final: bool) -> Parsed:
        """The content and calls that ``text`` shows; ``final``: the answer is complete."""

    def new_call_id(self) -> str:
        """A new call's id, in vLLM's form."""
        return f"chatcmpl-tool-{secrets.token_hex(16)}"
