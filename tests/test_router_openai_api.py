"""OpenAI request parsing and validation, without a server."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from router.errors import APIError
from router.openai_api import ChatBody, CompletionBody, TextCodec, to_generation


class Codec(TextCodec):
    vocab_size = 1000

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 1000 for c in text]

    def encode_chat(
        self, messages, add_generation_prompt=True, continue_final_message=False, kwargs=None
    ):
        body = [ord(c) % 1000 for m in messages for c in m["content"]]
        return [1, *body] + ([] if continue_final_message else [2])

    def decode(self, token_ids, skip_special_tokens=True):
        return "".join(chr(t) for t in token_ids)


def parse(body: dict, max_len: int = 100, session: str | None = None, default=None):
    model = ChatBody if "messages" in body else CompletionBody
    return to_generation(model.model_validate(body), Codec(), max_len, session, default)


def test_completion_defaults_and_prompt_forms():
    g = parse({"model": "m", "prompt": "abc"})
    assert g.params.max_tokens == 16 and g.params.temperature == 1.0 and g.n == 1
    assert [p.token_ids for p in g.prompts] == [[97, 98, 99]]
    assert len(parse({"model": "m", "prompt": ["ab", "cd"]}).prompts) == 2
    assert parse({"model": "m", "prompt": [5, 6]}).prompts[0].token_ids == [5, 6]
    assert len(parse({"model": "m", "prompt": [[5], [6, 7]]}).prompts) == 2


def test_sampling_fields_map_to_params():
    g = parse(
        {
            "model": "m",
            "prompt": "x",
            "max_tokens": 5,
            "temperature": 0.5,
            "top_p": 0.5,
            "top_k": 4,
            "min_p": 0.1,
            "seed": 7,
            "stop": "zz",
            "stop_token_ids": [3],
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "repetition_penalty": 1.2,
            "logprobs": 3,
            "ignore_eos": True,
            "min_tokens": 2,
            "n": 3,
            "user": "u1",
        }
    )
    p = g.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (5, 0.5, 0.5, 4, 0.1)
    assert (p.logprobs, p.stop_token_ids, p.ignore_eos, p.min_tokens) == (3, [3], True, 2)
    assert g.stop == ["zz"] and g.session_id == "u1"
    assert [g.params_for_choice(i).seed for i in range(3)] == [7, 8, 9]


def test_chat_logprobs_and_max_completion_tokens():
    g = parse(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True,
            "top_logprobs": 2,
            "max_completion_tokens": 9,
        },
        session="s",
    )
    assert g.chat and g.logprobs == 2 and g.params.max_tokens == 9 and g.session_id == "s"
    # Without max_tokens, a chat request may use the rest of the context.
    g = parse({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert g.params.max_tokens == 100 - 4
    # ... unless the server caps it (--max-tokens-default); an explicit max_tokens is kept.
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert parse(chat, default=10).params.max_tokens == 10
    assert parse(chat, default=1000).params.max_tokens == 100 - 4
    assert parse(chat | {"max_tokens": 50}, default=10).params.max_tokens == 50


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "min_tokens": 99}, "min_tokens"),
        ({"prompt": "x", "stop_token_ids": [5000]}, "stop_token_ids"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [2000]}, "prompt"),
        ({"prompt": "x" * 100}, "prompt"),
        ({"prompt": "x" * 50, "max_tokens": 51}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_bad_values_raise_400_naming_the_parameter(body, param):
    with pytest.raises(APIError) as info:
        parse({"model": "m", **body})
    assert info.value.status == 400 and info.value.param == param


def test_context_limit_message_names_the_limit():
    with pytest.raises(APIError, match="maximum context length is 100 tokens"):
        parse({"model": "m", "prompt": "x" * 100})


def test_schema_errors_are_pydantic_errors():
    with pytest.raises(ValidationError):
        CompletionBody.model_validate({"model": "m", "prompt": 5})
    with pytest.raises(ValidationError):
        ChatBody.model_validate({"model": "m", "messages": []})


@pytest.mark.parametrize(
    ("seed", "kind"), [(1 << 63, "less_than_equal"), (-(1 << 63) - 1, "greater_than_equal")]
)
def test_a_seed_is_a_signed_64_bit_integer(seed, kind):
    """As in OpenAI's schema and vLLM: the schema refuses it, with pydantic's error type."""
    with pytest.raises(ValidationError) as info:
        CompletionBody.model_validate({"model": "m", "prompt": "x", "seed": seed})
    assert info.value.errors()[0]["type"] == kind and info.value.errors()[0]["loc"] == ("seed",)
    for edge in ((1 << 63) - 1, -(1 << 63)):
        assert parse({"model": "m", "prompt": "x", "seed": edge}).params.seed == edge
    # The n choices of a seed at the top take seed + index, wrapped into the signed range.
    g = parse({"model": "m", "prompt": "x", "seed": (1 << 63) - 1, "n": 2})
    assert g.params_for_choice(1).seed == -(1 << 63)


def test_an_out_of_vocabulary_prompt_token_says_so():
    with pytest.raises(APIError, match="Token id 1000 is out of vocabulary") as info:
        parse({"model": "m", "prompt": [5, 1000, 7]})
    assert info.value.param == "prompt"
    with pytest.raises(APIError, match="Token id -1 is out of vocabulary"):
        parse({"model": "m", "prompt": [[5], [-1]]})


def test_a_request_without_a_model_is_for_the_served_one():
    """vLLM serves a request that names no model with the one it serves (its test_server_load
    sends such requests)."""
    g = parse({"prompt": "ab"})
    assert g.model is None and g.prompts[0].token_ids == [97, 98]


@pytest.mark.parametrize(
    "side, keep, expected",
    [("left", 4, [4, 5, 6, 7]), ("right", 4, [0, 1, 2, 3]), ("left", 9, list(range(8)))],
)
def test_truncate_prompt_tokens_keeps_that_many_from_the_side_asked(side, keep, expected):
    g = parse({"prompt": list(range(8)), "truncate_prompt_tokens": keep, "truncation_side": side})
    assert g.prompts[0].token_ids == expected
    text = parse({"prompt": "abcdef", "truncate_prompt_tokens": 2})
    assert text.prompts[0].token_ids == [101, 102] and text.prompts[0].text is None
    chat = parse({"messages": [{"role": "user", "content": "abc"}], "truncate_prompt_tokens": 3})
    assert chat.prompts[0].token_ids == [98, 99, 2]


def test_truncate_prompt_tokens_minus_one_is_what_the_context_holds():
    g = parse(
        {"prompt": list(range(150)), "truncate_prompt_tokens": -1, "max_tokens": 1}, max_len=100
    )
    assert g.prompts[0].token_ids == list(range(51, 150))  # 99 tokens: one left to generate
    with pytest.raises(ValidationError):
        CompletionBody.model_validate({"prompt": "a", "truncate_prompt_tokens": -2})
    with pytest.raises(ValidationError):
        CompletionBody.model_validate({"prompt": "a", "truncation_side": "middle"})


class SpacedCodec(Codec):
    """A leading space joins the next character in one token of its own (900 + the character
    mod 100), as byte-level BPE vocabularies spell a word mid-sentence."""

    def encode(self, text, add_special_tokens=True):
        if text.startswith(" ") and len(text) > 1:
            return [900 + ord(text[1]) % 100, *super().encode(text[2:])]
        return super().encode(text)


def bad_words_of(words, codec: TextCodec) -> list[list[int]]:
    body = CompletionBody.model_validate({"prompt": "a", "bad_words": words})
    return to_generation(body, codec, 100, None).params.bad_words_token_ids


def test_bad_words_are_banned_as_they_begin_a_text_and_after_a_space():
    """vLLM's rule: each word as it stands, and its spelling after a space where that is as
    many tokens with another first one; a word's leading spaces are dropped first."""
    expected = [[97, 98], [997, 98], [99, 100], [999, 100]]
    assert bad_words_of(["ab", "  cd"], SpacedCodec()) == expected
    # Where a space is a token of its own, the spaced spelling is longer: the word alone.
    assert bad_words_of(["ab"], Codec()) == [[97, 98]]
    assert bad_words_of([], Codec()) == [] and bad_words_of(None, Codec()) == []


