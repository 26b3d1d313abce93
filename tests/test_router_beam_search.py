"""Beam search (use_beam_search): the search against exhaustive enumeration on a toy model, and
the router serving it over HTTP against fake workers that speak the same toy model."""

from __future__ import annotations

import json
import math
import random
import socket

import pytest
from beam_reference import reference_beam_search
from router_fakes import FakeWorker, model_text, router_server, wait_until

from common.model.default_model import resolve_model_path
from common.protocol import AbortRequest, PrefillRequest, TokenSample
from router.beam_search import BeamSearch, BeamSearchParams
from router.policy import RoutingConfig

MODEL = resolve_model_path(None)
EOS = 2  # the default model's eos_token_id


def toy_logprobs(sequence: list[int], vocab: list[int]) -> dict[int, float]:
    """A made-up next-token distribution over ``vocab``, a fixed function of the sequence."""
    rng = random.Random(",".join(map(str, sequence)))
    logits = [rng.gauss(0.0, 2.0) for _ in vocab]
    top = max(logits)
    norm = top + math.log(sum(math.exp(x - top) for x in logits))
    return {token: x - norm for token, x in zip(vocab, logits, strict=True)}


def as_sample(dist: dict[int, float], count: int) -> TokenSample:
    """What a worker answers for one greedy token with ``count`` logprobs."""
    ranked = sorted(dist.items(), key=lambda item: -item[1])
    best = ranked[0]
    top = ranked[:count]
    return TokenSample(best[0], best[1], [t for t, _ in top], [lp for _, lp in top])


def exhaustive(prompt, vocab, eos, max_tokens, width, penalty, decode=None, stop=()):
    """Every sequence beam search could answer (ended by EOS, a stop string or its length), by
    enumeration; the ``width`` best by cumulative logprob / (prompt + generated) ** penalty."""
    ended = []

    def grow(tokens: list[int], cum: float) -> None:
        for token, lp in toy_logprobs(prompt + tokens, vocab).items():
            if token == eos:
                ended.append((tokens, cum + lp, "stop"))
                continue
            longer = [*tokens, token]
            text = decode(longer) if stop else ""
            if any(s in text for s in stop):
                ended.append((longer, cum + lp, "stop"))
            elif len(longer) == max_tokens:
                ended.append((longer, cum + lp, "length"))
            else:
                grow(longer, cum + lp)

    grow([], 0.0)
    ended.sort(key=lambda e: e[1] / (len(prompt) + len(e[0])) ** penalty, reverse=True)
    return ended[:width]


def run_search(prompt, vocab, params: BeamSearchParams, decode=lambda ids: ""):
    search = BeamSearch(prompt, params, decode)
    while not search.done:
        search.advance(
            [as_sample(toy_logprobs(seq, vocab), 2 * params.width) for seq in search.pending()]
        )
    return search.best()


def assert_same(beams, expected) -> None:
    assert [(b.tokens, b.finish_reason) for b in beams] == [(t, r) for t, _, r in expected]
    for beam, (_, cum, _) in zip(beams, expected, strict=True):
        assert beam.cum_logprob == pytest.approx(cum, abs=1e-9)


@pytest.mark.parametrize("penalty", [0.0, 1.0, 2.5, -1.0])
def test_a_beam_as_wide_as_every_sequence_finds_the_best_of_all_of_them(penalty):
    """Tokens 10, 11 and EOS, three steps: 15 possible answers, never more than 8 live, so ten
    beams keep everything and the answer is the ten best of the full enumeration."""
    prompt, vocab = [5, 6, 7], [10, 11, EOS]
    params = BeamSearchParams(10, 3, penalty, frozenset({EOS}))
    assert_same(run_search(prompt, vocab, params), exhaustive(prompt, vocab, EOS, 3, 10, penalty))


@pytest.mark.parametrize("width", [1, 2, 3])
def test_narrow_beams_equal_plain_beam_search_over_the_whole_vocabulary(width):
    vocab = [*range(10, 16), EOS]
    for seed in range(20):
        prompt = [seed, seed + 1]
        params = BeamSearchParams(width, 6, 1.0, frozenset({EOS}))
        model = lambda seq: toy_logprobs(seq, vocab)  # noqa: E731
        expected = reference_beam_search(prompt, model, EOS, width, 6, 1.0)
        assert_same(run_search(prompt, vocab, params), expected)


