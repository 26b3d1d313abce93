"""Structured outputs and forced tool calls through router -> prefill -> decode on the default
model: the prefill worker masks the first token, the decode worker compiles the same grammar,
advances it over that token and masks the rest. Every answer is checked against its constraint,
not eyeballed."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from cluster_harness import kill_busy_decode_worker
from pydantic import BaseModel, Field

from benchmarks.harness import pdserve_up

pytestmark = pytest.mark.slow  # starts `pdserve up` on the default model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON: their name, age and city."}]
YES_NO_BECAUSE = 'root ::= ("yes" | "no") " because " [a-z ]{1,20} "."'
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    }},
    {"type": "function", "function": {
        "name": "get_time", "description": "The time in a time zone.",
        "parameters": {"type": "object",
                       "properties": {"zone": {"type": "string", "maxLength": 20}},
                       "required": ["zone"]},
    }},
]  # fmt: skip
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(BaseModel):
    # Bounded: a sampled string of a small model may otherwise run on until max_tokens.
    name: str = Field(max_length=40)
    age: int


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Every prompt prefilled remotely (the first token sampled under the grammar on the prefill
    worker), and two decode workers, so one can be killed mid-answer."""
    log = tmp_path_factory.mktemp("structured") / "up.log"
    flags = ("--max-model-len", "1024", "--decode", "2", "--remote-prefill-min-tokens", "1",
             "--kv-cache-memory", "256MiB", "--enable-auto-tool-choice", "--tool-call-parser",
        "hermes")  # fmt: skip
    with pdserve_up(None, *flags, log=log) as cluster:
        client = openai.OpenAI(
            base_url=cluster.base_url + "/v1", api_key="x", max_retries=0, timeout=300
        )
        yield cluster, client, client.models.list().data[0].id


def test_sampled_json_schema_answers_all_validate_and_end_with_stop(cluster):
    _, client, model = cluster
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    def ask(seed: int):
        return client.chat.completions.create(
            model=model, messages=ASK, temperature=0.8, seed=seed, max_tokens=120,
            response_format=schema_format,
        )  # fmt: skip

    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(ask, range(16)))
    for answer in answers:
        choice = answer.choices[0]
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        assert choice.finish_reason == "stop", choice


def test_the_sdks_parse_gets_its_pydantic_model(cluster):
    _, client, model = cluster
    parsed = client.chat.completions.parse(
        model=model, messages=ASK, response_format=Person, temperature=0.8, seed=7, max_tokens=120
    )
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and parsed.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"structured_outputs": {"choice": ["red", "green", "blue"]}},
         lambda text: text in ("red", "green", "blue")),
        ({"guided_regex": r"[0-9]{3}-[0-9]{4}"},
         lambda text: re.fullmatch(r"[0-9]{3}-[0-9]{4}", text) is not None),
        ({"structured_outputs": {"grammar": YES_NO_BECAUSE}},
         lambda text: re.fullmatch(r"(yes|no) because [a-z ]{1,20}\.", text) is not None),
    ],
)  # fmt: skip
def test_choice_regex_grammar_and_json_object_hold_on_completions(cluster, extra, check):
    _, client, model = cluster
    for seed in range(4):
        out = client.completions.create(
            model=model, prompt="Answer: ", max_tokens=60, temperature=0.9, seed=seed,
            extra_body=extra,
        )  # fmt: skip
        text = out.choices[0].text
        assert check(text), (extra, text)
        assert out.choices[0].finish_reason == "stop", (extra, text)


def test_a_json_object_answer_is_one(cluster):
    _, client, model = cluster
    out = client.chat.completions.create(
        model=model, messages=ASK, temperature=0, max_tokens=200,
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    assert out.choices[0].finish_reason == "stop"


def test_n_2_and_a_stream_each_hold_their_schema(cluster):
    _, client, model = cluster
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    both = client.chat.completions.create(
        model=model, messages=ASK, temperature=0.9, seed=3, n=2, max_tokens=120,
        response_format=schema_format,
    )  # fmt: skip
    assert len(both.choices) == 2
    for choice in both.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    stream = client.chat.completions.create(
        model=model, messages=ASK, temperature=0.9, seed=4, max_tokens=120, stream=True,
        response_format=schema_format,
    )  # fmt: skip
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_a_bad_grammar_is_a_400_naming_its_field_and_beam_search_refuses_one(cluster):
    _, client, model = cluster
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(
            model=model, prompt="x", max_tokens=4,
            extra_body={"structured_outputs": {"grammar": "root ::= undefined_rule"}},
        )  # fmt: skip
    assert raised.value.body["param"] == "structured_outputs"
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(
            model=model, prompt="x", max_tokens=4, n=2,
            extra_body={"use_beam_search": True, "guided_choice": ["a", "b"]},
        )  # fmt: skip
    assert raised.value.body["param"] == "guided_choice"


def valid_calls(message) -> list[tuple[str, dict]]:
    """A message's tool calls, each a known tool's with arguments its schema takes."""
    calls = []
    for call in message.tool_calls or []:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, PARAMETERS[call.function.name])
        assert call.id and call.type == "function", call
        calls.append((call.function.name, arguments))
    return calls


