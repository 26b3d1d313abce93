"""SamplingParams validation and wire form; the Sampler's filters, penalties, logprobs and seeds."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import common.engine.sampler as sampler_module
from common.engine.sampler import (
    SampledToken,
    Sampler,
    SamplingRow,
    _filter_threshold,
    apply_penalties,
)
from common.messages import decode, encode, from_wire, to_wire
from common.protocol import PrefillRequest
from common.sampling_params import SamplingParams

EOS = 3


def make_logits(rows: int, vocab: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def row(output: list[int] | None = None, prompt: list[int] | None = None, **params) -> SamplingRow:
    return SamplingRow.of(SamplingParams(**params), prompt or [], output or [])


def token_ids(results: list[SampledToken]) -> list[int]:
    return [r.token_id for r in results]


# --------------------------------------------------------------------------- SamplingParams


def test_defaults_are_valid_and_not_greedy():
    params = SamplingParams()
    params.check_token_ids(vocab_size=10)
    assert not params.is_greedy
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams().stop_token_ids is not SamplingParams().stop_token_ids


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", "1"),
        ("temperature", None),
        ("temperature", 10**400),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", math.nan),
        ("top_k", 0),
        ("top_k", -1),
        ("top_k", 2.0),
        ("top_k", True),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("frequency_penalty", 3),
        ("frequency_penalty", -math.inf),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("max_tokens", 0),
        ("max_tokens", 16.0),
        ("max_tokens", True),
        ("max_tokens", None),
        ("max_tokens", "16"),
        ("min_tokens", -1),
        ("min_tokens", 17),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", 1.0),
        ("seed", 1 << 64),
        ("seed", -(1 << 63) - 1),
        ("seed", 1.5),
        ("seed", "7"),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", [True]),
        ("stop_token_ids", "12"),
        ("stop_token_ids", None),
        ("ignore_eos", 1),
        ("ignore_eos", "yes"),
        ("prompt_logprobs", -1),
        ("prompt_logprobs", 21),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"5": 1.0}),
        ("logit_bias", {5: 101.0}),
        ("logit_bias", {5: float("nan")}),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [-1]),
        ("allowed_token_ids", [1.0]),
        ("allowed_token_ids", [True]),
        ("allowed_token_ids", "12"),
        ("bad_words_token_ids", [[]]),
        ("bad_words_token_ids", [[-1]]),
        ("bad_words_token_ids", [[1.0]]),
        ("bad_words_token_ids", [1]),
        ("bad_words_token_ids", [[1]] * 129),
    ],
)
def test_bad_values_are_rejected_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=field):
        off_the_wire({**to_wire(SamplingParams()), field: value})


@pytest.mark.parametrize(
    "changes",
    [
        {"temperature": 0.0, "top_p": 1.0, "top_k": 1, "min_p": 1.0},
        {"min_p": 0.0, "presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"repetition_penalty": 1e-3, "logprobs": 0, "seed": -(1 << 63)},
        {"logprobs": 20, "seed": (1 << 64) - 1, "min_tokens": 16, "max_tokens": 16},
        {"stop_token_ids": [0, 99], "ignore_eos": True, "top_k": 10**6},
        {"prompt_logprobs": 0, "logit_bias": {0: -100.0, 99: 100.0}},
        {"allowed_token_ids": [0, 99], "logprobs": 1},
        {"bad_words_token_ids": [[0], [5, 99]] + [[1]] * 126},
    ],
)
def test_boundary_values_are_accepted(changes):
    SamplingParams(**changes).check_token_ids(vocab_size=100)
    assert off_the_wire(to_wire(SamplingParams(**changes))) == SamplingParams(**changes)


def test_stop_token_ids_are_bounded_by_the_vocabulary():
    SamplingParams(stop_token_ids=[99]).check_token_ids(vocab_size=100)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[100]).check_token_ids(vocab_size=100)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={100: 1.0}).check_token_ids(vocab_size=100)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[5, 100]).check_token_ids(vocab_size=100)
    with pytest.raises(ValueError, match="bad_words_token_ids"):
        SamplingParams(bad_words_token_ids=[[5, 100]]).check_token_ids(vocab_size=100)


def off_the_wire(raw) -> SamplingParams:
    """What a worker's codec makes of the params of a request off its socket: the fields and
    their types checked by the codec, the values by the params themselves, once."""
    return from_wire(SamplingParams, raw)


@pytest.mark.parametrize(
    "payload,match",
    [
        ({"temprature": 0.5}, "unexpected fields"),
        ({1: 0.5}, "unexpected fields"),
        ({"n": 2, "best_of": 3}, "unexpected fields"),
        ([("temperature", 0.5)], "expected a map"),
        ("temperature=0.5", "expected a map"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logit_bias": "5:1"}, "pairs"),
        ({"logit_bias": [[5, 1.0, 2]]}, "pair"),
        ({"logit_bias": [["5", 1.0]]}, "logit_bias"),
        ({"logit_bias": [[5, 1.0], [5, 2.0]]}, "twice"),
        ({"logit_bias": {"5": 1.0}}, "pairs"),
    ],
)
def test_malformed_params_off_the_wire_are_refused(payload, match):
    with pytest.raises(ValueError, match=match):
        off_the_wire(payload)


def test_wire_round_trip_through_a_message():
    params = SamplingParams(
        max_tokens=100,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=(1 << 64) - 5,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.1,
        logprobs=5,
        stop_token_ids=[7, 11],
        min_tokens=3,
        ignore_eos=True,
        prompt_logprobs=2,
        logit_bias={7: -100.0, 300: 2.5},
    )
    request = PrefillRequest("r", [1, 2], params, "d0", "tcp://127.0.0.1:1")
    assert decode(encode(request)).params == params  # logit_bias's int keys travel as pairs
    assert to_wire(params)["logit_bias"] == [[7, -100.0], [300, 2.5]]
    assert off_the_wire(to_wire(SamplingParams())) == SamplingParams()


def test_params_off_the_wire_fill_defaults_and_take_ints_for_floats():
    params = off_the_wire({"temperature": 0, "top_p": 1})
    assert params == SamplingParams(temperature=0.0)
    assert isinstance(params.temperature, float) and isinstance(params.top_p, float)


# --------------------------------------------------------------------------- greedy and filters


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.0},
        {"temperature": 0.0, "seed": 5},
        {"top_k": 1},
        {"top_k": 1, "temperature": 2.0, "seed": 9},
        {"top_p": 1e-6},
        {"top_p": 1e-6, "temperature": 1.5, "seed": 3},
        {"min_p": 1.0},
        {"min_p": 1.0, "temperature": 0.3, "seed": 1},
    ],
)
def test_settings_that_leave_one_token_equal_argmax(params):
    logits = make_logits(16, 300, seed=0)
    sampler = Sampler(300, [EOS])
    for step in range(3):
        rows = [row(output=[0] * step, **params) for _ in range(16)]
        assert token_ids(sampler.sample(logits, rows)) == logits.argmax(-1).tolist()


def reference_kept(logits: list[float], temperature: float, top_k, top_p, min_p) -> list[float]:
    """The filtered, renormalised distribution, written out the slow and obvious way."""
    probs = torch.softmax(torch.tensor(logits, dtype=torch.float64) / temperature, -1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept = order[:top_k] if top_k is not None else order
    mass = sum(probs[i] for i in kept)
    taken, before = [], 0.0
    for i in kept:
        if before >= top_p:
            break
        taken.append(i)
        before += probs[i] / mass
    largest = probs[order[0]]
    taken = [i for i in taken if probs[i] >= min_p * largest]
    total = sum(probs[i] for i in taken)
    return [probs[i] / total if i in taken else 0.0 for i in range(len(probs))]


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"temperature": 0.5},
        {"temperature": 2.0},
        {"top_k": 5},
        {"top_p": 0.6},
        {"min_p": 0.2},
        {"top_k": 8, "top_p": 0.7, "temperature": 1.3},
        {"top_k": 6, "min_p": 0.3},
        {"top_p": 0.8, "min_p": 0.1, "temperature": 0.8},
    ],
)
def test_sampled_frequencies_match_the_filtered_distribution(params):
    vocab, draws = 24, 4000
    logits = make_logits(1, vocab, seed=1, scale=1.5)
    expected = reference_kept(
        logits[0].tolist(),
        params.get("temperature", 1.0),
        params.get("top_k"),
        params.get("top_p", 1.0),
        params.get("min_p", 0.0),
    )
    rows = [row(seed=s, **params) for s in range(draws)]
    counts = Counter(token_ids(Sampler(vocab, [EOS]).sample(logits.expand(draws, -1), rows)))
    for token in range(vocab):
        if expected[token] == 0:
            assert counts[token] == 0, f"token {token} should have been filtered out"
        else:
            assert abs(counts[token] / draws - expected[token]) < 0.03, (token, counts)


@pytest.mark.parametrize("seeded", [True, False])
def test_draws_from_four_tokens_follow_softmax(seeded):
    logits = torch.tensor([[1.0, 0.5, -1.0, 0.2]])
    draws = 8000
    rows = [row(seed=s if seeded else None) for s in range(draws)]
    tokens = token_ids(Sampler(4, [EOS]).sample(logits.expand(draws, -1), rows))
    frequencies = torch.bincount(torch.tensor(tokens), minlength=4) / draws
    # About five standard deviations: an unseeded false alarm is a one-in-a-million event.
    assert torch.allclose(frequencies, torch.softmax(logits[0], -1), atol=0.03)


def reference_top_k_top_p(
    x: torch.Tensor, top_k: int | None, top_p: float
) -> tuple[torch.Tensor, bool]:
    """What top-k then top-p keep of one row, by a full sort in float64; and whether some token's
    preceding mass is so close to top_p that float32 rounding may decide it either way."""
    values, order = x.double().sort(descending=True)
    if top_k is not None:
        values[top_k:] = -math.inf
    probs = torch.softmax(values, -1)
    before = probs.cumsum(-1) - probs
    real = values > -math.inf
    keep_sorted = real & (before < top_p) if top_p < 1 else real
    kept = torch.zeros_like(x, dtype=torch.bool)
    kept[order[keep_sorted]] = True
    near = bool(((before - top_p).abs() < 2e-5)[real].any())
    return kept, near


@pytest.mark.parametrize("whole_rows", [False, True], ids=["widening", "whole-rows"])
@pytest.mark.parametrize("vocab", [7, 64, 300, 5000])
def test_top_k_top_p_threshold_matches_a_full_sort(vocab, whole_rows, monkeypatch):
    """The search as a CPU runs it (the largest 64 values first, widening where needed) and as
    a GPU does (whole rows at once), both against a full sort."""
    if whole_rows:
        monkeypatch.setattr(sampler_module, "_FIRST_CANDIDATES", 1 << 30)
    # Flat rows keep thousands of tokens (past the first candidates), peaked rows a handful.
    gen = torch.Generator().manual_seed(vocab)
    scales = [0.01, 0.3, 1.0, 3.0, 8.0]
    configs = [(None, 0.5), (None, 0.95), (5, 1.0), (50, 0.9), (None, 0.05), (2000, 0.99)]
    params, rows = [], []
    for scale in scales:
        for top_k, top_p in configs:
            params.append(SamplingParams(top_k=top_k, top_p=top_p))
            rows.append(torch.randn(vocab, generator=gen) * scale)
    x = torch.stack(rows)
    x -= x.amax(-1, keepdim=True)
    threshold = _filter_threshold(x, params)
    assert threshold is not None
    checked, largest_kept = 0, 0
    for i, p in enumerate(params):
        kept = x[i] >= threshold[i]
        top_k = p.top_k if p.top_k is not None and p.top_k < vocab else None
        expected, near = reference_top_k_top_p(x[i], top_k, p.top_p)
        if not near:
            assert torch.equal(kept, expected), (i, p, int(kept.sum()), int(expected.sum()))
            checked += 1
            largest_kept = max(largest_kept, int(kept.sum()))
    assert checked >= len(params) - 3
    if vocab == 5000:
        assert largest_kept > 1024  # the search had to widen to the whole row


def test_padding_columns_are_never_sampled_and_logits_are_not_modified():
    vocab = 50
    logits = torch.cat([make_logits(6, vocab, seed=2), torch.full((6, 14), 1e4)], dim=1)
    original = logits.clone()
    rows = [
        row(temperature=0.0, repetition_penalty=1.5, output=[1, 2]),
        row(seed=1, presence_penalty=1.0, output=[4]),
        row(min_tokens=2, stop_token_ids=[7]),
        row(top_k=3),
        row(top_p=0.5, logprobs=5),
        row(min_p=0.1),
    ]
    for _ in range(20):
        assert all(t < vocab for t in token_ids(Sampler(vocab, [EOS]).sample(logits, rows)))
    assert torch.equal(logits, original)


@pytest.mark.parametrize("banned", [False, True])
def test_plain_greedy_rows_read_the_logits_in_place(banned):
    """Greedy rows with nothing to edit pick from the real vocabulary of the logits as they are
    (no copy); a row that bans a token until min_tokens takes a copy. Neither edits the
    caller's logits, and both pick what argmax over the edited real vocabulary picks."""
    vocab = 50
    logits = torch.cat([make_logits(4, vocab, seed=5), torch.full((4, 14), 1e4)], dim=1)
    original = logits.clone()
    best = logits[:, :vocab].argmax(dim=-1).tolist()
    params = {"min_tokens": 1, "stop_token_ids": [best[2]]} if banned else {}
    rows = [row(temperature=0.0), row(temperature=0.0), row(temperature=0.0, **params)]
    rows.append(row(temperature=0.0))
    got = token_ids(Sampler(vocab, [EOS]).sample(logits, rows))
    if banned:
        edited = logits[2, :vocab].clone()
        edited[[best[2], EOS]] = float("-inf")
        best[2] = int(edited.argmax())
    assert got == best
    assert torch.equal(logits, original)