def test_stop_strings_and_stop_tokens_end_beams_without_taking_a_slot():
    """A beam whose text comes to hold a stop string ends there, its text cut before it; a stop
    token ends a beam like EOS; with ignore_eos, EOS is an ordinary token."""
    prompt, vocab = [1, 2, 3], [10, 11, EOS]
    letters = {10: "a", 11: "b", EOS: "$"}

    def decode(ids):
        return "".join(letters[t] for t in ids)

    params = BeamSearchParams(10, 3, 1.0, frozenset({EOS}), stop=("ba",))
    beams = run_search(prompt, vocab, params, decode)
    expected = exhaustive(prompt, vocab, EOS, 3, 10, 1.0, decode, stop=("ba",))
    assert_same(beams, expected)
    cut = [b for b in beams if b.stop_reason == "ba"]
    assert cut and all(b.text == decode(b.tokens).split("ba")[0] for b in cut)
    assert all("ba" not in decode(b.tokens) for b in beams if b.stop_reason != "ba")
    # include_stop_str_in_output: the same beams, their text cut after the stop string.
    including = BeamSearchParams(10, 3, 1.0, frozenset({EOS}), stop=("ba",), include_stop_str=True)
    kept = run_search(prompt, vocab, including, decode)
    assert [b.tokens for b in kept] == [b.tokens for b in beams]
    assert [b.text for b in kept if b.stop_reason == "ba"] == [b.text + "ba" for b in cut]

    as_stop_token = BeamSearchParams(10, 3, 1.0, frozenset(), stop_token_ids=frozenset({EOS}))
    assert_same(run_search(prompt, vocab, as_stop_token), exhaustive(prompt, vocab, EOS, 3, 10, 1))
    assert {b.stop_reason for b in run_search(prompt, vocab, params)} >= {EOS}

    ignoring = BeamSearchParams(10, 3, 1.0, frozenset({EOS}), ignore_eos=True)
    beams = run_search(prompt, vocab, ignoring)
    assert all(b.finish_reason == "length" and len(b.tokens) == 3 for b in beams)
    assert any(EOS in b.tokens for b in beams)


def test_reported_logprobs_are_each_tokens_own_with_the_asked_alternatives():
    prompt, vocab = [4, 4], [*range(10, 20), EOS]
    params = BeamSearchParams(2, 4, 1.0, frozenset({EOS}), logprobs=3)
    assert params.step_params().logprobs == 4  # 2 * width; more when the client asks more
    assert BeamSearchParams(2, 4, logprobs=7).step_params().logprobs == 7
    for beam in run_search(prompt, vocab, params):
        assert len(beam.samples) == len(beam.tokens)
        total = 0.0
        for i, sample in enumerate(beam.samples):
            dist = toy_logprobs(prompt + beam.tokens[:i], vocab)
            assert sample.token_id == beam.tokens[i]
            assert sample.logprob == dist[sample.token_id]
            assert sample.top_token_ids == sorted(dist, key=lambda t: -dist[t])[:3]
            total += sample.logprob
        if beam.finish_reason == "length":
            assert beam.cum_logprob == pytest.approx(total)


# -- over HTTP ---------------------------------------------------------------------------------

WORDS = [" cat", " dog", " bird"]


def toy_vocab() -> list[int]:
    return [model_text(MODEL).encode(word, add_special_tokens=False)[0] for word in WORDS] + [EOS]


class ToyWorker(FakeWorker):
    """A prefill fake whose one token answers the toy model for the request's prompt."""

    def _handle(self, sock, msg) -> None:
        if isinstance(msg, PrefillRequest):
            self.prompt = msg.prompt_token_ids
        super()._handle(sock, msg)

    def _sample(self, index, params) -> TokenSample:
        if index != 0 or params.max_tokens != 1:
            return super()._sample(index, params)
        return as_sample(toy_logprobs(self.prompt, toy_vocab()), params.logprobs or 0)


