"""Incremental detokenization with the default model's byte-level BPE tokenizer."""

from __future__ import annotations

import random

import pytest

from common.model.default_model import resolve_model_path
from common.tokenizer import Tokenizer
from router.detokenizer import IncrementalDetokenizer
from router.stop_matcher import StopMatcher

TEXTS = [
    "Hello, world! 👋🏽 Emoji: 🎉🧑‍🚀 and CJK: 你好，世界。日本語のテキスト。",
    "naïve café — Ω≈ç√ ∫ 😀😃😄 한국어 텍스트 \n\n  spaces   and\ttabs",
]


@pytest.fixture(scope="module")
def text() -> Tokenizer:
    return Tokenizer(resolve_model_path(None))


def stream(text: Tokenizer, ids: list[int], stop=()) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(text.decode, stop)
    pieces = [detok.add([t]) for t in ids]
    pieces.append(detok.finish())
    return pieces, detok


@pytest.mark.parametrize("sample", TEXTS)
def test_multibyte_characters_split_across_tokens(text, sample):
    ids = text.encode(sample, add_special_tokens=False)
    # The sample really splits characters: some single tokens decode to an incomplete one.
    assert any("\ufffd" in text.decode([t]) for t in ids)
    pieces, _ = stream(text, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text.decode(ids) == sample


def test_stop_string_across_token_boundaries_is_cut_and_never_emitted(text):
    sample = "The answer is 42. END OF ANSWER and more text"
    ids = text.encode(sample, add_special_tokens=False)
    pieces, detok = stream(text, ids, stop=["END OF ANSWER"])
    assert "".join(pieces) == "The answer is 42. "
    assert detok.stopped and detok.stop_reason == "END OF ANSWER"
    # No prefix of the stop string ever left the detokenizer ahead of the match.
    assert not any("END" in p for p in pieces)


def test_an_included_stop_string_ends_the_text_and_nothing_is_held_back(text):
    """vLLM's include_stop_str_in_output: the stop string is emitted and the text cut after it
    (the rest of the token that completed it too); every character before the match left as
    soon as it was decoded, since it is emitted either way."""
    sample = "The answer is 42. END OF ANSWER and more text"
    ids = text.encode(sample, add_special_tokens=False)
    detok = IncrementalDetokenizer(text.decode, ["OF ANS"], include_stop=True)
    pieces, decoded = [], ""
    for token_id in ids:
        pieces.append(detok.add([token_id]))
        if not detok.stopped:
            decoded = text.decode(ids[: len(pieces)])
            assert "".join(pieces) == decoded  # nothing held back
    pieces.append(detok.finish())
    assert "".join(pieces) == "The answer is 42. END OF ANS"
    assert detok.stopped and detok.stop_reason == "OF ANS"
    # Arriving together, the tokens give the same text.
    together = IncrementalDetokenizer(text.decode, ["OF ANS"], include_stop=True)
    assert together.add(ids) + together.finish() == "".join(pieces)


def test_tokens_arriving_together_stop_at_the_one_that_completes_the_stop_string(text):
    """A speculative step delivers several tokens at once: the text is cut as if they came one
    by one, and the tokens after the one that completed the stop string are not taken."""
    sample = "The answer is 42. END OF ANSWER and more text"
    ids = text.encode(sample, add_special_tokens=False)
    one_by_one, _ = stream(text, ids, stop=["END OF ANSWER"])
    completing = next(n for n in range(1, len(ids) + 1) if "END OF ANSWER" in text.decode(ids[:n]))
    detok = IncrementalDetokenizer(text.decode, ["END OF ANSWER"])
    assert detok.add(ids[:3]) + detok.add(ids[3:]) + detok.finish() == "".join(one_by_one)
    assert detok.stopped and 3 + detok.tokens_taken == completing
    assert detok.add(ids[:2]) == "" and detok.tokens_taken == 0


def test_held_back_text_is_released_when_it_stops_matching(text):
    ids = text.encode("a stop-gap, not a stop", add_special_tokens=False)
    pieces, detok = stream(text, ids, stop=["stopper"])
    assert "".join(pieces) == "a stop-gap, not a stop"
    assert not detok.stopped


def test_stop_string_inside_an_emoji_sequence(text):
    ids = text.encode("ok 🎉🎉 done", add_special_tokens=False)
    pieces, _ = stream(text, ids, stop=["🎉"])
    assert "".join(pieces) == "ok "


def test_final_text_equals_full_decode_with_special_tokens_skipped(text):
    ids = text.encode("<|im_start|>assistant\nHi there 😊<|im_end|>", add_special_tokens=False)
    pieces, _ = stream(text, ids)
    assert "".join(pieces) == text.decode(ids)


def test_direct_tokenizer_calls_match_transformers(text):
    """The router calls the Rust tokenizer itself; it must give what transformers gives."""
    assert text.direct_backend is not None  # the default model takes the direct path
    hf = text._tokenizer
    samples = [
        *TEXTS,
        "",
        " leading space",
        "<|im_start|>user\nhi<|im_end|>",
        "<|endoftext|>x",
        "12345 digits",
    ]
    for sample in samples:
        for special in (True, False):
            ids = text.encode(sample, add_special_tokens=special)
            assert ids == hf.encode(sample, add_special_tokens=special)
            for skip in (True, False):
                assert text.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)
    assert text.decode([0, 1, 2, 42], False) == hf.decode([0, 1, 2, 42], skip_special_tokens=False)


def test_stop_matcher_agrees_with_a_plain_search_however_the_text_arrives():
    """Random stop strings and texts over a small alphabet (so prefixes overlap a lot), fed in
    random pieces: the first match ends where ``str.find`` says, and the state is always the
    longest tail of the text that begins the stop string."""
    rng = random.Random(0)
    for _ in range(2000):
        stop = "".join(rng.choice("ab") for _ in range(rng.randint(1, 6)))
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        matcher, fed, found = StopMatcher(stop), 0, -1
        while fed < len(text) and found == -1:
            piece = text[fed : fed + rng.randint(1, 4)]
            end = matcher.feed(piece)
            if end != -1:
                found = fed + end
            else:
                fed += len(piece)
                seen = text[:fed]
                tail = max((n for n in range(len(stop)) if seen.endswith(stop[:n])), default=0)
                assert matcher.matched == tail
        at = text.find(stop)
        assert found == (-1 if at == -1 else at + len(stop))


def test_long_overlapping_stop_strings_hold_back_and_cut_exactly():
    """Stop strings built to defeat naive matching (long runs of one character, a different
    last one): held-back text, the cut and the reason are still exact."""
    stops = ["a" * 3000 + "b", "a" * 2000 + "c"]
    detok = IncrementalDetokenizer(lambda ids: "".join(map(chr, ids)), stops)
    sent = "".join(detok.add([ord("a")]) for _ in range(2500))
    assert sent == ""  # all of it may still grow into the first stop string
    sent += detok.add([ord("c")])
    assert detok.stopped and detok.stop_reason == stops[1]
    assert sent == "a" * 500
