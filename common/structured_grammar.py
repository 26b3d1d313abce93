"""llguidance's grammar for a ``StructuredSpec``, and its view of a tokenizer: torch-free, so the
router checks each spec with it before sending it on, and a worker compiles with it where
xgrammar cannot (``common/engine/structured/llguidance_backend.py``)."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.hf
from llguidance.gbnf_to_lark import any_to_lark

from common.structured import CHOICE, GRAMMAR, JSON_OBJECT, JSON_SCHEMA, REGEX, StructuredSpec


def grammar_text(spec: StructuredSpec) -> str:
    """llguidance's grammar for ``spec`` (what ``LLMatcher`` compiles); raises ValueError for a
    kind it does not take (structural tags are xgrammar's alone)."""
    # Off: no whitespace between a JSON value's tokens at all (as xgrammar's strict mode bounds
    # it): a small model cannot wander in it until max_tokens.
    whitespace: Any = {"whitespace_flexible": spec.any_whitespace}
    if spec.kind == JSON_SCHEMA:
        return llguidance.LLMatcher.grammar_from_json_schema(spec.text, defaults=whitespace)
    if spec.kind == JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema(
            '{"type": "object"}', defaults=whitespace
        )
    if spec.kind == REGEX:
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == CHOICE:
        choices = " | ".join(json.dumps(choice) for choice in json.loads(spec.text))
        return llguidance.LLMatcher.grammar_from_lark(f"start: {choices}")
    if spec.kind == GRAMMAR:
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec.text))
    raise ValueError(f"llguidance takes no {spec.kind}")


def tokenizer_for(hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """llguidance's view of a transformers tokenizer."""
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=stop_token_ids)


def grammar_problem(spec: StructuredSpec, tokenizer: Any) -> str | None:
    """Why llguidance cannot compile ``spec`` over ``tokenizer``, or None."""
    try:
        grammar = grammar_text(spec)
    except Exception as exc:  # the library's own error types
        return str(exc)
    return llguidance.LLMatcher.validate_grammar(grammar, tokenizer) or None
