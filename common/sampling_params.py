"""How one request wants its tokens chosen: the OpenAI/vLLM sampling knobs, checked and wire-ready.

A ``SamplingParams`` checks its own values when it is made, so none out of range exists: the
router's, made from the OpenAI request (a bad value is a 400 naming the field), and a worker's,
made by the codec from a request message off its socket (``common/messages.py``: refused there,
the message dropped). The token ids it names are checked against a vocabulary where one is known
(``check_token_ids``): by the router before it sends, by the engine when it admits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from common.structured import StructuredSpec

# OpenAI's limit on `top_logprobs`; vLLM enforces the same by default.
MAX_LOGPROBS = 20
# The range torch.Generator.manual_seed accepts; negative seeds wrap modulo 2**64 as they do there.
SEED_MIN = -(1 << 63)
SEED_MAX = (1 << 64) - 1
# Any top_k at or beyond the vocabulary keeps every token; beyond this one it is a client bug.
TOP_K_MAX = (1 << 31) - 1
# Token sequences of a request's bad words (each word gives one or two): every one is checked
# against the output at every step.
MAX_BAD_WORDS = 128


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int | None = None  # None means off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # None: no logprobs; k: the sampled token's logprob plus the k most likely alternatives.
    logprobs: int | None = None
    # The same for every prompt token after the first, given the tokens before it. A sequence
    # that asks for them reads nothing from the prefix cache: every position is computed.
    prompt_logprobs: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    ignore_eos: bool = False
    # token id -> added to its logit before penalties and sampling (not to reported logprobs).
    logit_bias: dict[int, float] = field(default_factory=dict)
    # vLLM's whitelist: every other token's logit is -inf before anything else edits them (not
    # in reported logprobs). None: every token may be chosen.
    allowed_token_ids: list[int] | None = None
    # vLLM's bad words, as the router tokenized them: a sequence's last token gets -inf wherever
    # the output ends with the rest of it (a one-token sequence's, always).
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # What the output must match (a JSON schema, a regex, a grammar, ...): every sampled token is
    # masked to those the constraint allows (common/engine/structured/). None: free text.
    structured: StructuredSpec | None = None

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the first field that is of the wrong type or out of range
        (token ids are checked to be ids here, and against a vocabulary by ``check_token_ids``)."""
        _check_int("max_tokens", self.max_tokens, ">= 1", lambda v: v >= 1)
        _check_int(
            "min_tokens",
            self.min_tokens,
            f"in [0, max_tokens] = [0, {self.max_tokens}]",
            lambda v: 0 <= v <= self.max_tokens,
        )
        _check_float("temperature", self.temperature, ">= 0 (0 means greedy)", lambda v: v >= 0)
        _check_float("top_p", self.top_p, "in (0, 1]", lambda v: 0 < v <= 1)
        if self.top_k is not None:
            _check_int(
                "top_k",
                self.top_k,
                f"in [1, {TOP_K_MAX}], or None for off",
                lambda v: 1 <= v <= TOP_K_MAX,
            )
        _check_float("min_p", self.min_p, "in [0, 1]", lambda v: 0 <= v <= 1)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name), "in [-2, 2]", lambda v: -2 <= v <= 2)
        _check_float("repetition_penalty", self.repetition_penalty, "> 0", lambda v: v > 0)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(
                    name,
                    getattr(self, name),
                    f"in [0, {MAX_LOGPROBS}], or None for none",
                    lambda v: 0 <= v <= MAX_LOGPROBS,
                )
        if self.seed is not None:
            _check_int(
                "seed",
                self.seed,
                "in [-2**63, 2**64 - 1] (64 bits), or None",
                lambda v: SEED_MIN <= v <= SEED_MAX,
            )
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not isinstance(self.stop_token_ids, list):
            raise ValueError(
                f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}"
            )
        self._check_token_ids(None)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise ``ValueError`` naming the first field (``stop_token_ids``, ``logit_bias``,
        ``allowed_token_ids``, ``bad_words_token_ids``) with a token id outside the vocabulary."""
        self._check_token_ids(vocab_size)

    def _check_token_ids(self, vocab_size: int | None) -> None:
        upper = "" if vocab_size is None else f" and < vocab_size = {vocab_size}"
        for token_id in self.stop_token_ids:
            if not _is_token_id(token_id, vocab_size):
                raise ValueError(
                    f"stop_token_ids must hold integer token ids >= 0{upper}, got {token_id!r}"
                )
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must map token ids to biases, got {self.logit_bias!r}")
        for token_id, bias in self.logit_bias.items():
            if not _is_token_id(token_id, vocab_size):
                raise ValueError(
                    f"logit_bias must have integer token ids >= 0{upper} as keys, got {token_id!r}"
                )
            _check_float("logit_bias", bias, "in [-100, 100]", lambda v: -100 <= v <= 100)
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise ValueError(
                    "allowed_token_ids must be a non-empty list of token ids (or absent, to "
                    f"allow every token), got {self.allowed_token_ids!r:.80}"
                )
            for token_id in self.allowed_token_ids:
                if not _is_token_id(token_id, vocab_size):
                    raise ValueError(
                        f"allowed_token_ids must hold integer token ids >= 0{upper}, "
                        f"got {token_id!r}"
                    )
        words = self.bad_words_token_ids
        if not isinstance(words, list) or len(words) > MAX_BAD_WORDS:
            raise ValueError(
                f"bad_words_token_ids must be a list of at most {MAX_BAD_WORDS} token sequences, "
                f"got {words!r:.80}"
            )
        for word in words:
            ids = isinstance(word, list) and all(_is_token_id(t, vocab_size) for t in word)
            if not (ids and word):
                raise ValueError(
                    "bad_words_token_ids must hold non-empty lists of integer token ids "
                    f">= 0{upper}, got {word!r:.80}"
                )


def _is_token_id(value: object, vocab_size: int | None) -> bool:
    return _is_int(value) and value >= 0 and (vocab_size is None or value < vocab_size)


def _is_int(value: object) -> TypeGuard[int]:
    # bool is a subclass of int, but `max_tokens=True` is a client bug, not a count.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: Any, rule: str, ok: Callable[[Any], bool]) -> None:
    if not (_is_int(value) and ok(value)):
        raise ValueError(f"{name} must be an integer {rule}, got {value!r}")


def _check_float(name: str, value: Any, rule: str, ok: Callable[[float], bool]) -> None:
    as_float = _finite_float(value)
    if as_float is None or not ok(as_float):
        raise ValueError(f"{name} must be a finite number {rule}, got {value!r}")


def _finite_float(value: Any) -> float | None:
    """``value`` as a finite float if it is an int or float that is one, else None."""
    if not (_is_int(value) or isinstance(value, float)):
        return None
    try:
        as_float = float(value)
    except OverflowError:  # an int beyond float range
        return None
    return as_float if math.isfinite(as_float) else None