@pytest.fixture(scope="module")
def router():
    # Every prompt goes to the prefill fake, which answers a one-token request itself.
    with router_server(MODEL, routing=RoutingConfig(remote_prefill_min_tokens=1)) as router:
        hub: dict = {}
        router.workers += [ToyWorker(router.control, "p0", "prefill", MODEL.name, hub),
                           FakeWorker(router.control, "d0", "decode", MODEL.name, hub)]  # fmt: skip
        for worker in router.workers:
            worker.start()
            assert worker.ready.wait(30)
        router.wait_for_workers(1, 1)
        yield router


def post(router, path: str, expect: int = 200, **body) -> dict:
    with router.client() as h:
        r = h.post(path, json={"model": MODEL.name, "use_beam_search": True, **body})
        assert r.status_code == expect, r.text
        return r.json()


def test_completions_answer_the_best_beams_of_each_prompt_in_order(router):
    """vLLM's test_batch_completions: two copies of a prompt, n=2 beams each: choice p * n + b
    is prompt p's beam b, best first; each equals the exhaustive search's."""
    codec = model_text(MODEL)
    text_prompt = "Hello, my name is"
    for prompt in ([text_prompt] * 2, [[0, 0, 0, 0, 0]] * 2):
        body = post(router, "/v1/completions", prompt=prompt, n=2, max_tokens=3, temperature=0,
                    return_token_ids=True)  # fmt: skip
        choices = body["choices"]
        ids = codec.encode(text_prompt) if prompt[0] == text_prompt else prompt[0]
        expected = exhaustive(ids, toy_vocab(), EOS, 3, 2, 1.0)
        assert [c["index"] for c in choices] == [0, 1, 2, 3]
        for c, (tokens, _, reason) in zip(choices, expected * 2, strict=True):
            assert c["token_ids"] == tokens
            assert c["text"] == codec.decode(tokens)
            assert c["finish_reason"] == reason
            assert c["stop_reason"] == (EOS if reason == "stop" else None)
        assert choices[0]["text"] != choices[1]["text"]
        assert body["usage"]["completion_tokens"] == 2 * sum(len(t) for t, _, _ in expected)
        assert body["usage"]["prompt_tokens"] == 2 * len(ids)


def test_each_step_is_one_token_per_live_beam_with_twice_the_width_of_logprobs(router):
    worker = router.workers[0]
    before = len(worker.received)
    post(router, "/v1/completions", prompt=[7, 8, 9], n=3, max_tokens=4)
    steps = [m for m in worker.received[before:] if isinstance(m, PrefillRequest)]
    assert steps and len(steps) <= 1 + 3 * 3
    assert all(m.params.max_tokens == 1 and m.params.logprobs == 6 for m in steps)
    assert all(m.params.temperature == 0 for m in steps)  # the request's 1.0 chooses nothing
    assert steps[0].prompt_token_ids == [7, 8, 9]
    assert not router.app.state.dispatcher.generations


def test_logprobs_length_penalty_and_stop_strings(router):
    prompt = [11, 12, 13]
    vocab = toy_vocab()
    for penalty in (0.0, 2.0):
        choices = post(router, "/v1/completions", prompt=prompt, n=3, max_tokens=3,
                       length_penalty=penalty, return_token_ids=True)["choices"]  # fmt: skip
        expected = exhaustive(prompt, vocab, EOS, 3, 3, penalty)
        assert [c["token_ids"] for c in choices] == [t for t, _, _ in expected]
    codec = model_text(MODEL)
    for choice in post(router, "/v1/completions", prompt=prompt, n=2, max_tokens=3, logprobs=2,
                       return_token_ids=True)["choices"]:  # fmt: skip
        logprobs, ids = choice["logprobs"], choice["token_ids"]
        assert "".join(logprobs["tokens"]) == choice["text"]
        for i, token_id in enumerate(ids):
            dist = toy_logprobs(prompt + ids[:i], vocab)
            assert logprobs["token_logprobs"][i] == pytest.approx(dist[token_id])
            # The legacy top_logprobs: the token itself, then the two most likely.
            best = sorted(dist, key=lambda t: -dist[t])[:2]
            names = [codec.decode([t], skip_special_tokens=False) for t in [token_id, *best]]
            assert list(logprobs["top_logprobs"][i]) == list(dict.fromkeys(names))
    cut = post(router, "/v1/completions", prompt=prompt, n=3, max_tokens=3, stop=[" dog"])
    for c in cut["choices"]:
        assert " dog" not in c["text"]
        assert c["stop_reason"] in (" dog", EOS, None)
    kept = post(router, "/v1/completions", prompt=prompt, n=3, max_tokens=3, stop=[" dog"],
                include_stop_str_in_output=True)  # fmt: skip
    assert [c["text"] for c in kept["choices"]] == [
        c["text"] + (" dog" if c["stop_reason"] == " dog" else "") for c in cut["choices"]
    ]


