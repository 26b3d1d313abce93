"""Tools and reasoning through the router, against fake workers that answer with scripted text.

The model is the default one's tokenizer with a chat template that renders tools, tool calls,
tool results and Qwen3's ``enable_thinking`` (SmolLM2's own template renders none of them). The
fakes answer a request with the tokens of the text a test sets, so each test knows what the
"model" said; the router reads it into tool calls and reasoning, whole and streamed, and the
two agree. The router reads its parsing settings per request: a test sets them on its config.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
from router_fakes import model_text, router_server, start_fakes
from tiny_models import default_model_with_template

from common.protocol import DecodeRequest, PrefillRequest
from common.sampling_params import SamplingParams
from common.structured import StructuredSpec
from router.chat_output import plan_output
from router.config import OutputParsing
from router.server import build_parser, config_from_args
from router.tool_request import NONE, REQUIRED, ToolChoice, ToolParam

CHAT = "/v1/chat/completions"
TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == "assistant" and m.tool_calls %}<|im_start|>assistant
{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>
{% endif %}{{ m.content }}
{%- for call in m.tool_calls %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == "tool" %}<|im_start|>user
<tool_response id="{{ m.tool_call_id }}">
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": WEATHER_PARAMETERS,
    },
}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: any object
TOOLS = [WEATHER, NOW]
ASK = [{"role": "user", "content": "What is the weather in Zürich?"}]
ARGUMENTS = '{"city": "Zürich", "days": 2}'
REQUIRED_ANSWER = (
    f'[{{"name": "get_weather", "parameters": {ARGUMENTS}}}, {{"name": "now", "parameters": {{}}}}]'
)
# One answer per auto parser: text before the calls where the format has room for it, two calls,
# non-ASCII and nested arguments.
AUTO_ANSWERS = {
    "hermes": (
        "Checking.\n"
        f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGUMENTS}}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
        "Checking.\n",
    ),
    "llama3_json": (
        f'{{"name": "get_weather", "parameters": {ARGUMENTS}}}; '
        '{"name": "now", "parameters": {}}',
        None,
    ),
    "mistral": (
        f'Checking. [TOOL_CALLS] [{{"name": "get_weather", "arguments": {ARGUMENTS}}}, '
        '{"name": "now", "arguments": {}}]',
        "Checking. ",
    ),
    "pythonic": ("[get_weather(city='Zürich', days=2), now()]", None),
}


class Answers:
    """The fakes' script: the text set for the next requests, as the model's tokens (and, where
    ``end`` is set, the end-of-sequence token after them)."""

    def __init__(self, model: Path) -> None:
        self.codec = model_text(model)
        self.text: str | None = None
        self.end = False

    def __call__(self, prompt: list[int], params: SamplingParams) -> list[int] | None:
        if self.text is None:
            return None
        ids = self.codec.encode(self.text, add_special_tokens=False)
        return ids + list(self.codec.eos_token_ids[:1]) if self.end else ids


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """The default model's config and tokenizer, with TEMPLATE as its chat template."""
    return default_model_with_template(tmp_path_factory.mktemp("tools") / "tools", TEMPLATE)


@pytest.fixture(scope="module")
def served(model) -> Iterator:
    with router_server(model) as router:
        start_fakes(router, {}, [("p0", "prefill"), ("d0", "decode")], answer=Answers(model))
        router.wait_for_workers(1, 1)
        yield router


@pytest.fixture
def router(served):
    """The module's router, its script and parsing settings reset after each test."""
    yield served
    answering(served, None)
    served.app.state.config.parsing = OutputParsing()


def answering(router, text: str | None, end: bool = False) -> None:
    script = router.workers[0].answer  # the fakes share one
    script.text, script.end = text, end


def parsing(router, **settings) -> None:
    router.app.state.config.parsing = OutputParsing(**settings)


