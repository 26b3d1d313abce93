"""Speculative decoding through the whole stack: router, prefill worker, speculating decode
worker. The draft is the target itself, so every proposal is accepted and a decode step sends
up to five tokens at once: stops, usage and streaming must all still land on the right token."""

from __future__ import annotations

import json

import jsonschema
import pytest
from cluster_harness import reference_engine, tiny_chat_cluster, worker_metric

from common.sampling_params import SamplingParams
from common.structured import JSON_SCHEMA, StructuredSpec
from common.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # starts `pdserve up`

LONG_PROMPT = " ".join(f"item{i} is followed by item{i + 1}." for i in range(20))
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    flags = ("--max-model-len", "512", "--remote-prefill-min-tokens", "32", "--kv-cache-memory",
             "64MiB", "--dtype", "float32", "--speculative-model", "{model}",
             "--num-speculative-tokens", "4")  # fmt: skip
    with tiny_chat_cluster(tmp_path_factory, *flags) as running:
        yield running


@pytest.fixture(scope="module")
def expected(cluster):
    """The prompt's greedy tokens from the one-process engine without speculation."""
    _, folder, _ = cluster
    engine = reference_engine(folder)
    tokenizer = Tokenizer(folder)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return engine.generate([tokenizer.encode(LONG_PROMPT)], params)[0], tokenizer


def complete(client, **extra):
    request = {"max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}} | extra
    return client.completions.create(
        model="tiny-chat", prompt=LONG_PROMPT, temperature=0, **request
    )


def test_greedy_tokens_equal_the_engine_without_speculation(cluster, expected):
    client, _, base = cluster
    tokens, tokenizer = expected
    before = worker_metric(base, "decode", "pdserve_spec_decode_accepted_tokens_total")
    result = complete(client)
    assert result.choices[0].text == tokenizer.decode(tokens)
    assert result.usage.completion_tokens == MAX_TOKENS
    assert result.choices[0].finish_reason == "length"
    accepted = worker_metric(base, "decode", "pdserve_spec_decode_accepted_tokens_total")
    # Proposals went through the stack and were accepted: the decode worker's first step, with
    # no step measured yet, verifies one whatever the machine's load. (How many later steps
    # verify is weighed against measured step times, which a loaded machine skews: runs of
    # several tokens are checked in one process, tests/test_speculative.py.)
    assert accepted - before >= 1


def test_stop_string_inside_a_run_cuts_text_and_usage_at_its_token(cluster, expected):
    client, _, _ = cluster
    tokens, tokenizer = expected
    text = tokenizer.decode(tokens)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"need a visible stop string from {text!r}"
    # The stop string is complete with this many tokens: usage counts no token past it.
    completing = next(n for n in range(1, len(tokens) + 1) if stop in tokenizer.decode(tokens[:n]))
    for stream in (False, True):
        if stream:
            chunks = list(complete(client, stop=[stop], stream=True,
                                   stream_options={"include_usage": True}))  # fmt: skip
            got = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            usage = chunks[-1].usage
        else:
            result = complete(client, stop=[stop])
            got, finish, usage = (
                result.choices[0].text,
                result.choices[0].finish_reason,
                result.usage,
            )
        assert got == text[: text.index(stop)]
        assert finish == "stop"
        assert usage.completion_tokens == completing


def test_max_tokens_and_stop_token_inside_a_run(cluster, expected):
    client, _, _ = cluster
    tokens, tokenizer = expected
    short = complete(client, max_tokens=7)
    assert short.usage.completion_tokens == 7
    assert short.choices[0].text == tokenizer.decode(tokens[:7])
    stop_at = tokens.index(tokens[10])  # the first occurrence of the 11th token
    stopped = complete(client, extra_body={"ignore_eos": True, "stop_token_ids": [tokens[10]]})
    assert stopped.usage.completion_tokens == stop_at + 1
    assert stopped.choices[0].finish_reason == "stop"


def test_logprobs_for_every_token_of_the_runs(cluster):
    client, _, _ = cluster
    result = complete(client, logprobs=2)
    logprobs = result.choices[0].logprobs
    assert len(logprobs.token_logprobs) == MAX_TOKENS
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert chosen == pytest.approx(max(top.values()), abs=1e-4)


LIST_OF_WORDS = {
    "type": "array",
    "items": {"type": "string", "maxLength": 8},
    "minItems": 3,
    "maxItems": 6,
}


def test_a_json_schema_answer_equals_the_engine_without_speculation(cluster):
    """Under a grammar the draft's proposals are masked as if taken and a refused one ends the
    verified run: the answer is still the grammar-constrained greedy one, token for token, and
    sampled answers validate."""
    client, folder, _ = cluster
    spec = StructuredSpec(JSON_SCHEMA, json.dumps(LIST_OF_WORDS))
    tokenizer = Tokenizer(folder)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured=spec)
    expected = reference_engine(folder).generate([tokenizer.encode(LONG_PROMPT)], params)[0]
    schema_format = {"guided_json": LIST_OF_WORDS}
    ask = {"model": "tiny-chat", "prompt": LONG_PROMPT, "max_tokens": MAX_TOKENS}
    result = client.completions.create(**ask, temperature=0, extra_body=schema_format)
    assert result.choices[0].text == tokenizer.decode(expected)
    assert result.choices[0].finish_reason == "stop"
    for seed in range(3):
        sampled = client.completions.create(
            **ask, temperature=0.9, seed=seed, extra_body=schema_format
        )
        jsonschema.validate(json.loads(sampled.choices[0].text), LIST_OF_WORDS)