def test_chat_beam_search_plain_and_streamed(router):
    messages = [{"role": "user", "content": "hi"}]
    plain = post(router, "/v1/chat/completions", messages=messages, n=2, max_tokens=3)
    texts = [c["message"]["content"] for c in plain["choices"]]
    assert len(texts) == 2 and texts[0] != texts[1]
    with router.client() as h:
        r = h.post("/v1/chat/completions", json={"model": MODEL.name, "use_beam_search": True,
                   "messages": messages, "n": 2, "max_tokens": 3, "stream": True})  # fmt: skip
        assert r.status_code == 200, r.text
    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    streamed = ["", ""]
    for chunk in map(json.loads, events[:-1]):
        for c in chunk["choices"]:
            streamed[c["index"]] += c["delta"].get("content") or ""
    assert streamed == texts


REFUSED = [
    ("/v1/completions", {"stream": True}, "stream", "Streaming is not currently supported"),
    ("/v1/completions", {"n": 11}, "n", "beam width"),
    ("/v1/completions", {"n": 0}, "n", "n must be in"),
    ("/v1/completions", {"echo": True, "logprobs": 1}, "echo", "prompt logprobs"),
    ("/v1/completions", {"prompt_logprobs": 1}, "prompt_logprobs", "beam search"),
    ("/v1/completions", {"logit_bias": {"5": 10}}, "logit_bias", "beam search"),
    ("/v1/completions", {"allowed_token_ids": [5, 6]}, "allowed_token_ids", "beam search"),
    ("/v1/completions", {"bad_words": ["no"]}, "bad_words", "beam search"),
    ("/v1/chat/completions", {"presence_penalty": 0.5}, "presence_penalty", "beam search"),
    ("/v1/chat/completions", {"repetition_penalty": 1.2}, "repetition_penalty", "beam search"),
    ("/v1/chat/completions", {"min_tokens": 2}, "min_tokens", "beam search"),
    ("/v1/chat/completions", {"n": 1000}, "n", "n must be in"),
    ("/v1/completions", {"length_penalty": "long"}, "length_penalty", ""),
]


@pytest.mark.parametrize(("path", "fields", "param", "words"), REFUSED)
def test_what_beam_search_cannot_honour_is_a_clear_400(router, path, fields, param, words):
    prompt = (
        {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    )
    error = post(router, path, 400, max_tokens=2, **prompt, **fields)["error"]
    assert error["param"] == param
    assert words in error["message"]
    assert error["type"] == "invalid_request_error"


def test_a_client_gone_mid_search_leaves_nothing_in_flight(router):
    """The toy prefill worker holds its requests: the search waits on its first step, the
    client goes, and the step is aborted on the worker."""
    worker = router.workers[0]
    worker.hold_prefills.set()
    body = json.dumps({"model": MODEL.name, "use_beam_search": True, "prompt": [3, 4], "n": 2,
                       "max_tokens": 3}).encode()  # fmt: skip
    host, port = router.base_url.removeprefix("http://").split(":")
    try:
        with socket.create_connection((host, int(port))) as conn:
            conn.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            wait_until(lambda: worker.held)
        dispatcher = router.app.state.dispatcher
        wait_until(lambda: not dispatcher.generations)
        wait_until(lambda: any(isinstance(m, AbortRequest) for m in worker.received))
    finally:
        worker.hold_prefills.clear()


def test_no_worker_is_503():
    with router_server(MODEL) as bare:
        body = post(bare, "/v1/completions", 503, prompt="hi", n=2, max_tokens=2)
        assert body["error"]["code"] == "no_worker"