def post(router, body: dict, request_id: str = "") -> dict:
    headers = {"X-Request-Id": request_id} if request_id else {}
    with router.client() as h:
        r = h.post(CHAT, json={"max_tokens": 200, **body}, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def refused(router, body: dict) -> dict:
    with router.client() as h:
        r = h.post(CHAT, json={"messages": ASK, "max_tokens": 8, **body})
    assert r.status_code == 400, r.text
    return r.json()["error"]


def streamed(router, body: dict) -> dict:
    """A streamed answer's deltas joined into a message (each call's first delta checked to
    carry its id, type and name), with its finish reason."""
    body = {"max_tokens": 200, **body, "stream": True}
    with router.client() as h, h.stream("POST", CHAT, json=body) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    message: dict = {"reasoning": "", "content": "", "tool_calls": []}
    finish = None
    for line in lines[:-1]:
        [choice] = json.loads(line.removeprefix("data: "))["choices"]
        delta = choice["delta"]
        message["reasoning"] += delta.get("reasoning") or ""
        message["content"] += delta.get("content") or ""
        for call in delta.get("tool_calls", []):
            calls = message["tool_calls"]
            if call["index"] == len(calls):
                assert call["id"] and call["type"] == "function" and call["function"]["name"]
                calls.append(call | {"function": dict(call["function"])})
                del calls[-1]["index"]
            else:
                calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
        finish = choice["finish_reason"] or finish
    return {"message": message, "finish_reason": finish}


def calls_of(message: dict) -> list[tuple[str, str]]:
    return [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []
    ]


def sent(router, request_id: str) -> PrefillRequest | DecodeRequest:
    """What the router sent a worker for the request it answered as ``request_id``."""
    for worker in router.workers:
        for msg in worker.received:
            if isinstance(msg, PrefillRequest | DecodeRequest) and request_id in msg.request_id:
                return msg
    raise AssertionError(f"no worker received {request_id}")


def prompt_text(router, model, request_id: str) -> str:
    return model_text(model).decode(sent(router, request_id).prompt_token_ids, False)


def test_tools_reach_the_prompt_and_tool_choice_none_leaves_the_answer_free(router, model):
    answer = 'Sure. <tool_call>{"name": "now", "arguments": {}}</tool_call>'
    answering(router, answer)
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "none"}
    reply = post(router, body, "tools-none")
    prompt = prompt_text(router, model, "tools-none")
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt
    assert "The weather in a city" in prompt and '"name": "now"' in prompt
    [choice] = reply["choices"]
    assert choice["message"] == {"role": "assistant", "content": answer}
    assert choice["finish_reason"] == "stop"
    assert sent(router, "tools-none").params.structured is None
    post(router, {"messages": ASK}, "no-tools")
    assert "<tools>" not in prompt_text(router, model, "no-tools")