def streamed_calls(stream) -> tuple[list[tuple[str, str]], str | None]:
    """A streamed answer's tool calls, (name, arguments text) joined from their deltas, and its
    finish reason."""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                if delta.function.name:
                    names[delta.index] = delta.function.name
                arguments[delta.index] = arguments.get(delta.index, "") + (
                    delta.function.arguments or ""
                )
            finish = choice.finish_reason or finish
    return [(names[i], arguments[i]) for i in sorted(names)], finish


@pytest.mark.parametrize(
    ("tool_choice", "finish"),
    [("required", "tool_calls"), ({"type": "function", "function": {"name": "get_time"}}, "stop")],
    ids=["required", "named"],
)
def test_forced_tool_calls_hold_their_tools_schemas_streamed_or_not(cluster, tool_choice, finish):
    _, client, model = cluster
    ask = {"model": model, "messages": WEATHER_ASK, "tools": TOOLS, "tool_choice": tool_choice,
           "parallel_tool_calls": False, "max_tokens": 150}  # fmt: skip
    for seed in range(4):
        out = client.chat.completions.create(**ask, temperature=0.8, seed=seed)
        calls = valid_calls(out.choices[0].message)
        assert len(calls) == 1 and out.choices[0].finish_reason == finish, out.choices[0]
        if isinstance(tool_choice, dict):
            assert calls[0][0] == "get_time"
    greedy = client.chat.completions.create(**ask, temperature=0)
    streamed, streamed_finish = streamed_calls(
        client.chat.completions.create(**ask, temperature=0, stream=True)
    )
    call = greedy.choices[0].message.tool_calls[0]
    assert streamed == [(call.function.name, call.function.arguments)]
    assert streamed_finish == greedy.choices[0].finish_reason


def test_a_tool_result_goes_back_to_the_model(cluster):
    _, client, model = cluster
    out = client.chat.completions.create(
        model=model, messages=WEATHER_ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=150,
    )  # fmt: skip
    call = out.choices[0].message.tool_calls[0]
    history = [
        *WEATHER_ASK,
        {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    # Greedy: a sampled answer may begin with the end of the turn, an empty message.
    for tool_choice in ("none", "auto"):
        answer = client.chat.completions.create(
            model=model, messages=history, tools=TOOLS, tool_choice=tool_choice, max_tokens=16,
            temperature=0,
        )  # fmt: skip
        choice = answer.choices[0]
        assert choice.finish_reason in ("stop", "length", "tool_calls"), choice
        assert choice.message.content or choice.message.tool_calls, choice


def test_a_tools_schema_that_cannot_compile_is_a_400_naming_tools(cluster):
    _, client, model = cluster
    # llguidance's regexes have no look-around.
    parameters = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)a"}}}
    lookbehind = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=model, messages=WEATHER_ASK, tools=[lookbehind], tool_choice="required",
            max_tokens=8,
        )  # fmt: skip
    assert raised.value.body["param"] == "tools", raised.value.body


def test_an_answer_migrated_mid_way_still_validates(cluster):
    """The decode worker writing a long answer is killed: the request moves to the other one,
    whose grammar is advanced over every token so far, and the answer still validates."""
    up, client, model = cluster
    many = {
        "type": "object",
        "properties": {
            "names": {"type": "array", "items": {"type": "string", "maxLength": 12},
                      "minItems": 30, "maxItems": 30},
        },
        "required": ["names"],
        "additionalProperties": False,
    }  # fmt: skip
    stream = client.chat.completions.create(
        model=model, max_tokens=600, temperature=0.7, seed=11, stream=True,
        messages=[{"role": "user", "content": "List thirty first names as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "names", "schema": many}},
    )  # fmt: skip
    text, killed = "", threading.Event()
    for chunk in stream:
        text += chunk.choices[0].delta.content or "" if chunk.choices else ""
        if not killed.is_set() and text.count(",") >= 5:
            kill_busy_decode_worker(up.base_url, up.process.pid)
            killed.set()
    assert killed.is_set()
    jsonschema.validate(json.loads(text), many)
