"""vLLM's extensions to the OpenAI API, and the corners of OpenAI's own, through the official
`openai` client against a live `pdserve up`: what a script written for `vllm serve` asks for
must come back the way vLLM answers it (fields, shapes, and the tokens themselves)."""

from __future__ import annotations

import time
from typing import Literal

import httpx
import openai
import pytest
from cluster_harness import greedy_reference, tiny_chat_cluster
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow  # starts `pdserve up` for the clients

MODEL = "tiny-chat"
PROMPT = "The capital of France is a city whose name is"
CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Name a colour."},
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    flags = ("--max-model-len", "512", "--remote-prefill-min-tokens", "8", "--kv-cache-memory",
             "64MiB", "--dtype", "float32")  # fmt: skip
    with tiny_chat_cluster(tmp_path_factory, *flags) as running:
        yield running


@pytest.fixture(scope="module")
def reference(cluster):
    """Greedy tokens of the same model in one process, for any sampling params."""
    return greedy_reference(cluster[1])


def complete(client: openai.OpenAI, **fields):
    """A greedy completion of PROMPT; every answer runs to max_tokens (EOS ignored)."""
    request = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    extra = {"ignore_eos": True} | fields.pop("extra_body", {})
    return client.completions.create(**(request | fields), extra_body=extra)


def chat(client: openai.OpenAI, **fields):
    """A greedy chat answer to CONVERSATION; every answer runs to max_tokens (EOS ignored)."""
    request = {"model": MODEL, "messages": CONVERSATION, "max_tokens": 8, "temperature": 0}
    extra = {"ignore_eos": True} | fields.pop("extra_body", {})
    return client.chat.completions.create(**(request | fields), extra_body=extra)


def streamed_ids(chunks) -> list[int]:
    """The token ids of a stream's chunks, in order (role and usage chunks carry none)."""
    return [t for c in chunks if c.choices for t in getattr(c.choices[0], "token_ids", None) or []]


def wait_for_load(http: httpx.Client, expected: int, timeout: float = 30.0) -> int:
    """/load's figure once it is ``expected`` or the deadline passed (a stream is counted until
    the server has finished sending it, a moment after the client read its end)."""
    deadline = time.monotonic() + timeout
    while True:
        load = http.get("/load").json()["server_load"]
        if load == expected or time.monotonic() > deadline:
            return load
        time.sleep(0.05)


# -- logit_bias ------------------------------------------------------------------------------


def test_logit_bias_changes_greedy_tokens_as_the_engine_does(cluster, reference):
    client, _, _ = cluster
    generate, tokenizer = reference
    prompt_ids = tokenizer.encode(PROMPT)
    plain = generate(prompt_ids, 8, ignore_eos=True)
    # Forbid the first greedy token and favour another one a little: the answer must be the
    # engine's under the same bias, and differ from the plain answer from its first token.
    favoured = (plain[0] + 7) % 1000
    bias = {plain[0]: -100.0, favoured: 5.0}
    expected = generate(prompt_ids, 8, ignore_eos=True, logit_bias=bias)
    assert expected[0] != plain[0]
    result = complete(
        client,
        logit_bias={str(k): v for k, v in bias.items()},
        logprobs=0,
        extra_body={"return_token_ids": True},
    )
    assert result.choices[0].token_ids == expected
    # Reported logprobs are the model's own (before the bias), as in vLLM.
    assert all(lp <= 0 for lp in result.choices[0].logprobs.token_logprobs)

    # A bias of +100 on one token makes greedy decoding repeat it (chat, streamed too).
    stream = chat(
        client, logit_bias={"42": 100}, stream=True, extra_body={"return_token_ids": True}
    )
    assert streamed_ids(stream) == [42] * 8


@pytest.mark.parametrize(
    "bias", [{"49152": 1}, {"-1": 1}, {"x": 1}], ids=["beyond-vocab", "negative", "not-an-id"]
)
def test_logit_bias_with_bad_token_ids_is_a_400(cluster, bias):
    client, _, _ = cluster
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        complete(client, logit_bias=bias)


# -- allowed_token_ids -----------------------------------------------------------------------


