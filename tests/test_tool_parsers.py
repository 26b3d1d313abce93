"""The tool-call parsers on answers in each model family's format, whole and streamed.

Each parser reads representative answers (several calls, nested and non-ASCII arguments, text
before the calls) and malformed ones (left as content, as vLLM leaves them). Every answer is also
streamed through ``ChatOutput`` in several chunkings, one character at a time included: the
deltas, joined, are the whole answer's message, and each call's first delta carries its id, type
and name before its arguments follow.
"""

from __future__ import annotations

import json

import pytest
from chat_streams import assert_stream_matches_message, stream

from router.chat_output import ChatOutput, ChatOutputPlan
from router.tool_parsers import tool_parser_class, tool_parser_names
from router.tool_parsers.base import ParsedCall
from router.tool_parsers.forced import NamedCallParser, RequiredCallsParser
from router.tool_parsers.json_text import NotJSON, scan_object, value_end
from router.tool_request import AUTO, NAMED, REQUIRED, ToolChoice

NESTED = {"city": "Zürich", "when": {"days": [1, 2], "tz": None}, "note": 'say "hi" {ok}'}
NESTED_JSON = json.dumps(NESTED, ensure_ascii=False)

# parser -> [(answer, expected content, expected calls as (name, arguments))]
WELL_FORMED = {
    "hermes": [
        (
            f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {NESTED_JSON}}}\n'
            '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
            "Let me look.\n",
            [("get_weather", NESTED_JSON), ("now", "{}")],
        ),
        # The arguments before the name; the last call without its closing tag; a closing tag
        # inside a string is the string's.
        (
            '<tool_call>{"arguments": {"q": "</tool_call>"}, "name": "search"}',
            "",
            [("search", '{"q": "</tool_call>"}')],
        ),
        ("Just text, no calls. <tool", "Just text, no calls. <tool", []),
    ],
    "llama3_json": [
        (
            f'<|python_tag|>{{"name": "get_weather", "parameters": {NESTED_JSON}}}; '
            '{"name": "now", "arguments": {}}',
            "",
            [("get_weather", NESTED_JSON), ("now", "{}")],
        ),
        ('{"name": "now", "parameters": {}}\nDone.', "", [("now", "{}")]),
        ('Here: {"name": "now", "parameters": {}}', 'Here: {"name": "now", "parameters": {}}', []),
    ],
    "mistral": [
        (
            f'Checking. [TOOL_CALLS] [{{"name": "get_weather", "arguments": {NESTED_JSON}}}, '
            '{"name": "now", "arguments": {}}]',
            "Checking. ",
            [("get_weather", NESTED_JSON), ("now", "{}")],
        ),
        (
            f"[TOOL_CALLS]get_weather[ARGS]{NESTED_JSON}[TOOL_CALLS]now[ARGS]{{}}",
            "",
            [("get_weather", NESTED_JSON), ("now", "{}")],
        ),
        ('[TOOL_CALLS]now{"tz": "UTC"}', "", [("now", '{"tz": "UTC"}')]),
    ],
    "pythonic": [
        (
            "[get_weather(city='Zürich', when={'days': [1, 2], 'tz': None}, "
            "note='say \"hi\" {ok}'), now()]",
            "",
            [("get_weather", NESTED_JSON), ("now", "{}")],
        ),
        (
            "[search(q='''two\nlines''', size=(800, 600), exact=true, offset=-3, ratio=+.5)]",
            "",
            [
                (
                    "search",
                    '{"q": "two\\nlines", "size": [800, 600], "exact": true, "offset": -3, '
                    '"ratio": 0.5}',
                )
            ],
        ),
        ("The answer is [1, 2].", "The answer is [1, 2].", []),
    ],
}

MALFORMED = {
    "hermes": [
        '<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>',  # the object never closes
        '<tool_call>{"name": "f", "arguments": {"x": 1}} trailing</tool_call>',
        '<tool_call>{"name": 7, "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f"}</tool_call>',  # no arguments
        '<tool_call>{"name": "f", "arguments": {"x": 1',  # cut short
        "<tool_call>not json</tool_call>",
    ],
    "llama3_json": [
        '{"name": "Alice", "age": 3}',
        '{"name": "f", "parameters": {}, "arguments": {}}',
        '{"name": "f", "parameters": {"x": ',
    ],
    "mistral": [
        '[TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}',  # the list never closes
        "[TOOL_CALLS]f[ARGS]not json",
        "[TOOL_CALLS]",
    ],
    "pythonic": [
        "[f(1, 2)]",  # positional arguments
        "[f(a=1)] and some text",
        "[f(a=x + 1)]",
        "[f(a=1, a=2)]",
        "[f(a=1), ",
        "[f(a=float('inf'))]",
    ],
}


def auto(parser: str) -> ChatOutputPlan:
    return ChatOutputPlan(ToolChoice(AUTO), parser, None, thinking=False)


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [(parser, *case) for parser, cases in WELL_FORMED.items() for case in cases],
)
def test_a_parser_reads_its_formats_calls(parser, text, content, calls):
    parsed = tool_parser_class(parser)().parse(text, final=True)
    assert parsed.content == content
    assert parsed.calls == [ParsedCall(name, arguments) for name, arguments in calls]
    for call in parsed.calls:
        json.loads(call.arguments)
    assert_stream_matches_message(auto(parser), text)


