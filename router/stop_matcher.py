"""Stop strings found in text as it grows, at a cost per new character, not per text length.

One ``StopMatcher`` follows one stop string with the Knuth-Morris-Pratt automaton: its state is
the length of the longest prefix of the stop string that the text seen so far ends with. That is
both what a match needs (the state reaches the stop string's length) and how much of the text's
tail must be held back (it may still grow into the stop string). Feeding ``n`` characters costs
O(n) amortised, however long the text and the stop string are.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=256)
def fallback_table(stop: str) -> tuple[int, ...]:
    """``table[i]``: the length of the longest proper prefix of ``stop[:i + 1]`` that is also
    its suffix (shared by the n choices of a request, and by requests with the same stops)."""
    table = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = table[k - 1]
        if stop[i] == stop[k]:
            k += 1
        table[i] = k
    return tuple(table)


class StopMatcher:
    def __init__(self, stop: str) -> None:
        if not stop:
            raise ValueError("a stop string may not be empty")
        self.stop = stop
        self._fallback = fallback_table(stop)
        self.matched = 0  # the longest prefix of stop the text ends with

    def feed(self, text: str) -> int:
        """Take the next characters; returns the index in ``text`` just past the first
        complete occurrence of the stop string, or -1 (the state then covers all of them)."""
        stop, fallback, k = self.stop, self._fallback, self.matched
        for index, char in enumerate(text):
            while k and char != stop[k]:
                k = fallback[k - 1]
            if char == stop[k]:
                k += 1
                if k == len(stop):
                    self.matched = k
                    return index + 1
        self.matched = k
        return -1