def test_allowed_token_ids_keep_every_token_in_the_list_as_the_engine_does(cluster, reference):
    """vLLM's whitelist: greedy tokens are the engine's under the same list, from the prefill
    worker's first token on; sampled ones, seeded, never leave it; logprobs stay the model's."""
    client, _, _ = cluster
    generate, tokenizer = reference
    prompt_ids = tokenizer.encode(PROMPT)
    plain = generate(prompt_ids, 8, ignore_eos=True)
    allowed = sorted({(plain[0] + 11) % 1000, (plain[1] + 23) % 1000, 42} - set(plain))
    expected = generate(prompt_ids, 8, ignore_eos=True, allowed_token_ids=allowed)
    assert set(expected) <= set(allowed)
    result = complete(
        client,
        logprobs=0,
        extra_body={"allowed_token_ids": allowed, "return_token_ids": True},
    )
    assert result.choices[0].token_ids == expected
    assert all(lp <= 0 for lp in result.choices[0].logprobs.token_logprobs)

    stream = chat(
        client,
        temperature=1.0,
        seed=5,
        stream=True,
        extra_body={"allowed_token_ids": allowed, "return_token_ids": True},
    )
    assert set(streamed_ids(stream)) <= set(allowed)


@pytest.mark.parametrize("allowed", [[], [49152], [-1]], ids=["empty", "beyond-vocab", "negative"])
def test_allowed_token_ids_that_name_no_token_are_a_400(cluster, allowed):
    client, _, _ = cluster
    with pytest.raises(openai.BadRequestError, match="allowed_token_ids"):
        complete(client, extra_body={"allowed_token_ids": allowed})


# -- bad_words -------------------------------------------------------------------------------


def spelled(words: list[str], tokenizer) -> list[list[int]]:
    """vLLM's token sequences for ``words``: each word as it stands, and after a space where
    that spells it in as many tokens but another first one."""
    sequences = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences.append(bare)
        if spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    return sequences


def test_bad_words_are_never_completed_as_the_engine_bans_them(cluster, reference):
    """The first token (the prefill worker's) and a two-token word later on (the decode
    worker's) are banned as the engine bans the router's spelling of the words."""
    client, _, _ = cluster
    generate, tokenizer = reference
    prompt_ids = tokenizer.encode(PROMPT)
    plain = generate(prompt_ids, 8, ignore_eos=True)
    words = [tokenizer.decode(plain[:1]), tokenizer.decode(plain[3:5])]
    sequences = spelled(words, tokenizer)
    assert plain[:1] in sequences and plain[3:5] in sequences
    expected = generate(prompt_ids, 8, ignore_eos=True, bad_words_token_ids=sequences)
    assert expected[0] != plain[0]
    for banned in sequences:
        assert all(expected[i : i + len(banned)] != banned for i in range(len(expected)))
    result = complete(client, extra_body={"bad_words": words, "return_token_ids": True})
    assert result.choices[0].token_ids == expected


def test_bad_words_that_spell_nothing_are_a_400(cluster):
    client, _, _ = cluster
    with pytest.raises(openai.BadRequestError, match="bad_words"):
        complete(client, extra_body={"bad_words": ["  "]})


# -- logprobs --------------------------------------------------------------------------------


def test_completion_logprobs_zero_reports_the_sampled_token(cluster):
    client, _, _ = cluster
    result = complete(client, logprobs=0)
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == 8
    for token, lp, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert top == {token: lp}


def test_completion_top_logprobs_hold_the_sampled_token_and_the_alternatives(cluster):
    client, _, _ = cluster
    # Sampled at temperature 1 the chosen token is often not among the best two.
    result = complete(client, logprobs=2, temperature=1.0, seed=3, max_tokens=16)
    logprobs = result.choices[0].logprobs
    for token, lp, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert next(iter(top)) == token and top[token] == lp
        assert len(top) in (2, 3)  # the sampled one was among the best two, or not


def test_chat_top_logprobs_zero_has_no_alternatives(cluster):
    client, _, _ = cluster
    result = chat(client, logprobs=True, top_logprobs=0)
    content = result.choices[0].logprobs.content
    assert len(content) == 8
    assert all(entry.top_logprobs == [] and entry.logprob <= 0 for entry in content)


# -- return_token_ids and return_tokens_as_token_ids ----------------------------------------


