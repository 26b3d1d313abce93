"""What the engine asks of a grammar library: a compiled grammar's matcher, one per sequence."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Matcher(ABC):
    """One sequence's position in its compiled grammar.

    Called by one thread at a time, the engine's step thread (the runner filling masks, the
    scheduler's postprocess advancing it). A bitmask is int32 ``[rows, ceil(vocab / 32)]``:
    bit ``t % 32`` of word ``t // 32`` of a row is set where token ``t`` may come next.
    """

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance over ``token_id``; False, and nothing changed, where it may not come next."""

    @abstractmethod
    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write row ``row`` of ``bitmask`` (on the host): the tokens that may come next."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (a speculative step's tentative ones)."""

    @property
    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token taken: nothing may follow."""


class GrammarError(ValueError):
    """A spec that no grammar library here can compile, or a token its grammar refuses."""