def test_required_constrains_the_answer_with_vllms_schema(router):
    answering(router, REQUIRED_ANSWER)
    post(router, {"messages": ASK, "tools": TOOLS, "tool_choice": "required"}, "required")
    spec = sent(router, "required").params.structured
    assert spec is not None and (spec.kind, spec.any_whitespace, spec.starts_after) == (
        "json_schema", False, []
    )  # fmt: skip
    schema = json.loads(spec.text)

    def call(name: str, parameters: dict) -> dict:
        return {
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
            "required": ["name", "parameters"],
        }

    assert schema == {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                call("get_weather", WEATHER_PARAMETERS),
                call("now", {"type": "object", "properties": {}}),
            ],
        },
    }
    jsonschema.validate(json.loads(REQUIRED_ANSWER), schema)
    for answer in (
        [{"name": "get_weather", "parameters": {"city": "Paris"}}],
        [{"name": "now", "parameters": {"anything": [1]}}],
    ):
        jsonschema.validate(answer, schema)
    for answer in (
        [],
        {"name": "now", "parameters": {}},
        [{"name": "nope", "parameters": {}}],
        [{"name": "get_weather"}],
        [{"name": "get_weather", "parameters": {"days": 2}}],
        [{"name": "get_weather", "parameters": {"city": "Paris", "days": "two"}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(answer, schema)
    # parallel_tool_calls: false allows one call only.
    body = {
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
    }
    post(router, body, "required-one")
    one = json.loads(sent(router, "required-one").params.structured.text)
    assert one == schema | {"maxItems": 1}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(REQUIRED_ANSWER), one)


def test_required_gathers_the_tools_definitions_where_their_references_point(router):
    place = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    locate = {
        "type": "function",
        "function": {
            "name": "locate",
            "parameters": {
                "type": "object",
                "properties": {"where": {"$ref": "#/$defs/place"}},
                "$defs": {"place": place},
            },
        },
    }
    answering(router, '[{"name": "locate", "parameters": {"where": {"name": "Bern"}}}]')
    post(router, {"messages": ASK, "tools": [locate, NOW], "tool_choice": "required"}, "defs")
    schema = json.loads(sent(router, "defs").params.structured.text)
    assert schema["$defs"] == {"place": place}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    jsonschema.validate([{"name": "locate", "parameters": {"where": {"name": "Bern"}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "locate", "parameters": {"where": {"nom": "x"}}}], schema)
    other = json.loads(json.dumps(locate))
    other["function"]["name"] = "locate2"
    other["function"]["parameters"]["$defs"]["place"] = {"type": "string"}
    error = refused(router, {"tools": [locate, other], "tool_choice": "required"})
    assert error["param"] == "tools" and "'place' has multiple schemas" in error["message"]


def test_a_named_function_constrains_the_answer_to_its_parameters(router):
    answering(router, ARGUMENTS)
    named = {"type": "function", "function": {"name": "get_weather"}}
    post(router, {"messages": ASK, "tools": TOOLS, "tool_choice": named}, "named")
    assert json.loads(sent(router, "named").params.structured.text) == WEATHER_PARAMETERS
    jsonschema.validate(json.loads(ARGUMENTS), WEATHER_PARAMETERS)
    answering(router, "{}")
    now = {"type": "function", "function": {"name": "now"}}
    post(router, {"messages": ASK, "tools": TOOLS, "tool_choice": now}, "named-now")
    schema = json.loads(sent(router, "named-now").params.structured.text)
    assert schema == {"type": "object", "properties": {}}


@pytest.mark.parametrize(
    ("tool_choice", "answer", "calls", "finish"),
    [
        ("required", REQUIRED_ANSWER, [("get_weather", ARGUMENTS), ("now", "{}")], "tool_calls"),
        (
            {"type": "function", "function": {"name": "get_weather"}},
            ARGUMENTS,
            [("get_weather", ARGUMENTS)],
            "stop",  # OpenAI's and vLLM's, for a named function
        ),
    ],
    ids=["required", "named"],
)
def test_a_forced_answer_comes_back_as_tool_calls_streamed_or_not(
    router, tool_choice, answer, calls, finish
):
    answering(router, answer)
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": tool_choice}
    [choice] = post(router, body)["choices"]
    message = choice["message"]
    assert message["content"] == "" and calls_of(message) == calls  # vLLM's empty content
    assert all(
        c["id"].startswith("chatcmpl-tool-") and c["type"] == "function"
        for c in message["tool_calls"]
    )
    assert choice["finish_reason"] == finish
    stream = streamed(router, body)
    assert calls_of(stream["message"]) == calls and stream["message"]["content"] == ""
    assert stream["finish_reason"] == finish
    # Cut short by max_tokens: no calls, as vLLM answers, and the reason says why.
    if tool_choice == "required":
        [choice] = post(router, body | {"max_tokens": 5})["choices"]
        assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "length"


def test_auto_needs_the_servers_flags_as_in_vllm(router):
    words = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    for body in ({"tools": TOOLS, "tool_choice": "auto"}, {"tools": TOOLS}):
        error = refused(router, body)
        assert error["message"] == words and error["param"] == "tool_choice"


BEAM = {"use_beam_search": True, "n": 2}
REFUSALS = [
    pytest.param({"tools": []}, "tools", "`tools` must not be an empty array", id="empty-tools"),
    pytest.param(
        {"tool_choice": "required"},
        "tool_choice",
        "When using `tool_choice`, `tools` must be set.",
        id="choice-without-tools",
    ),
    pytest.param(
        {"tools": TOOLS, "tool_choice": "any"},
        "tool_choice",
        "Invalid value for `tool_choice`",
        id="choice-unknown",
    ),
    pytest.param(
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "does not match any of the specified `tools`",
        id="named-unknown",
    ),
    pytest.param(
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}},
        "tool_choice.function.name",
        "Expected field `name`",
        id="named-no-name",
    ),
    pytest.param({"tools": [{"type": "retrieval"}]}, "tools", "tools", id="tool-not-function"),
    pytest.param(
        {"tools": TOOLS, "tool_choice": "required", **BEAM},
        "tools",
        "beam search",
        id="beam-search-tools",
    ),
    pytest.param(
        {"guided_json": {"type": "object"}, **BEAM},
        "guided_json",
        "guided_json",
        id="beam-search-structured",
    ),
    pytest.param({"functions": [{"name": "f"}]}, "functions", "not supported", id="functions"),
]


@pytest.mark.parametrize(("fields", "param", "words"), REFUSALS)
def test_what_cannot_be_served_is_a_400_naming_its_field(router, fields, param, words):
    error = refused(router, fields)
    assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": {"type": "json_object"}},
        {"structured_outputs": {"regex": "[a-z]+"}},
        {"guided_choice": ["a", "b"]},
    ],
)
def test_beam_search_refuses_a_structured_output_by_name(router, fields):
    error = refused(router, {**BEAM, **fields})
    assert error["param"] == next(iter(fields)) and "beam search" in error["message"], error
    with router.client() as h:
        plain = {"messages": ASK, "max_tokens": 4, **BEAM, "response_format": {"type": "text"}}
        assert h.post(CHAT, json=plain).status_code == 200


