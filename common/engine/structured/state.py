"""One sequence's grammar: compiling, then following the sequence's output token by token."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

import torch

from common.engine.structured.compiler import Grammar
from common.engine.structured.matcher import GrammarError, Matcher
from common.structured import StructuredSpec


class GrammarState:
    """Built when the scheduler takes the sequence (the grammar compiling), ``start``ed once it
    is compiled, then advanced over every token the sequence appends. With ``starts_after``,
    the grammar applies only once the output holds those tokens (a reasoning model's end of
    thinking): before that, tokens are free and only watched for it."""

    def __init__(self, spec: StructuredSpec, grammar: Future[Grammar]) -> None:
        self.spec = spec
        self._grammar = grammar
        self._matcher: Matcher | None = None
        self.active = not spec.starts_after  # the grammar constrains the next token
        self._tail: list[int] = []  # the output's last tokens, while waiting for the trigger

    @property
    def compiled(self) -> bool:
        return self._grammar.done()

    def start(self, output_token_ids: Sequence[int]) -> bool:
        """Make the matcher and advance it over the output so far; whether that output is
        complete already. Raises ``GrammarError`` where the grammar could not be compiled or
        the output breaks it."""
        self._matcher = self._grammar.result().matcher()
        complete = False
        for token_id in output_token_ids:
            complete = self.advance(token_id)
        return complete

    def advance(self, token_id: int) -> bool:
        """Take ``token_id``; whether the output is complete (its grammar's stop token taken).
        Raises ``GrammarError`` where the grammar refuses it."""
        if not self.active:
            self._watch(token_id)
            return False
        matcher = self._live()
        if not matcher.accept(token_id):
            raise GrammarError(f"token {token_id} breaks the {self.spec.kind}")
        return matcher.is_terminated

    def fill_rows(
        self, proposed: Sequence[int], bitmask: torch.Tensor, first_row: int
    ) -> list[int]:
        """Fill ``bitmask``'s rows from ``first_row``: the tokens allowed next, then after each
        proposal in turn (a speculative step samples one row per proposal), taken tentatively
        and undone before returning. The rows it filled: none before the grammar is active, and
        none after a proposal the grammar refuses (the step's verification stops there)."""
        matcher = self._live()
        saved = (self.active, list(self._tail))
        filled: list[int] = []
        taken = 0
        for j in range(len(proposed) + 1):
            if self.active:
                if matcher.is_terminated:
                    break  # complete: the sequence ends with the token before this row
                matcher.fill_mask(bitmask, first_row + j)
                filled.append(first_row + j)
            if j == len(proposed):
                break
            if not self.active:
                self._watch(proposed[j])
            elif matcher.accept(proposed[j]):
                taken += 1
            else:
                break
        matcher.rollback(taken)
        self.active, self._tail = saved
        return filled

    def _watch(self, token_id: int) -> None:
        trigger = self.spec.starts_after
        self._tail = [*self._tail, token_id][-len(trigger) :]
        self.active = self._tail == trigger

    def _live(self) -> Matcher:
        if self._matcher is None:
            raise GrammarError("the grammar is not started")
        return self._matcher