@pytest.mark.parametrize(
    ("parser", "text"), [(parser, text) for parser, texts in MALFORMED.items() for text in texts]
)
def test_a_malformed_answer_is_content(parser, text):
    parsed = tool_parser_class(parser)().parse(text, final=True)
    assert (parsed.content, parsed.calls) == (text, [])
    message = ChatOutput(auto(parser)).message(text)
    assert (message.content, message.tool_calls) == (text, [])


def test_whitespace_before_calls_is_no_content():
    text = '\n\n<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    assert ChatOutput(auto("hermes")).message(text).content is None
    assert stream(auto("hermes"), text, 1)[1] == ""
    # Without calls, whitespace is what the answer is.
    assert ChatOutput(auto("hermes")).message("\n\n").content == "\n\n"
    assert stream(auto("hermes"), "\n\n", 1)[1] == "\n\n"


def test_no_parallel_calls_keeps_the_first():
    plan = ChatOutputPlan(ToolChoice(AUTO), "hermes", None, thinking=False, single_call=True)
    text = WELL_FORMED["hermes"][0][0]
    message = ChatOutput(plan).message(text)
    assert [c["function"]["name"] for c in message.tool_calls] == ["get_weather"]
    assert [c["name"] for c in stream(plan, text, 1)[2]] == ["get_weather"]


def test_ids_are_vllms_and_mistrals():
    for parser in ("hermes", "llama3_json", "pythonic"):
        assert tool_parser_class(parser)().new_call_id().startswith("chatcmpl-tool-")
    mistral = tool_parser_class("mistral")().new_call_id()
    assert len(mistral) == 9 and mistral.isalnum()


def test_a_streamed_call_is_announced_when_its_name_is_whole_and_its_arguments_begin():
    output = ChatOutput(auto("hermes"))
    assert output.delta('<tool_call>{"name": "get_wea', final=False) == {}
    assert output.delta('ther", ', final=False) == {}
    [announced] = output.delta('"arguments": {"ci', final=False)["tool_calls"]
    assert announced["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert output.delta('ty": "Paris"}}', final=False)["tool_calls"] == [
        {"index": 0, "function": {"arguments": 'ty": "Paris"}'}}
    ]
    assert output.delta("</tool_call>", final=True) == {}
    assert output.finish_reason("stop") == "tool_calls"
    assert output.finish_reason("length") == "length"


FORCED = [
    (
        ToolChoice(REQUIRED),
        f'[{{"name": "get_weather", "parameters": {NESTED_JSON}}}, '
        '{"name": "now", "parameters": {}}]',
        [("get_weather", NESTED_JSON), ("now", "{}")],
    ),
    (ToolChoice(NAMED, "get_weather"), NESTED_JSON, [("get_weather", NESTED_JSON)]),
]


@pytest.mark.parametrize(("choice", "text", "calls"), FORCED, ids=["required", "named"])
def test_forced_calls_stream_as_they_come_whole(choice, text, calls):
    plan = ChatOutputPlan(choice, None, None, thinking=False)
    message = ChatOutput(plan).message(text)
    assert message.content == ""  # vLLM's, beside a forced call
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message.tool_calls] == (
        calls
    )
    assert_stream_matches_message(plan, text)
    output = ChatOutput(plan)
    output.message(text)
    assert output.finish_reason("stop") == ("stop" if choice.mode == NAMED else "tool_calls")


def test_a_forced_answer_that_does_not_parse_has_no_calls():
    for text in ('[{"name": "now", "parameters": {}}', "[]", '[{"name": "now"}]', "x"):
        assert RequiredCallsParser().parse(text, final=True).calls == []
    assert NamedCallParser("f").parse("  ", final=True).calls == []
    # Cut short: the arguments so far while streaming, no call in the whole answer.
    assert NamedCallParser("f").parse(' {"a": ', final=False).calls == [ParsedCall("f", '{"a": ')]
    assert NamedCallParser("f").parse(' {"a": ', final=True).calls == []
    assert NamedCallParser("f").parse(' {"a": 1}', final=True).calls == [
        ParsedCall("f", '{"a": 1}')
    ]


def test_the_registry_names_vllms_parsers():
    assert {"hermes", "llama3_json", "mistral", "pythonic"} <= set(tool_parser_names())
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'"):
        tool_parser_class("nope")


def test_json_text_sees_no_further_than_the_text():
    text = '{"a": [1, {"b": "x\\"}"}], "c": tru'
    scan = scan_object(text, 0)
    assert [m.key for m in scan.members] == ["a", "c"] and scan.end is None
    assert scan.members[0].value_text(text) == '[1, {"b": "x\\"}"}]'
    assert scan.members[1].value_end is None
    assert value_end("12", 0) is None and value_end("12,", 0) == 2
    for bad in ('{"a" 1}', '{"a": tx}', "{a: 1}", '{"a": "\x01"}', '{"a": 1]'):
        with pytest.raises(NotJSON):
            scan_object(bad, 0)