@pytest.mark.parametrize("parser", sorted(AUTO_ANSWERS))
def test_auto_reads_each_parsers_calls_streamed_or_not(router, parser):
    parsing(router, enable_auto_tool_choice=True, tool_call_parser=parser)
    answer, content = AUTO_ANSWERS[parser]
    answering(router, answer)
    body = {"messages": ASK, "tools": TOOLS}  # tool_choice: auto, by default
    [choice] = post(router, body)["choices"]
    calls = [("get_weather", ARGUMENTS), ("now", "{}")]
    assert calls_of(choice["message"]) == calls and choice["message"]["content"] == content
    assert choice["finish_reason"] == "tool_calls"
    stream = streamed(router, body)
    assert calls_of(stream["message"]) == calls
    assert (stream["message"]["content"] or None) == content
    assert stream["finish_reason"] == "tool_calls"
    # No calls in the answer: it is content.
    answering(router, "It is sunny.")
    [choice] = post(router, body)["choices"]
    assert choice["message"] == {"role": "assistant", "content": "It is sunny."}
    assert choice["finish_reason"] == "stop"


def test_auto_leaves_a_malformed_call_as_content(router):
    parsing(router, enable_auto_tool_choice=True, tool_call_parser="hermes")
    answer = '<tool_call>{"name": "now", "arguments": {}</tool_call>'
    answering(router, answer)
    [choice] = post(router, {"messages": ASK, "tools": TOOLS})["choices"]
    assert choice["message"] == {"role": "assistant", "content": answer}
    assert choice["finish_reason"] == "stop"