def test_bad_logits_shape_and_eos_are_rejected():
    with pytest.raises(ValueError, match="logits"):
        Sampler(10, [EOS]).sample(torch.zeros(2, 9), [row(), row()])
    with pytest.raises(ValueError, match="logits"):
        Sampler(10, [EOS]).sample(torch.zeros(3, 10), [row(), row()])
    with pytest.raises(ValueError, match="eos_token_ids"):
        Sampler(10, [10])
    assert Sampler(10, [EOS]).sample(torch.zeros(0, 10), []) == []


# --------------------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    vocab, stop = 8, 5
    logits = torch.zeros(1, vocab)
    logits[0, EOS], logits[0, stop], logits[0, 6] = 20.0, 19.0, 1.0
    sampler = Sampler(vocab, [EOS])

    def first(output_len: int, **params) -> int:
        rows = [row(output=[0] * output_len, min_tokens=3, stop_token_ids=[stop], **params)]
        return sampler.sample(logits, rows)[0].token_id

    assert [first(n, temperature=0.0) for n in range(5)] == [6, 6, 6, EOS, EOS]
    # ignore_eos: EOS may be sampled (the scheduler just does not stop on it); stop ids may not.
    assert first(0, temperature=0.0, ignore_eos=True) == EOS
    logits[0, stop] = 30.0
    assert first(0, temperature=0.0, ignore_eos=True) == EOS
    assert first(3, temperature=0.0, ignore_eos=True) == stop
    # Random rows too: EOS and the stop id carry almost all the mass, yet never come out.
    rows = [row(output=[1], min_tokens=2, stop_token_ids=[stop], seed=s) for s in range(500)]
    tokens = token_ids(sampler.sample(logits.expand(500, -1), rows))
    assert EOS not in tokens and stop not in tokens


