"""vLLM's answer fields the router fills in itself: ``stop_reason`` (what ended a choice) and the
echoed prompt of token ids (special tokens included), against fake workers on real sockets."""

from __future__ import annotations

import json

import pytest
from router_fakes import model_text, router_with_a_pair

from common.model.default_model import resolve_model_path

MODEL = resolve_model_path(None)
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def router():
    with router_with_a_pair(MODEL) as router:
        yield router


def post(router, path: str, **body) -> dict:
    with router.client() as h:
        r = h.post(path, json={"model": MODEL.name, "max_tokens": 8, **body})
        assert r.status_code == 200, r.text
        return r.json()


def stream(router, path: str, **body) -> list[dict]:
    with router.client() as h:
        r = h.post(path, json={"model": MODEL.name, "max_tokens": 8, "stream": True, **body})
        assert r.status_code == 200, r.text
        lines = [line.removeprefix("data: ") for line in r.text.split("\n\n") if line]
        assert lines[-1] == "[DONE]"
        return [json.loads(line) for line in lines[:-1]]


# The fake workers answer token 1000 + position: a stop token id or the text of one of those
# tokens ends a choice there.
STOP_TOKEN = 1003


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stop_reason_is_the_stop_token_or_string_that_ended_the_choice(router, path):
    prompt = {"messages": CHAT} if "chat" in path else {"prompt": "hi"}
    stop_text = model_text(MODEL).decode([1004], skip_special_tokens=False)
    cases = [
        ({"stop_token_ids": [STOP_TOKEN]}, "stop", STOP_TOKEN),
        ({"stop": ["no such text", stop_text]}, "stop", stop_text),
        ({}, "length", None),  # ran to max_tokens: nothing to name
    ]
    for fields, finish, reason in cases:
        choice = post(router, path, **prompt, **fields)["choices"][0]
        assert (choice["finish_reason"], choice["stop_reason"]) == (finish, reason), fields
        chunks = [c for c in stream(router, path, **prompt, **fields) if c["choices"]]
        ends = [c["choices"][0] for c in chunks if c["choices"][0]["finish_reason"]]
        assert [(e["finish_reason"], e["stop_reason"]) for e in ends] == [(finish, reason)]
        # Every chunk carries the key, null until the choice ends.
        assert all(c["choices"][0]["stop_reason"] is None for c in chunks[:-1])
    ended = post(router, path, **prompt, stop_token_ids=[STOP_TOKEN])
    assert ended["usage"]["completion_tokens"] == STOP_TOKEN - 1000 + 1


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_included_stop_string_ends_the_text_streamed_or_not(router, path):
    """vLLM's include_stop_str_in_output: the text runs through the stop string that ended the
    choice instead of stopping before it, streamed the same as not."""
    prompt = {"messages": CHAT} if "chat" in path else {"prompt": "hi"}
    stop_text = model_text(MODEL).decode([1004], skip_special_tokens=False)

    def text_of(choice: dict) -> str:
        return choice["text"] if "text" in choice else choice["message"]["content"]

    def streamed_text(**fields) -> str:
        chunks = [c["choices"][0] for c in stream(router, path, **prompt, **fields) if c["choices"]]
        return "".join(c.get("text") or c.get("delta", {}).get("content") or "" for c in chunks)

    cut = text_of(post(router, path, **prompt, stop=[stop_text])["choices"][0])
    choice = post(router, path, **prompt, stop=[stop_text], include_stop_str_in_output=True)
    kept = choice["choices"][0]
    assert text_of(kept) == cut + stop_text and kept["stop_reason"] == stop_text
    assert streamed_text(stop=[stop_text], include_stop_str_in_output=True) == cut + stop_text
    assert streamed_text(stop=[stop_text]) == cut


def _assert_offsets_agree(text: str, logprobs: dict) -> None:
    for token, offset in zip(logprobs["tokens"], logprobs["text_offset"], strict=True):
        assert text[offset : offset + len(token)] == token, (token, offset, text)


def test_an_echoed_prompt_of_special_token_ids_keeps_them(router):
    """As vLLM does: the text holds the special tokens that logprobs.tokens and text_offset
    name and count, so the three agree."""
    codec = model_text(MODEL)
    special = codec.decode([0], skip_special_tokens=False)
    assert codec.decode([0]) != special, "token 0 is no special token of this model"
    prompt = [0] * 5
    choice = post(router, "/v1/completions", prompt=prompt, echo=True, logprobs=1)["choices"][0]
    assert choice["text"].startswith(special * 5)
    assert choice["logprobs"]["tokens"][:5] == [special] * 5
    _assert_offsets_agree(choice["text"], choice["logprobs"])
    chunks = stream(router, "/v1/completions", prompt=prompt, echo=True, logprobs=1)
    text = "".join(c["choices"][0]["text"] for c in chunks)
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert text == choice["text"]
    _assert_offsets_agree(text, {"tokens": tokens, "text_offset": offsets})
    # Without logprobs the echo is the same text.
    plain = post(router, "/v1/completions", prompt=prompt, echo=True)["choices"][0]
    assert plain["text"] == choice["text"]