def test_a_parser_whose_markers_are_special_tokens_hides_the_end_of_sequence(router):
    parsing(router, enable_auto_tool_choice=True, tool_call_parser="hermes")
    answering(router, "It is sunny.", end=True)
    [choice] = post(router, {"messages": ASK, "tools": TOOLS})["choices"]
    assert choice["message"]["content"] == "It is sunny."
    # Without tools the answer is decoded as the request asks.
    [choice] = post(router, {"messages": ASK})["choices"]
    assert choice["message"]["content"] == "It is sunny."
    [choice] = post(router, {"messages": ASK, "skip_special_tokens": False})["choices"]
    assert choice["message"]["content"] == "It is sunny.<|im_end|>"


def test_reasoning_is_split_off_streamed_or_not(router):
    parsing(router, reasoning_parser="qwen3")
    answering(router, "<think>Zürich in winter: cold.</think>\n\nIt is cold.")
    [choice] = post(router, {"messages": ASK})["choices"]
    expected = {
        "role": "assistant",
        "reasoning": "Zürich in winter: cold.",
        "content": "\n\nIt is cold.",
    }
    assert choice["message"] == expected
    stream = streamed(router, {"messages": ASK})
    assert stream["message"] == {
        "reasoning": expected["reasoning"], "content": expected["content"], "tool_calls": []
    }  # fmt: skip
    [choice] = post(router, {"messages": ASK, "include_reasoning": False})["choices"]
    assert choice["message"] == {
        "role": "assistant",
        "reasoning": None,
        "content": "\n\nIt is cold.",
    }


def test_a_constraint_starts_after_the_reasoning(router, model):
    parsing(router, reasoning_parser="qwen3")
    answering(router, f"<think>The user wants weather.</think>{REQUIRED_ANSWER}")
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required"}
    [choice] = post(router, body, "think-required")["choices"]
    end = model_text(model).encode("</think>", add_special_tokens=False)
    assert sent(router, "think-required").params.structured.starts_after == end
    assert choice["message"]["reasoning"] == "The user wants weather."
    assert calls_of(choice["message"]) == [("get_weather", ARGUMENTS), ("now", "{}")]
    assert calls_of(streamed(router, body)["message"]) == calls_of(choice["message"])
    # A prompt that closed the reasoning (the template told not to think): constrained from the
    # first token, and the answer is all answer.
    answering(router, REQUIRED_ANSWER)
    off = body | {"chat_template_kwargs": {"enable_thinking": False}}
    [choice] = post(router, off, "no-think-required")["choices"]
    assert sent(router, "no-think-required").params.structured.starts_after == []
    assert choice["message"]["reasoning"] is None and len(choice["message"]["tool_calls"]) == 2


def test_a_tool_result_round_trip_renders(router, model):
    conversation = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "reasoning": "I should look it up.",
            "tool_calls": [
                {
                    "id": "chatcmpl-tool-1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": ARGUMENTS},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "-3 °C, snow"},
    ]
    answering(router, "It is snowing, -3 °C.")
    [choice] = post(
        router, {"messages": conversation, "tools": TOOLS, "tool_choice": "none"}, "round"
    )["choices"]
    assert choice["message"]["content"] == "It is snowing, -3 °C."
    prompt = prompt_text(router, model, "round")
    assert "<think>I should look it up.</think>" in prompt
    call = json.dumps(
        {"name": "get_weather", "arguments": json.loads(ARGUMENTS)}, ensure_ascii=False
    )
    assert f"<tool_call>\n{call}\n</tool_call>" in prompt
    assert '<tool_response id="chatcmpl-tool-1">\n-3 °C, snow\n</tool_response>' in prompt