class SmallCodec(Codec):
    vocab_size = 100


@pytest.mark.parametrize(
    ("words", "codec", "words_in_error"),
    [
        ([""], Codec(), "words with text"),
        (["   "], Codec(), "words with text"),
        ([f"w{i}" for i in range(129)], Codec(), "at most 128"),
        (["az"], SmallCodec(), "outside the model's vocabulary"),
    ],
    ids=["empty", "spaces", "too-many", "beyond-vocab"],
)
def test_bad_words_that_ban_nothing_or_too_much_are_a_400(words, codec, words_in_error):
    with pytest.raises(APIError, match=words_in_error) as info:
        bad_words_of(words, codec)
    assert info.value.param == "bad_words"


def test_every_logit_bias_key_that_is_not_a_token_id_is_named():
    with pytest.raises(APIError) as info:
        parse({"prompt": "a", "logit_bias": {"bad1": 50.0, "7": 1.0, "bad2": 20.0}})
    assert "bad1" in info.value.message and "bad2" in info.value.message


def test_a_null_or_missing_prompt_gets_vllms_words():
    for body in ({"prompt": None}, {"model": "m"}):
        with pytest.raises(APIError, match="Either prompt or prompt_embeds must be provided"):
            parse(body)


def test_prompt_embeds_are_refused_unless_empty():
    with pytest.raises(APIError, match="prompt_embeds is not supported"):
        parse({"prompt": "a", "prompt_embeds": [[0.5]]})
    assert parse({"prompt": "a", "prompt_embeds": []}).prompts[0].token_ids == [97]
