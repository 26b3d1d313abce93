"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the
sequence's last n tokens. Free to run, and right often wherever the output copies its input
(code edits, summaries quoting their source, structured data)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from common.engine.sequence import Sequence


class NgramProposer:
    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        return [self.lookup(seq.token_ids, k) for seq, k in zip(seqs, num_tokens, strict=True)]

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix
        n-gram (``ngram_max`` down to ``ngram_min``) found; [] if none is found."""
        tokens = np.asarray(token_ids)
        for n in range(min(self.ngram_max, len(tokens) - 1), self.ngram_min - 1, -1):
            # Windows of the tokens before the last, so every match has a token after it.
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + k].tolist()
        return []
