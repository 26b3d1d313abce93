"""The reasoning parsers: an answer's ``<think>`` part split off into ``reasoning``, whole and
streamed (the deltas, joined, are the whole answer's message), with and without tool calls."""

from __future__ import annotations

import pytest
from chat_streams import assert_stream_matches_message, stream

from router.chat_output import ChatOutput, ChatOutputPlan
from router.reasoning import reasoning_parser_class, reasoning_parser_names
from router.tool_request import AUTO, NONE, REQUIRED, ToolChoice

CALL = '<tool_call>{"name": "now", "arguments": {"tz": "UTC"}}</tool_call>'


def plan(parser: str, thinking: bool = True, **kwargs) -> ChatOutputPlan:
    return ChatOutputPlan(ToolChoice(NONE), None, parser, thinking, **kwargs)


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        ("<think>Two and two.\nFour.</think>\n\nIt is 4.", "Two and two.\nFour.", "\n\nIt is 4."),
        # The template opened the think block in the prompt: the answer starts inside it.
        ("Two and two.</think>It is 4.", "Two and two.", "It is 4."),
        # Cut short while thinking: all reasoning, as vLLM reads it.
        ("<think>Two and", "Two and", None),
        ("<think></think>It is 4.", None, "It is 4."),
        ("  <think>x</think>y</think>", "x", "y</think>"),
    ],
)
def test_the_think_block_is_the_reasoning(parser, text, reasoning, content):
    message = ChatOutput(plan(parser)).message(text)
    assert (message.reasoning, message.content) == (reasoning, content)
    assert message.tool_calls == []
    assert_stream_matches_message(plan(parser), text)


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_a_prompt_that_closed_the_reasoning_leaves_all_answer(parser):
    cls = reasoning_parser_class(parser)
    assert cls.closed_in("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not cls.closed_in("<|im_start|>assistant\n<think>\n")
    assert not cls.closed_in("<|im_start|>assistant\n")
    message = ChatOutput(plan(parser, thinking=False)).message("It is 4.</think>")
    assert (message.reasoning, message.content) == (None, "It is 4.</think>")


def test_a_stream_holds_back_what_could_be_a_marker():
    output = ChatOutput(plan("deepseek_r1"))
    assert output.delta("<thi", final=False) == {}
    assert output.delta("nk>Hmm</th", final=False) == {"reasoning": "Hmm"}
    assert output.delta("ink>Yes", final=False) == {"content": "Yes"}
    assert output.delta("", final=True) == {}


def test_qwen3_may_call_a_tool_from_its_thinking_and_deepseek_r1_may_not():
    both = ChatOutputPlan(ToolChoice(AUTO), "hermes", "qwen3", thinking=True)
    message = ChatOutput(both).message(f"<think>Which zone? UTC. {CALL}")
    assert message.reasoning == "Which zone? UTC. "
    assert [c["function"]["arguments"] for c in message.tool_calls] == ['{"tz": "UTC"}']
    assert_stream_matches_message(both, f"<think>Which zone? UTC. {CALL}")
    r1 = ChatOutputPlan(ToolChoice(AUTO), "hermes", "deepseek_r1", thinking=True)
    message = ChatOutput(r1).message(f"<think>Which zone? UTC. {CALL}")
    assert message.reasoning == f"Which zone? UTC. {CALL}" and not message.tool_calls


def test_reasoning_then_a_forced_call():
    both = ChatOutputPlan(ToolChoice(REQUIRED), None, "qwen3", thinking=True)
    text = '<think>The time.</think>[{"name": "now", "parameters": {}}]'
    message = ChatOutput(both).message(text)
    assert message.reasoning == "The time." and message.content == ""
    assert [c["function"]["name"] for c in message.tool_calls] == ["now"]
    assert_stream_matches_message(both, text)


def test_include_reasoning_false_leaves_it_out():
    hidden = plan("qwen3", include_reasoning=False)
    message = ChatOutput(hidden).message("<think>secret</think>4")
    assert (message.reasoning, message.content) == (None, "4")
    assert stream(hidden, "<think>secret</think>4", 1) == ("", "4", [])


def test_the_registry_names_vllms_parsers():
    assert {"deepseek_r1", "qwen3"} <= set(reasoning_parser_names())
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        reasoning_parser_class("nope")
