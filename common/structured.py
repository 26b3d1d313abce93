"""A constraint on what a sequence may output: a JSON schema, any JSON object, a regular
expression, one of several strings, a grammar, or a structural tag.

The router turns a request's ``response_format``, ``structured_outputs``, ``guided_*`` fields or
forced tool call into one ``StructuredSpec`` (``router/structured_request.py``) and checks that
it compiles; it travels in the sampling params to the workers, which compile it into a grammar
and mask every sampled token with it (``common/engine/structured/``). The spec is text, so it
crosses the wire as it came and two workers given the same spec compile the same grammar.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# The kinds, with vLLM's names (its ``structured_outputs`` fields).
JSON_SCHEMA = "json_schema"  # text: the schema, as JSON
JSON_OBJECT = "json_object"  # text: "" (any JSON object)
REGEX = "regex"  # text: the expression
CHOICE = "choice"  # text: a JSON list of the strings allowed
GRAMMAR = "grammar"  # text: EBNF (GBNF) or Lark
STRUCTURAL_TAG = "structural_tag"  # text: the tag's JSON
KINDS = (JSON_SCHEMA, JSON_OBJECT, REGEX, CHOICE, GRAMMAR, STRUCTURAL_TAG)
# A spec larger than this is refused: it travels in every request message of its sequence.
MAX_SPEC_BYTES = 256 << 10


@dataclass(frozen=True, slots=True)
class StructuredSpec:
    kind: str
    text: str = ""
    # JSON kinds: whether whitespace between tokens is free, as the JSON grammar allows. Off by
    # default (vLLM's ``disable_any_whitespace``): a small model sampling freely can otherwise
    # wander in whitespace until max_tokens, its object never closed.
    any_whitespace: bool = False
    # The constraint starts once the output holds these tokens (a reasoning model's end of
    # thinking, e.g. ``</think>``): what comes before is free, as vLLM applies a schema to the
    # answer after the reasoning. Empty: from the first token.
    starts_after: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}")
        if not isinstance(self.text, str) or not isinstance(self.any_whitespace, bool):
            raise ValueError("a structured output spec is a kind, its text and a flag")
        if not isinstance(self.starts_after, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.starts_after
        ):
            raise ValueError("starts_after must be a list of token ids")
        if len(self.text.encode()) > MAX_SPEC_BYTES:
            raise ValueError(
                f"a {self.kind} of {len(self.text.encode())} bytes is more than the "
                f"{MAX_SPEC_BYTES} allowed"
            )
        if self.kind in (JSON_SCHEMA, CHOICE, STRUCTURAL_TAG):
            try:
                value = json.loads(self.text)
            except ValueError as exc:
                raise ValueError(f"a {self.kind} must be JSON: {exc}") from None
            if self.kind == CHOICE and not (
                isinstance(value, list) and value and all(isinstance(c, str) for c in value)
            ):
                raise ValueError("a choice must be a non-empty list of strings")
            if self.kind == STRUCTURAL_TAG:
                _check_structural_tag(value)
        elif self.kind in (REGEX, GRAMMAR) and not self.text:
            raise ValueError(f"a {self.kind} must not be empty")

    @property
    def is_json(self) -> bool:
        return self.kind in (JSON_SCHEMA, JSON_OBJECT)


def _check_structural_tag(tag: Any) -> None:
    """A structural tag's shape, so that a malformed one is refused where the request is read
    (only xgrammar compiles one, in the workers): vLLM's form, ``structures`` (each a ``begin``
    that starts with one of the ``triggers``, a ``schema`` object and an ``end``), or xgrammar's,
    a ``format`` object."""
    if not isinstance(tag, dict):
        raise ValueError("a structural tag must be a JSON object")
    if "structures" not in tag:
        if not isinstance(tag.get("format"), dict):
            raise ValueError("a structural tag needs structures and triggers, or a format object")
        return
    structures, triggers = tag["structures"], tag.get("triggers")
    if not (
        isinstance(triggers, list) and triggers and all(isinstance(t, str) and t for t in triggers)
    ):
        raise ValueError("a structural tag's triggers must be a non-empty list of strings")
    if not isinstance(structures, list) or not structures:
        raise ValueError("a structural tag's structures must be a non-empty list")
    for item in structures:
        if not (
            isinstance(item, dict)
            and isinstance(item.get("begin"), str)
            and isinstance(item.get("end"), str)
            and isinstance(item.get("schema", {}), dict)
        ):
            raise ValueError("each structure needs begin and end strings and a schema object")
        if not any(item["begin"].startswith(t) for t in triggers):
            raise ValueError(f"the structure beginning {item['begin']!r} starts with no trigger")