def test_the_openai_client_reads_the_tool_calls(router, model):
    client = openai.OpenAI(base_url=router.base_url + "/v1", api_key="x", max_retries=0)
    answering(router, REQUIRED_ANSWER)
    reply = client.chat.completions.create(
        model=model.name, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200
    )
    calls = reply.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", json.loads(ARGUMENTS)), ("now", {})
    ]  # fmt: skip
    assert reply.choices[0].finish_reason == "tool_calls"
    # Streamed, as a client accumulates it.
    parsing(router, enable_auto_tool_choice=True, tool_call_parser="hermes")
    answering(router, AUTO_ANSWERS["hermes"][0])
    arguments: dict[int, str] = {}
    names: dict[int, str] = {}
    finish = None
    for chunk in client.chat.completions.create(
        model=model.name, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=200, stream=True
    ):
        for delta_call in chunk.choices[0].delta.tool_calls or []:
            if delta_call.function.name:
                names[delta_call.index] = delta_call.function.name
            arguments[delta_call.index] = arguments.get(delta_call.index, "") + (
                delta_call.function.arguments or ""
            )
        finish = chunk.choices[0].finish_reason or finish
    assert names == {0: "get_weather", 1: "now"} and arguments == {0: ARGUMENTS, 1: "{}"}
    assert finish == "tool_calls"


def test_the_routers_flags(model):
    text = model_text(model)
    args = build_parser().parse_args(
        [
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "mistral",
            "--reasoning-parser",
            "deepseek_r1",
        ]
    )
    config = config_from_args(args, text, model)
    assert config.parsing == OutputParsing(True, "mistral", "deepseek_r1")
    with pytest.raises(ValueError, match="--enable-auto-tool-choice requires --tool-call-parser"):
        config_from_args(build_parser().parse_args(["--enable-auto-tool-choice"]), text, model)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--tool-call-parser", "nope"])


def test_a_structured_output_from_the_request_starts_after_the_reasoning_too(model):
    """A constraint the request asked for (``response_format`` and the like, parsed elsewhere
    into the params' spec) waits for the end of the thinking."""
    codec = model_text(model)
    asked = SamplingParams(structured=StructuredSpec("json_object"))
    thinking = codec.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    reasoning = OutputParsing(reasoning_parser="deepseek_r1")
    plan, params = plan_output(
        ToolChoice(NONE), None, None, True, reasoning, codec, thinking, asked
    )
    assert plan is not None and plan.thinking
    end = codec.encode("</think>", add_special_tokens=False)
    assert params.structured == StructuredSpec("json_object", starts_after=end)
    closed = codec.encode(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False
    )
    plan, params = plan_output(ToolChoice(NONE), None, None, True, reasoning, codec, closed, asked)
    assert plan is not None and not plan.thinking and params.structured == asked.structured


def test_a_forced_call_takes_the_place_of_a_structured_output_but_not_of_a_structural_tag(model):
    """As in vLLM: with tool_choice required, the answer is the call, so the tools' schema
    constrains it instead of the request's response_format; a structural tag stays, as it
    already says where each call goes."""
    codec = model_text(model)
    tools = [ToolParam.model_validate(NOW)]
    prompt = codec.encode("<|im_start|>assistant\n", add_special_tokens=False)
    asked = SamplingParams(structured=StructuredSpec("json_object"))
    plan, params = plan_output(
        ToolChoice(REQUIRED), tools, None, True, OutputParsing(), codec, prompt, asked
    )
    assert plan is not None and params.structured is not None
    assert params.structured.kind == "json_schema"
    assert json.loads(params.structured.text)["items"]["anyOf"][0]["properties"]["name"] == {
        "type": "string",
        "enum": [NOW["function"]["name"]],
    }
    structures = [{"begin": "<f>", "end": "</f>"}]
    tag = {"type": "structural_tag", "structures": structures, "triggers": ["<f>"]}
    tag = SamplingParams(structured=StructuredSpec("structural_tag", json.dumps(tag)))
    _, params = plan_output(
        ToolChoice(REQUIRED), tools, None, True, OutputParsing(), codec, prompt, tag
    )
    assert params.structured == tag.structured