def test_completion_returns_prompt_and_output_token_ids(cluster, reference):
    client, _, _ = cluster
    generate, tokenizer = reference
    prompt_ids = tokenizer.encode(PROMPT)
    expected = generate(prompt_ids, 8)
    result = complete(client, extra_body={"return_token_ids": True})
    choice = result.choices[0]
    assert choice.prompt_token_ids == prompt_ids
    assert choice.token_ids == expected
    assert result.usage.completion_tokens == len(expected)
    # Without it both keys are there, and null, as vLLM answers.
    plain = complete(client).model_dump()["choices"][0]
    assert plain["prompt_token_ids"] is None and plain["token_ids"] is None


def test_streamed_completion_token_ids_match_logprob_tokens(cluster, reference):
    client, _, _ = cluster
    generate, tokenizer = reference
    prompt_ids = tokenizer.encode(PROMPT)
    stream = complete(
        client,
        stream=True,
        logprobs=1,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].prompt_token_ids == prompt_ids
    assert all(getattr(c.choices[0], "prompt_token_ids", None) is None for c in chunks[1:])
    streamed = streamed_ids(chunks)
    named = [
        int(token.removeprefix("token_id:"))
        for c in chunks
        if c.choices[0].logprobs
        for token in c.choices[0].logprobs.tokens
    ]
    assert streamed == named == generate(prompt_ids, 8)
    tops = [
        top for c in chunks if c.choices[0].logprobs for top in c.choices[0].logprobs.top_logprobs
    ]
    assert all(key.startswith("token_id:") for top in tops for key in top)


def test_chat_returns_prompt_token_ids_on_the_response_and_the_first_chunk(cluster, reference):
    client, _, _ = cluster
    _, tokenizer = reference
    prompt_ids = tokenizer.encode_chat(CONVERSATION)
    result = chat(client, logprobs=True, extra_body={"return_token_ids": True})
    assert result.prompt_token_ids == prompt_ids
    assert [e.token for e in result.choices[0].logprobs.content] == [
        tokenizer.decode([t], skip_special_tokens=False) for t in result.choices[0].token_ids
    ]
    stream = list(chat(client, stream=True, extra_body={"return_token_ids": True}))
    assert stream[0].prompt_token_ids == prompt_ids
    assert all("prompt_token_ids" not in chunk.model_dump() for chunk in stream[1:])
    streamed = streamed_ids(stream)
    assert streamed == result.choices[0].token_ids
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == result.choices[0].message.content


def test_echo_with_return_token_ids_gives_the_prompt_as_ids_only(cluster, reference):
    client, _, _ = cluster
    _, tokenizer = reference
    result = complete(client, echo=True, extra_body={"return_token_ids": True})
    choice = result.choices[0]
    assert choice.prompt_token_ids == tokenizer.encode(PROMPT)
    assert choice.text == tokenizer.decode(choice.token_ids)  # vLLM's rule: no prompt text


# -- streaming usage -------------------------------------------------------------------------


