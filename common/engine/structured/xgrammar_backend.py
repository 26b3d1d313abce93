"""Grammars compiled by xgrammar: the default, as in vLLM, SGLang and TensorRT-LLM.

It compiles JSON schemas (its strict mode: unknown keywords refused, bounded whitespace unless
the spec asks for any), JSON objects, regular expressions, EBNF and Lark grammars, and structural
tags; choices go in as an EBNF alternation. Compilation precomputes each grammar state's token
masks, so a large schema can take seconds (``GrammarCompiler`` bounds it), and a mask is then
filled in tens of microseconds.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import xgrammar as xgr

from common.engine.structured.matcher import Matcher
from common.structured import (
    CHOICE,
    GRAMMAR,
    JSON_OBJECT,
    JSON_SCHEMA,
    REGEX,
    STRUCTURAL_TAG,
    StructuredSpec,
)


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        # One thread: a worker compiles one grammar at a time, beside its steps.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._stop_token_ids = stop_token_ids

    def compile(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        """The spec's grammar; raises (any exception) where xgrammar cannot compile it."""
        compiler = self._compiler
        if spec.kind == JSON_SCHEMA:
            return compiler.compile_json_schema(spec.text, any_whitespace=spec.any_whitespace)
        if spec.kind == JSON_OBJECT:
            if spec.any_whitespace:
                return compiler.compile_builtin_json_grammar()
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == REGEX:
            return compiler.compile_regex(spec.text)
        if spec.kind == CHOICE:
            choices = " | ".join(json.dumps(choice) for choice in json.loads(spec.text))
            return compiler.compile_grammar(f"root ::= {choices}")
        if spec.kind == GRAMMAR:
            if "::=" in spec.text:  # EBNF (GBNF) names rules with ::=; Lark with a colon
                return compiler.compile_grammar(spec.text)
            return compiler.compile_lark(spec.text)
        if spec.kind == STRUCTURAL_TAG:
            tag = json.loads(spec.text)
            if "structures" in tag:  # vLLM's first form: begin, schema and end per structure
                items = [
                    xgr.StructuralTagItem(
                        begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"]
                    )
                    for s in tag["structures"]
                ]
                return compiler.compile_structural_tag(items, tag.get("triggers", []))
            return compiler.compile_structural_tag(spec.text)
        raise ValueError(f"xgrammar has no compiler for {spec.kind}")

    def matcher(self, grammar: xgr.CompiledGrammar) -> Matcher:
        return XGrammarMatcher(
            xgr.GrammarMatcher(grammar, override_stop_tokens=self._stop_token_ids)
        )


class XGrammarMatcher(Matcher):
    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()
