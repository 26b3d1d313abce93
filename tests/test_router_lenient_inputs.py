"""Hostile but valid requests that the router once answered 200 and vLLM does not: each now gets
vLLM's answer (a 400 in its words, or the same clamp), or a 400 naming the field; and what one
request may ask to generate in all, n x prompts x max_tokens, is bounded (--max-request-tokens).
"""

from __future__ import annotations

import pytest
from router_fakes import model_text, router_with_a_pair

from common.model.default_model import resolve_model_path
from common.protocol import DecodeRequest, PrefillRequest
from common.sampling_params import SamplingParams
from router.openai_api import CompletionBody, to_generation
from router.server import build_parser, config_from_args

MODEL = resolve_model_path(None)
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def router():
    with router_with_a_pair(MODEL) as router:
        yield router


def sent_params(router, request_id: str) -> SamplingParams:
    """The sampling params the router sent a worker for the request it answered as
    ``request_id`` (its X-Request-Id)."""
    for worker in router.workers:
        for msg in worker.received:
            if isinstance(msg, PrefillRequest | DecodeRequest) and request_id in msg.request_id:
                return msg.params
    raise AssertionError(f"no worker received {request_id}")


@pytest.mark.parametrize(
    ("path", "body", "param", "phrase"),
    [
        (COMPLETIONS, {"stop": [""]}, "stop", "stop cannot contain an empty string"),
        (COMPLETIONS, {"stop": ""}, "stop", "stop cannot contain an empty string"),
        (COMPLETIONS, {"temperature": 1e6}, "temperature", "temperature must be in [0, 2]"),
        (CHAT, {"temperature": 2.01}, "temperature", "temperature must be in [0, 2]"),
        (COMPLETIONS, {"n": 2, "temperature": 0}, "n", "n must be 1 when using greedy sampling"),
        (CHAT, {"n": 4, "temperature": 0}, "n", "n must be 1 when using greedy sampling"),
        (COMPLETIONS, {"n": 3, "best_of": 1}, "best_of", "best_of must be greater than or equal"),
        (
            COMPLETIONS,
            {"stop_token_ids": list(range(1025))},
            "stop_token_ids",
            "at most 1024 distinct token ids, got 1025",
        ),
        (
            COMPLETIONS,
            {"logit_bias": {str(i): 1.0 for i in range(1025)}},
            "logit_bias",
            "at most 1024 entries, got 1025",
        ),
        (COMPLETIONS, {"prompt": ["a"] * 1025}, "prompt", "at most 1024 prompts, got 1025"),
        (
            COMPLETIONS,
            {"prompt": ["a"] * 8, "n": 128, "max_tokens": 1025},
            "max_tokens",
            "over the router's limit of 1048576 per request (--max-request-tokens)",
        ),
    ],
    ids=[
        "stop-empty-in-list",
        "stop-empty",
        "temperature-1e6",
        "temperature-chat",
        "n-greedy",
        "n-greedy-chat",
        "best_of-below-n",
        "stop_token_ids-many",
        "logit_bias-many",
        "prompts-many",
        "n128-over-8-prompts",
    ],
)
def test_a_once_lenient_input_gets_a_400_naming_its_field(router, path, body, param, phrase):
    base = {"model": MODEL.name, "max_tokens": 2}
    base |= {"messages": HI} if path == CHAT else {"prompt": "hi"}
    with router.client() as h:
        r = h.post(path, json=base | body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and phrase in error["message"], error


def test_a_tiny_temperature_is_raised_to_vllms_floor(router):
    body = {"model": MODEL.name, "prompt": "hi", "max_tokens": 2, "temperature": 1e-9}
    with router.client() as h:
        r = h.post(COMPLETIONS, json=body, headers={"X-Request-Id": "tiny-temperature"})
    assert r.status_code == 200, r.text
    assert sent_params(router, "tiny-temperature").temperature == 0.01


def test_repeated_stop_token_ids_travel_once(router):
    """vLLM keeps each stop token id once: a list of one id repeated is accepted, and the worker
    receives one id, not a frame too large to take."""
    body = {"model": MODEL.name, "prompt": "hi", "max_tokens": 2, "stop_token_ids": [7] * 200_000}
    with router.client() as h:
        r = h.post(COMPLETIONS, json=body, headers={"X-Request-Id": "repeated-stops"})
    assert r.status_code == 200, r.text
    assert sent_params(router, "repeated-stops").stop_token_ids == [7]


def test_greedy_beams_and_sampled_choices_still_take_n(router):
    with router.client() as h:
        sampled = {"model": MODEL.name, "prompt": "hi", "max_tokens": 2, "n": 3, "seed": 1}
        assert len(h.post(COMPLETIONS, json=sampled).json()["choices"]) == 3
        beams = sampled | {"temperature": 0, "use_beam_search": True, "n": 2}
        r = h.post(COMPLETIONS, json=beams)
        assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text


def test_a_long_session_id_is_routed_by_a_digest_and_an_empty_one_by_none():
    """vLLM takes a `user` of any length; routing needs only a stable key, so a long one is
    hashed once, not at every routing of every choice."""
    text = model_text(MODEL)

    def session(user, header=None):
        body = CompletionBody.model_validate({"prompt": "hi", "user": user})
        return to_generation(body, text, 2048, header).session_id

    long = "u" * (1 << 20)
    key = session(long)
    assert key is not None and len(key) < 64 and key == session(long) != session(long + "v")
    assert session("alice") == "alice" and session("", "") is None and session("", "s1") == "s1"
    assert session(None, long) == key


@pytest.fixture(scope="module")
def small_budget():
    with router_with_a_pair(MODEL, max_request_tokens=64) as router:
        yield router


@pytest.mark.parametrize(
    ("path", "body", "param", "total"),
    [
        (COMPLETIONS, {"prompt": ["a", "b"], "n": 4, "max_tokens": 9}, "max_tokens", 72),
        (CHAT, {"messages": HI, "max_completion_tokens": 65}, "max_completion_tokens", 65),
        (
            COMPLETIONS,
            {"prompt": "hi", "use_beam_search": True, "n": 8, "max_tokens": 9},
            "max_tokens",
            72,
        ),
    ],
    ids=["n-x-prompts-x-max_tokens", "max_completion_tokens", "beams"],
)
def test_a_request_over_the_token_limit_is_a_400_naming_it(small_budget, path, body, param, total):
    with small_budget.client() as h:
        r = h.post(path, json={"model": MODEL.name} | body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert f"up to {total} tokens" in error["message"], error
    assert "over the router's limit of 64 per request" in error["message"], error


def test_a_request_at_the_token_limit_is_served(small_budget):
    with small_budget.client() as h:
        body = {"model": MODEL.name, "prompt": ["a", "b"], "n": 4, "max_tokens": 8, "seed": 1}
        r = h.post(COMPLETIONS, json=body)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 8
        chat = {"model": MODEL.name, "messages": HI, "max_completion_tokens": 64}
        assert h.post(CHAT, json=chat).status_code == 200


def test_the_token_limit_counts_the_default_max_tokens(small_budget):
    """A chat request without max_tokens may run to the end of the context: that is what counts."""
    with small_budget.client() as h:
        r = h.post(CHAT, json={"model": MODEL.name, "messages": HI})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "max_tokens" and "by default" in error["message"], error


def test_the_token_limit_is_a_router_flag():
    parser = build_parser()
    assert parser.parse_args([]).max_request_tokens == 1 << 20
    assert "--max-request-tokens" in parser.format_help()
    text = model_text(MODEL)
    args = parser.parse_args(["--max-request-tokens", "5000"])
    assert config_from_args(args, text, MODEL).max_request_tokens == 5000
    with pytest.raises(ValueError, match="--max-request-tokens must be >= 1"):
        config_from_args(parser.parse_args(["--max-request-tokens", "0"]), text, MODEL)