def test_continuous_usage_stats_count_tokens_on_every_chunk(cluster):
    client, _, _ = cluster
    stream = list(
        complete(
            client,
            stream=True,
            max_tokens=12,
            extra_body={"return_token_ids": True},
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    *chunks, final = stream
    assert final.choices == [] and final.usage.completion_tokens == 12
    seen = 0
    for chunk in chunks:
        seen += len(streamed_ids([chunk]))
        assert chunk.usage.completion_tokens == seen
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + seen
    assert seen == 12
    # Without include_usage the flag asks for nothing (vLLM's rule): no usage anywhere.
    plain = list(complete(client, stream=True, stream_options={"continuous_usage_stats": True}))
    assert all(chunk.usage is None for chunk in plain)


# -- chat templates: generation prompt, continued messages, echo, roles ---------------------


def test_continue_final_message_continues_the_assistants_text(cluster, reference):
    client, _, _ = cluster
    generate, tokenizer = reference
    messages = [*CONVERSATION, {"role": "assistant", "content": "My favourite colour is"}]
    prompt_ids = tokenizer.encode_chat(
        messages, add_generation_prompt=False, continue_final_message=True
    )
    # The template leaves the assistant's turn open: no end-of-turn after its text.
    assert tokenizer.decode(prompt_ids, skip_special_tokens=False).endswith("colour is")
    result = chat(
        client,
        messages=messages,
        extra_body={
            "add_generation_prompt": False,
            "continue_final_message": True,
            "echo": True,
            "return_token_ids": True,
        },
    )
    assert result.prompt_token_ids == prompt_ids
    assert result.choices[0].token_ids == generate(prompt_ids, 8)
    message = result.choices[0].message
    assert message.role == "assistant"
    assert message.content.startswith("My favourite colour is")  # echo

    stream = list(
        chat(
            client,
            messages=messages,
            stream=True,
            extra_body={"add_generation_prompt": False, "continue_final_message": True,
                        "echo": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream) == message.content


def test_without_generation_prompt_the_answer_takes_the_last_messages_role(cluster):
    client, _, _ = cluster
    result = chat(client, extra_body={"add_generation_prompt": False, "echo": True})
    # The last message is the user's: that is the answer's role, and echo repeats its text.
    assert result.choices[0].message.role == "user"
    assert result.choices[0].message.content.startswith("Name a colour.")
    both = {"add_generation_prompt": True, "continue_final_message": True}
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        chat(client, extra_body=both)


def test_roles_beyond_the_built_in_five_reach_the_template(cluster, reference):
    client, _, _ = cluster
    _, tokenizer = reference
    messages = [
        {"role": "user", "content": "What is the weather?"},
        {"role": "function", "name": "weather", "content": "sunny"},
        {"role": "ipython", "content": "42"},
    ]
    result = chat(client, messages=messages, extra_body={"return_token_ids": True})
    rendered = tokenizer.decode(result.prompt_token_ids, skip_special_tokens=False)
    assert "function\nsunny" in rendered and "ipython\n42" in rendered
    with pytest.raises(openai.BadRequestError, match="role"):
        chat(client, messages=[{"role": "", "content": "x"}])


# -- /tokenize and /load ---------------------------------------------------------------------


def test_tokenize_options(cluster, reference):
    _, _, base = cluster
    _, tokenizer = reference
    with httpx.Client(base_url=base, timeout=60) as http:
        body = http.post(
            "/tokenize",
            json={"model": MODEL, "prompt": "Hello world", "return_token_strs": True},
        ).json()
        assert body["tokens"] == tokenizer.encode("Hello world")
        assert body["token_strs"] == tokenizer.token_strings(body["tokens"])
        assert "".join(body["token_strs"]).replace("Ġ", " ").endswith("Hello world")

        def count(**options) -> list[int]:
            response = http.post(
                "/tokenize", json={"model": MODEL, "messages": CONVERSATION} | options
            )
            assert response.status_code == 200, response.text
            return response.json()["tokens"]

        with_prompt, without = count(), count(add_generation_prompt=False)
        assert with_prompt == tokenizer.encode_chat(CONVERSATION)
        assert without == tokenizer.encode_chat(CONVERSATION, add_generation_prompt=False)
        assert len(without) < len(with_prompt) and with_prompt[: len(without)] == without
        assert count(return_token_strs=False) == with_prompt
        refused = http.post(
            "/tokenize",
            json={"model": MODEL, "messages": CONVERSATION, "continue_final_message": True},
        )
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "continue_final_message"


def test_load_counts_requests_being_answered(cluster):
    client, _, base = cluster
    with httpx.Client(base_url=base, timeout=60) as http:
        assert wait_for_load(http, 0) == 0
        # Long enough that it is still being answered when /load is read (64 tokens of the tiny
        # model could all be sent before a loaded machine ran that request).
        stream = complete(client, stream=True, max_tokens=480)
        first = next(iter(stream))  # the request is being answered now
        assert first.choices
        during = http.get("/load").json()["server_load"]
        rest = list(stream)
        assert during == 1 and rest[-1].choices[0].finish_reason == "length"
        # Ended streams, plain requests and refused ones leave nothing counted.
        complete(client)
        with pytest.raises(openai.BadRequestError):
            complete(client, max_tokens=-1)
        assert wait_for_load(http, 0) == 0


# -- prompt logprobs -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scored_prompt(cluster):
    """transformers' log_softmax over the prompt's positions (fp32): row p scores token p + 1."""
    import torch
    from transformers import AutoModelForCausalLM

    _, folder, _ = cluster
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)

    def score(prompt_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([prompt_ids])).logits[0], dim=-1)

    return score


# A prompt under 8 tokens is prefilled by the decode worker itself, PROMPT by the prefill worker.
@pytest.mark.parametrize("prompt", [PROMPT, "Hi there, you"], ids=["remote", "local"])
def test_prompt_logprobs_equal_transformers(cluster, reference, scored_prompt, prompt):
    client, _, _ = cluster
    _, tokenizer = reference
    prompt_ids = tokenizer.encode(prompt)
    assert (len(prompt_ids) >= 8) == (prompt == PROMPT) and len(prompt_ids) >= 3
    expected = scored_prompt(prompt_ids)
    for _ in range(2):  # the second time the prompt is in the prefix cache, which must not matter
        result = complete(client, prompt=prompt, extra_body={"prompt_logprobs": 2})
        scored = result.choices[0].prompt_logprobs
        assert len(scored) == len(prompt_ids) and scored[0] is None
        for position, entry in enumerate(scored[1:]):
            row, token = expected[position], prompt_ids[position + 1]
            best = row.topk(2).indices.tolist()
            assert next(iter(entry)) == str(token)  # the prompt's own token first
            assert set(entry) == {str(token), *map(str, best)}
            assert entry[str(token)]["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
            assert entry[str(token)]["rank"] == int((row > row[token] + 1e-6).sum()) + 1
            assert entry[str(token)]["decoded_token"] == tokenizer.decode([token])
            assert entry[str(best[0])]["rank"] == 1
    # Not asked: the key is there, and null.
    assert complete(client, prompt=prompt).model_dump()["choices"][0]["prompt_logprobs"] is None


def test_echo_with_logprobs_scores_the_prompt_tokens(cluster, reference, scored_prompt):
    client, _, _ = cluster
    generate, tokenizer = reference
    prompt_ids = tokenizer.encode(PROMPT)
    expected = scored_prompt(prompt_ids)
    result = complete(client, echo=True, logprobs=1)
    logprobs = result.choices[0].logprobs
    generated = generate(prompt_ids, 8)
    names = [tokenizer.decode([t]) for t in prompt_ids + generated]
    assert logprobs.tokens == names
    assert result.choices[0].text == PROMPT + tokenizer.decode(generated)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for position in range(1, len(prompt_ids)):
        row, token = expected[position - 1], prompt_ids[position]
        assert logprobs.token_logprobs[position] == pytest.approx(row[token].item(), abs=1e-4)
        assert len(logprobs.top_logprobs[position]) in (1, 2)
    lengths = [len(name) for name in names]
    assert logprobs.text_offset == [sum(lengths[:i]) for i in range(len(names))]

    # Streamed: the echo arrives with the first token, carrying the prompt's logprobs.
    chunks = list(complete(client, echo=True, logprobs=1, stream=True))
    assert chunks[0].choices[0].text == PROMPT
    assert (
        chunks[0].choices[0].logprobs.token_logprobs == logprobs.token_logprobs[: len(prompt_ids)]
    )
    streamed = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    assert streamed == logprobs.tokens


def test_prompt_logprobs_on_chat_and_their_limits(cluster, reference):
    client, _, _ = cluster
    _, tokenizer = reference
    result = chat(client, extra_body={"prompt_logprobs": 0})
    scored = result.model_dump()["prompt_logprobs"]
    prompt_ids = tokenizer.encode_chat(CONVERSATION)
    assert scored[0] is None and [list(e) for e in scored[1:]] == [[str(t)] for t in prompt_ids[1:]]
    with pytest.raises(openai.BadRequestError, match="stream"):
        list(complete(client, stream=True, extra_body={"prompt_logprobs": 1}))
    for bad in (-1, 21):
        with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
            complete(client, extra_body={"prompt_logprobs": bad})


# -- clients built on the OpenAI API --------------------------------------------------------


def test_langchain_openai_invoke_stream_n_and_logprobs(cluster):
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    client, _, base = cluster
    expected = chat(client).choices[0].message.content
    messages = [SystemMessage(CONVERSATION[0]["content"]), HumanMessage(CONVERSATION[1]["content"])]
    settings = {"base_url": f"{base}/v1", "api_key": "unused", "model": MODEL, "temperature": 0}
    llm = ChatOpenAI(max_tokens=8, extra_body={"ignore_eos": True}, **settings)
    answer = llm.invoke(messages)
    assert answer.content == expected
    assert answer.usage_metadata["output_tokens"] == 8
    assert "".join(chunk.content for chunk in llm.stream(messages)) == expected
    # Sampled: greedy choices would be one answer twice, which vLLM refuses (and so does pdserve).
    sampled = settings | {"temperature": 1.0}
    result = ChatOpenAI(max_tokens=8, n=2, seed=1, **sampled).generate([messages])
    assert len(result.generations[0]) == 2
    scored = ChatOpenAI(max_tokens=8, logprobs=True, top_logprobs=2, **settings).invoke(messages)
    content = scored.response_metadata["logprobs"]["content"]
    assert len(content) == 8 and all(len(entry["top_logprobs"]) == 2 for entry in content)


def test_litellm_openai_provider_invoke_stream_n_and_logprobs(cluster, monkeypatch):
    # Offline: litellm would otherwise try to download its model price list at import.
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    client, _, base = cluster
    expected = chat(client).choices[0].message.content
    settings = {
        "model": f"openai/{MODEL}",
        "api_base": f"{base}/v1",
        "api_key": "unused",
        "messages": CONVERSATION,
        "max_tokens": 8,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    answer = litellm.completion(**settings)
    assert answer.choices[0].message.content == expected
    assert answer.usage.completion_tokens == 8
    stream = litellm.completion(stream=True, **settings)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == expected
    several = litellm.completion(n=2, **(settings | {"temperature": 1.0, "seed": 1}))
    assert len(several.choices) == 2 and several.usage.completion_tokens == 16
    scored = litellm.completion(logprobs=True, top_logprobs=2, **settings)
    content = scored.choices[0].logprobs.content
    assert len(content) == 8 and all(len(entry.top_logprobs) == 2 for entry in content)


class Verdict(BaseModel):
    """Every field bounded: a tiny random model's answer closes whatever it samples."""

    ok: bool
    score: int = Field(ge=0, le=9)


def test_structured_output_through_langchain_and_litellm(cluster, monkeypatch):
    """langchain-openai's with_structured_output and litellm's response_format, each with a
    pydantic model, get an answer that is one."""
    from langchain_openai import ChatOpenAI

    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    _, _, base = cluster
    settings = {"base_url": f"{base}/v1", "api_key": "unused", "model": MODEL}
    structured = ChatOpenAI(temperature=1.0, seed=2, max_tokens=40, **settings)
    verdict = structured.with_structured_output(Verdict, method="json_schema").invoke("Judge this.")
    assert isinstance(verdict, Verdict)
    answer = litellm.completion(
        model=f"openai/{MODEL}", api_base=f"{base}/v1", api_key="unused", max_tokens=40,
        messages=CONVERSATION, temperature=1.0, seed=3, response_format=Verdict,
    )  # fmt: skip
    Verdict.model_validate_json(answer.choices[0].message.content)
    assert answer.choices[0].finish_reason == "stop"


class GetWeather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=12)
    unit: Literal["celsius", "fahrenheit"]


def test_tool_calls_through_the_sdk_langchain_and_litellm(cluster, monkeypatch):
    """Forced calls (required, and a named function) on a model that knows no tools: the SDK's
    parse() reads the arguments into the pydantic model, langchain's bind_tools and litellm get
    calls whose arguments are one."""
    from langchain_openai import ChatOpenAI

    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    client, _, base = cluster
    tool = openai.pydantic_function_tool(GetWeather)
    parsed = client.chat.completions.parse(
        model=MODEL, messages=CONVERSATION, tools=[tool], tool_choice="required",
        parallel_tool_calls=False, temperature=1.0, seed=1, max_tokens=60,
    )  # fmt: skip
    (call,) = parsed.choices[0].message.tool_calls
    assert call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather)
    assert parsed.choices[0].finish_reason == "tool_calls"

    settings = {"base_url": f"{base}/v1", "api_key": "unused", "model": MODEL}
    bound = ChatOpenAI(temperature=1.0, seed=2, max_tokens=60, **settings).bind_tools(
        [GetWeather], tool_choice="GetWeather"
    )
    message = bound.invoke("What is the weather in Paris?")
    assert [call["name"] for call in message.tool_calls] == ["GetWeather"]
    GetWeather.model_validate(message.tool_calls[0]["args"])

    answer = litellm.completion(
        model=f"openai/{MODEL}", api_base=f"{base}/v1", api_key="unused", max_tokens=60,
        messages=CONVERSATION, temperature=1.0, seed=3, tools=[tool], tool_choice="required",
        parallel_tool_calls=False,
    )  # fmt: skip
    (call,) = answer.choices[0].message.tool_calls
    assert call.function.name == "GetWeather"
    GetWeather.model_validate_json(call.function.arguments)
