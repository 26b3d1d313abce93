"""Beam search written plainly, as the tests' reference: vLLM's rules over a model's whole
next-token distribution at every step (the router asks the workers for 2 * width tokens only)."""

from __future__ import annotations

from collections.abc import Callable


def reference_beam_search(
    prompt: list[int],
    next_logprobs: Callable[[list[int]], dict[int, float]],
    eos: int,
    width: int,
    max_tokens: int,
    penalty: float,
) -> list[tuple[list[int], float, str]]:
    """(tokens, cumulative logprob, finish reason) of the ``width`` best answers, best first.

    ``next_logprobs(sequence)`` is the model: every token's logprob after ``sequence``. Each
    step keeps the ``width`` best continuations of all live beams that are not EOS; EOS ends a
    beam (left out of its tokens) where it is among that beam's ``2 * width`` most likely
    tokens. Finished and live beams are ranked by cumulative logprob / (prompt + generated
    tokens) ** penalty.
    """
    live: list[tuple[list[int], float]] = [([], 0.0)]
    ended: list[tuple[list[int], float, str]] = []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in live:
            ranked = sorted(next_logprobs(prompt + tokens).items(), key=lambda item: -item[1])
            for rank, (token, lp) in enumerate(ranked):
                if token == eos:
                    if rank < 2 * width:
                        ended.append((tokens, cum + lp, "stop"))
                else:
                    candidates.append(([*tokens, token], cum + lp))
        candidates.sort(key=lambda c: -c[1])
        live = candidates[:width]
    ended += [(tokens, cum, "length") for tokens, cum in live]
    ended.sort(key=lambda e: e[1] / (len(prompt) + len(e[0])) ** penalty, reverse=True)
    return ended[:width]
