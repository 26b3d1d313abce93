"""Reasoning parsers: a choice's output split into its reasoning and its answer, by markers.

A reasoning model thinks first, between ``<think>`` and ``</think>`` (the opening marker often
in the prompt already, put there by the chat template), and answers after. ``ChatOutput``
(router/chat_output.py) makes one parser per choice and hands it the output text, growing (the
text before its prefix), and last with ``final=True``. What ``split`` returns grows with the text:
the reasoning until the end marker comes, the answer after; text that could still be a marker is
held back until it is known.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from router.tool_parsers.base import partial_marker


@dataclass(slots=True)
class Split:
    reasoning: str
    answer: str


class ReasoningParser:
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    # Markers that end the reasoning too, and begin the answer (they stay in it).
    answer_markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, thinking: bool) -> None:
        # Whether the output begins inside the reasoning; not where the prompt closed it (a
        # template told not to think writes an empty think block there).
        self.thinking = thinking

    @classmethod
    def closed_in(cls, prompt_tail: str) -> bool:
        """Whether a prompt ending in ``prompt_tail`` has already ended the reasoning: its last
        marker is the end marker, so the output is all answer."""
        return prompt_tail.rfind(cls.end) > prompt_tail.rfind(cls.start)

    def split(self, text: str, final: bool) -> Split:
        """The reasoning and the answer that ``text`` shows; ``final``: the output is complete.
        Without an end marker the whole output is reasoning (a model cut short while thinking),
        as vLLM reads it."""
        if not self.thinking:
            return Split("", text)
        lead = len(text) - len(text.lstrip())
        if text.startswith(self.start, lead):
            text = text[lead + len(self.start) :]
        elif not final and self.start.startswith(text[lead:]):
            return Split("", "")  # whitespace so far, or the start of the opening marker
        ends = [(text.find(marker), marker) for marker in (self.end, *self.answer_markers)]
        found = [(at, marker) for at, marker in ends if at != -1]
        if found:
            at, marker = min(found)
            answer_from = at + len(self.end) if marker == self.end else at
            return Split(text[:at], text[answer_from:])
        if final:
            return Split(text, "")
        held = max(partial_marker(text, marker) for marker in (self.end, *self.answer_markers))
        return Split(text[: len(text) - held], "")
