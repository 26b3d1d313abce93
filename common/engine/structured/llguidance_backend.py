"""Grammars compiled by llguidance: where xgrammar cannot compile a spec, or not in time.

Its parser runs lazily (an Earley parser over a lexer, nothing precomputed per state), so any
grammar it accepts starts at once, and a mask takes about a millisecond. It covers JSON schemas
(with ``whitespace_flexible`` off unless the spec asks for any whitespace), regular expressions,
Lark, and EBNF (GBNF, converted to Lark); choices go in as a Lark alternation. Structural tags are
xgrammar's alone.
"""

from __future__ import annotations

from typing import Any

import llguidance
import llguidance.torch
import torch

from common.engine.structured.matcher import Matcher
from common.structured import StructuredSpec
from common.structured_grammar import grammar_problem, grammar_text, tokenizer_for


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer_for(hf_tokenizer, vocab_size, stop_token_ids)

    def compile(self, spec: StructuredSpec) -> str:
        """The spec's grammar text, checked; raises ValueError where llguidance refuses it."""
        problem = grammar_problem(spec, self._tokenizer)
        if problem is not None:
            raise ValueError(problem)
        return grammar_text(spec)

    def matcher(self, grammar: str) -> Matcher:
        matcher = llguidance.LLMatcher(self._tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return LLGuidanceMatcher(matcher)


class LLGuidanceMatcher(Matcher):
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        # A refused token leaves the matcher in an error state: test first, then consume.
        if self._matcher.validate_tokens([token_id]) != 1:
            return False
        return self._matcher.consume_token(token_id)

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        return self._matcher.is_stopped()