def test_logit_bias_moves_sampling_but_not_reported_logprobs():
    vocab = 8
    logits = make_logits(3, vocab, seed=4)
    best = logits.argmax(dim=-1).tolist()
    sampler = Sampler(vocab, [EOS])
    rows = [
        row(temperature=0.0, logprobs=1, logit_bias={best[0]: -100.0}),
        row(temperature=0.0, logprobs=1, logit_bias={6: 100.0}),
        row(temperature=0.0, logprobs=1),  # a row without bias beside them is untouched
    ]
    results = sampler.sample(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    second = logits[0].clone()
    second[best[0]] = -math.inf
    assert token_ids(results) == [int(second.argmax()), 6, best[2]]
    for i, result in enumerate(results):
        assert result.logprob == pytest.approx(raw[i, result.token_id].item())
        assert result.top_logprobs[0][0] == best[i]  # alternatives from the raw logits too
    # At temperature 1 a -100 bias makes a token unreachable, whatever its mass.
    banned = [row(seed=s, logit_bias={best[0]: -100.0}) for s in range(300)]
    assert best[0] not in token_ids(sampler.sample(logits[:1].expand(300, -1), banned))


def test_allowed_token_ids_limit_sampling_but_not_reported_logprobs():
    """A whitelist leaves its row only the listed tokens, greedy or sampled, before the bias and
    the min_tokens ban (vLLM's order); logprobs still come from the raw logits, and a row
    without one beside it is untouched."""
    vocab = 10
    logits = make_logits(4, vocab, seed=7)
    best = logits.argmax(dim=-1).tolist()
    allowed = sorted({(best[0] + 1) % vocab, (best[0] + 4) % vocab})
    sampler = Sampler(vocab, [EOS])
    rows = [
        row(temperature=0.0, logprobs=1, allowed_token_ids=allowed),
        row(temperature=0.0, logprobs=1),
        # The bias acts among the allowed tokens only: 100 on a token outside them changes
        # nothing, on one inside them makes it the pick.
        row(temperature=0.0, allowed_token_ids=[1, 2], logit_bias={0: 100.0}),
        row(temperature=0.0, allowed_token_ids=[1, 2], logit_bias={2: 100.0}),
    ]
    results = sampler.sample(logits, rows)
    masked = torch.full((vocab,), -math.inf)
    masked[allowed] = logits[0, allowed]
    expected_third = 1 if logits[2, 1] >= logits[2, 2] else 2
    assert token_ids(results) == [int(masked.argmax()), best[1], expected_third, 2]
    raw = torch.log_softmax(logits, dim=-1)
    for i in (0, 1):
        assert results[i].logprob == pytest.approx(raw[i, results[i].token_id].item())
        assert results[i].top_logprobs[0][0] == best[i]
    # Sampled rows: only the allowed tokens come out, however little their mass; the whole
    # allowed set does, in proportion to their probabilities among themselves.
    spread = torch.zeros(1, vocab)
    spread[0, 0], spread[0, 5], spread[0, 6] = 30.0, 0.0, math.log(3.0)
    draws = [row(seed=s, allowed_token_ids=[5, 6]) for s in range(2000)]
    counts = Counter(token_ids(sampler.sample(spread.expand(2000, -1), draws)))
    assert set(counts) == {5, 6} and 0.2 < counts[5] / 2000 < 0.3
    # min_tokens bans EOS inside the whitelist too: the other allowed token comes out.
    banned = row(output=[], temperature=0.0, min_tokens=1, allowed_token_ids=[EOS, 7])
    eos_best = torch.zeros(1, vocab)
    eos_best[0, EOS] = 9.0
    assert token_ids(sampler.sample(eos_best, [banned])) == [7]


def test_a_whitelist_is_drawn_on_the_device_and_keeps_plain_rows_plain():
    """A whitelist reads no history, so a step launched ahead still draws its row from the
    logits alone; but the row is no plain argmax, so its logits are copied before the mask."""
    params = SamplingParams(temperature=0.0, allowed_token_ids=[1])
    assert sampler_module.draws_from_logits_alone(params, 0)
    assert not sampler_module.plain_argmax(params, 0)
    logits = make_logits(2, 6, seed=2)
    before = logits.clone()
    rows = [SamplingRow.of(params, [], []), row(temperature=0.0)]
    ids = Sampler(6, [EOS]).sample_ids(logits, rows).tolist()
    assert ids == [1, int(before[1].argmax())] and torch.equal(logits, before)


def test_bad_words_ban_the_token_that_would_complete_one():
    """A one-token word is never chosen; a longer word's last token only where the output
    (proposals under verification included, the prompt not) ends with the rest of it, ahead of
    min_tokens and the bias (vLLM's order); logprobs stay raw."""
    vocab = 8
    logits = torch.zeros(1, vocab)
    logits[0, 5], logits[0, 6], logits[0, 7] = 9.0, 8.0, 7.0
    sampler = Sampler(vocab, [EOS])
    words = [[5], [1, 2, 6]]

    def greedy(output, prompt=(), proposed=(), **params) -> SampledToken:
        params = {"temperature": 0.0, "bad_words_token_ids": words} | params
        row = SamplingRow(SamplingParams(**params), [*prompt, *output], len(prompt), proposed)
        return sampler.sample(logits, [row])[0]

    assert greedy([]).token_id == 6  # 5 is banned outright; [1, 2, 6] has no prefix yet
    assert greedy([1, 2]).token_id == 7  # the output ends with [1, 2]: 6 would complete it
    assert greedy([1, 2, 0]).token_id == 6
    assert greedy([2], prompt=[1]).token_id == 6  # the prompt does not count
    assert greedy([1], proposed=[2]).token_id == 7  # a proposal does
    # The bias cannot bring a banned token back; logprobs are the raw logits'.
    result = greedy([1, 2], logit_bias={6: 100.0}, logprobs=0)
    assert result.token_id == 7
    assert result.logprob == pytest.approx(torch.log_softmax(logits, -1)[0, 7].item())
    # Sampled rows never complete a word either, however much mass its last token has.
    seeded = [SamplingParams(seed=s, bad_words_token_ids=words) for s in range(300)]
    rows = [SamplingRow(params, [1, 2], 0) for params in seeded]
    assert {5, 6}.isdisjoint(token_ids(sampler.sample(logits.expand(300, -1), rows)))
    # A row reading its output is never drawn ahead of it, and never a plain argmax.
    params = SamplingParams(temperature=0.0, bad_words_token_ids=[[5]])
    assert not sampler_module.draws_from_logits_alone(params, 0)
    assert not sampler_module.plain_argmax(params, 0)


# --------------------------------------------------------------------------- penalties


def reference_penalties(logits, prompt, output, repetition, frequency, presence) -> list[float]:
    counts = Counter(output)
    seen = set(prompt) | set(output)
    result = []
    for token, logit in enumerate(logits):
        if token in seen:
            logit = logit / repetition if logit > 0 else logit * repetition
        logit -= frequency * counts[token] + presence * (counts[token] > 0)
        result.append(logit)
    return result


@st.composite
def penalised_batches(draw):
    vocab = draw(st.integers(1, 12))
    tokens = st.lists(st.integers(0, vocab - 1), max_size=20)
    logit = st.floats(-10, 10, width=32) | st.just(0.0)
    batch = []
    for _ in range(draw(st.integers(1, 5))):
        params = SamplingParams(
            temperature=0.0,
            repetition_penalty=draw(st.just(1.0) | st.floats(0.05, 5.0)),
            frequency_penalty=draw(st.just(0.0) | st.floats(-2.0, 2.0)),
            presence_penalty=draw(st.just(0.0) | st.floats(-2.0, 2.0)),
        )
        logits = draw(st.lists(logit, min_size=vocab, max_size=vocab))
        batch.append((logits, SamplingRow.of(params, draw(tokens), draw(tokens))))
    return vocab, batch


@settings(max_examples=150, deadline=None)
@given(penalised_batches())
def test_penalties_match_a_per_row_reference(case):
    vocab, batch = case
    logits = torch.tensor([logits for logits, _ in batch])
    rows = [r for _, r in batch]
    expected = [
        reference_penalties(
            values,
            r.prompt_token_ids,
            r.output_token_ids,
            r.params.repetition_penalty,
            r.params.frequency_penalty,
            r.params.presence_penalty,
        )
        for values, r in batch
    ]
    penalised = logits.clone()
    apply_penalties(penalised, rows)
    torch.testing.assert_close(penalised, torch.tensor(expected), rtol=1e-5, atol=1e-5)

    # The sampler applies them before a greedy argmax; compare rows with a clear winner only.
    tokens = token_ids(Sampler(vocab, []).sample(logits, rows))
    for token, values in zip(tokens, expected, strict=True):
        best = sorted(values, reverse=True)
        if len(best) == 1 or best[0] - best[1] > 1e-3:
            assert token == values.index(best[0])


def test_penalties_skip_rows_without_them():
    logits = make_logits(3, 10, seed=3)
    penalised = logits.clone()
    rows = [row(output=[1, 1]), row(output=[1, 1], presence_penalty=1.0), row(prompt=[2])]
    apply_penalties(penalised, rows)
    assert torch.equal(penalised[0], logits[0]) and torch.equal(penalised[2], logits[2])
    assert penalised[1, 1] == logits[1, 1] - 1.0


def test_penalised_token_ids_outside_the_vocabulary_are_rejected():
    # Flat positions row * V + token would otherwise penalise the next row's logits.
    rows = [row(prompt=[10], repetition_penalty=1.2), row(output=[-1], frequency_penalty=1.0)]
    for bad in rows:
        with pytest.raises(ValueError, match="token ids"):
            apply_penalties(torch.zeros(2, 10), [bad, row()])


# --------------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_come_from_the_raw_logits(dtype):
    vocab = 40
    logits = make_logits(4, vocab, seed=4).to(dtype)
    rows = [
        row(logprobs=5, temperature=0.0, repetition_penalty=2.0, prompt=[0, 1, 2]),
        row(logprobs=0, seed=1, temperature=0.5, top_k=3),
        row(),
        row(logprobs=20, seed=2, frequency_penalty=1.5, output=[5, 5, 6], top_p=0.5),
    ]
    results = Sampler(vocab, [EOS]).sample(logits, rows)
    raw = torch.log_softmax(logits.float(), -1)
    for i in (0, 1, 3):
        result, k = results[i], rows[i].params.logprobs
        assert result.logprob == pytest.approx(raw[i, result.token_id].item(), abs=1e-5)
        assert result.top_logprobs is not None and len(result.top_logprobs) == k
        values = [v for _, v in result.top_logprobs]
        assert values == sorted(values, reverse=True)
        for token, value in result.top_logprobs:
            assert value == pytest.approx(raw[i, token].item(), abs=1e-5)
        assert values == pytest.approx(raw[i].topk(k).values.tolist(), abs=1e-5)
    assert results[1].top_logprobs == []
    assert results[2].logprob is None and results[2].top_logprobs is None


# --------------------------------------------------------------------------- seeds


SEEDED_PARAMS = [
    {"seed": 11},
    {"seed": 12, "temperature": 0.7},
    {"seed": 13, "top_k": 20},
    {"seed": 14, "top_p": 0.9},
    {"seed": 15, "min_p": 0.05, "temperature": 1.4},
    {"seed": 16, "repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.2},
    {"seed": -17, "top_k": 50, "top_p": 0.8, "logprobs": 3},
]
VOCAB = 200


def step_logits(request: int | None, step: int) -> torch.Tensor:
    """The logits a model would give a request at a step: fixed, whatever else is batched."""
    return make_logits(1, VOCAB, seed=1000 * step + (999 if request is None else request))[0]


def run_steps(
    samplers: list[Sampler], requests: dict[int, dict], steps: int, shuffle_seed: int
) -> dict[int, list[int]]:
    """Generate ``steps`` tokens for each request (key -> params): step s runs on
    ``samplers[min(s, len(samplers) - 1)]``, so ``[prefill, decode]`` samples the first token on
    one and the rest on the other. Each batch holds the requests in a shuffled order among
    unseeded and greedy rows."""
    shuffle = random.Random(shuffle_seed)
    outputs: dict[int, list[int]] = {key: [] for key in requests}
    for step in range(steps):
        batch: list[tuple[int | None, SamplingRow]] = [
            (key, row(output=list(outputs[key]), prompt=[1, 2, 3], **params))
            for key, params in requests.items()
        ]
        batch += [(None, row(output=[0] * step)) for _ in range(shuffle.randrange(4))]
        batch += [(None, row(temperature=0.0)) for _ in range(shuffle.randrange(3))]
        shuffle.shuffle(batch)
        logits = torch.stack([step_logits(key, step) for key, _ in batch])
        sampler = samplers[min(step, len(samplers) - 1)]
        for (key, _), result in zip(
            batch, sampler.sample(logits, [r for _, r in batch]), strict=True
        ):
            if key is not None:
                outputs[key].append(result.token_id)
    return outputs


ALL_SEEDED = dict(enumerate(SEEDED_PARAMS))


def test_seeded_tokens_do_not_depend_on_the_batch_or_its_order():
    reference = run_steps([Sampler(VOCAB, [EOS])], ALL_SEEDED, steps=12, shuffle_seed=1)
    assert run_steps([Sampler(VOCAB, [EOS])], ALL_SEEDED, steps=12, shuffle_seed=2) == reference
    for key, params in ALL_SEEDED.items():
        alone = run_steps([Sampler(VOCAB, [EOS])], {key: params}, steps=12, shuffle_seed=3)
        assert alone[key] == reference[key]


def test_first_token_on_one_sampler_and_the_rest_on_another_equals_one_sampler():
    reference = run_steps([Sampler(VOCAB, [EOS])], ALL_SEEDED, steps=12, shuffle_seed=1)
    prefill, decode = Sampler(VOCAB, [EOS]), Sampler(VOCAB, [EOS])
    assert run_steps([prefill, decode], ALL_SEEDED, steps=12, shuffle_seed=5) == reference


def test_a_seeded_token_depends_only_on_seed_and_step():
    # Without penalties the history's content does not matter, only its length (the step).
    requests = {key: p for key, p in ALL_SEEDED.items() if "repetition_penalty" not in p}
    reference = run_steps([Sampler(VOCAB, [EOS])], requests, steps=8, shuffle_seed=1)
    history = random.Random(0)
    for key, params in requests.items():
        for step in (0, 3, 7):
            made_up = [history.randrange(VOCAB) for _ in range(step)]
            rows = [row(output=made_up, **params)]
            result = Sampler(VOCAB, [EOS]).sample(step_logits(key, step)[None], rows)
            assert result[0].token_id == reference[key][step]


def test_different_seeds_and_steps_draw_different_tokens():
    vocab, draws = 1000, 300
    flat = torch.zeros(draws, vocab)
    sampler = Sampler(vocab, [EOS])
    # Uniform over 1000 tokens, 300 independent draws hit about 259 distinct tokens.
    by_seed = token_ids(sampler.sample(flat, [row(seed=s) for s in range(draws)]))
    by_step = token_ids(sampler.sample(flat, [row(output=[0] * s, seed=7) for s in range(draws)]))
    high_bits = token_ids(sampler.sample(flat, [row(seed=s << 32) for s in range(draws)]))
    negative = token_ids(sampler.sample(flat, [row(seed=-s - 1) for s in range(draws)]))
    for tokens in (by_seed, by_step, high_bits, negative):
        assert len(set(tokens)) > 220
    assert sum(a == b for a, b in zip(by_seed, high_bits, strict=True)) < 10
