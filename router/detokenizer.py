"""Incremental detokenization with stop strings, one instance per generated sequence.

Byte-level BPE splits a multi-byte character across tokens, so text is taken from a window of recent
tokens and only once it no longer ends in U+FFFD (the decoder's mark for an incomplete character).
Text that could still grow into a stop string is held back; a stop string, once complete, is cut off
and never emitted (or, with ``include_stop``, emitted and the text cut after it: nothing is held
back then, since what precedes a match is emitted either way). At the end, the held-back tail is
flushed so the emitted text equals the full decode of the tokens (minus anything from a stop string
on, or after it). Stop strings are followed by ``StopMatcher`` automata, so a token costs what its
own characters cost, however long the text and the stop strings are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from router.stop_matcher import StopMatcher

_REPLACEMENT = "\ufffd"
# Tokens before the new ones that are decoded with them: enough context for the decoder to merge
# bytes and spaces exactly as the full decode does.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        stop: Sequence[str] = (),
        skip_token_ids: frozenset[int] = frozenset(),
        include_stop: bool = False,
    ):
        self._decode = decode
        self._stop = [StopMatcher(s) for s in stop if s]
        self._include_stop = include_stop
        self._fed = 0  # characters of ``text`` the stop matchers have seen
        self._skip = skip_token_ids  # e.g. a stop token id, whose text is not emitted
        self.token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""  # everything decoded so far that is complete
        self._emitted = 0  # len of self.text already returned
        self.stopped = False  # a stop string matched
        self.stop_reason: str | None = None
        self.tokens_taken = 0  # of the last add()'s tokens

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed new tokens; returns the text that may now be sent (possibly empty). With stop
        strings the tokens are taken one at a time, and none after the one that completes a
        stop string: ``tokens_taken`` says how many were."""
        if self.stopped:
            self.tokens_taken = 0
            return ""
        if not self._stop or len(token_ids) == 1:
            self.tokens_taken = len(token_ids)
            return self._extend(token_ids)
        text = ""
        self.tokens_taken = 0
        for token_id in token_ids:
            text += self._extend([token_id])
            self.tokens_taken += 1
            if self.stopped:
                break
        return text

    def _extend(self, token_ids: Sequence[int]) -> str:
        for token_id in token_ids:
            if token_id in self._skip:
                continue
            self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            self.text += full[len(prefix) :]
            self._prefix_offset = max(len(self.token_ids) - _CONTEXT_TOKENS, 0)
            self._read_offset = len(self.token_ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The end of the sequence: flush what was held back."""
        if self.stopped:
            return ""
        whole = self._decode(self.token_ids)
        if whole.startswith(self.text):
            self.text = whole
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        start = self._emitted
        if self._stop:
            # Only text not yet fed can complete a stop string: earlier text never did.
            new = self.text[self._fed :]
            earliest = None
            for matcher in self._stop:
                end = matcher.feed(new)
                at = self._fed + end - len(matcher.stop)
                if end != -1 and (earliest is None or at < earliest):
                    earliest, self.stop_reason = at, matcher.stop
            self._fed = len(self.text)
            if earliest is not None:
                self.stopped = True
                assert self.stop_reason is not None
                cut = earliest + (len(self.stop_reason) if self._include_stop else 0)
                self.text = self.text[:cut]
                self._emitted = len(self.text)
                return self.text[start:]
        end = len(self.text) if final else len(self.text) - self._holdback()
        end = max(end, start)
        self._emitted = end
        return self.text[start:end]

    def _holdback(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string
        (none where matched stop strings are emitted)."""
        if self._include_stop:
            return 0
        return max((matcher.matched for matcher in self._stop), default=0)
