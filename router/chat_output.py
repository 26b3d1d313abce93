"""How a chat choice's text becomes its message: reasoning, content and tool calls.

``plan_output`` decides, per request, what its answer holds (from ``tool_choice``, the server's
``--tool-call-parser`` and ``--reasoning-parser``) and constrains a forced tool call with a JSON
schema; ``ChatOutput`` then reads one choice's text, whole (``message``) or as it streams
(``delta``: OpenAI's deltas of ``reasoning``, ``content`` and ``tool_calls``). A stream's deltas,
joined, are the whole message: both come from the same readings of the same text. A stream never
takes back what it sent, so where an answer turns out malformed after a call was announced (the
one place the two differ), the stream keeps that call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Protocol

from common.sampling_params import SamplingParams
from common.structured import JSON_SCHEMA, STRUCTURAL_TAG, StructuredSpec
from router.config import OutputParsing
from router.errors import BadRequest
from router.reasoning import reasoning_parser_class
from router.reasoning.base import ReasoningParser, Split
from router.tool_parsers import tool_parser_class
from router.tool_parsers.base import Parsed, ParsedCall, ToolParser
from router.tool_parsers.forced import NamedCallParser, RequiredCallsParser
from router.tool_request import (
    AUTO,
    NAMED,
    NONE,
    REQUIRED,
    ToolChoice,
    ToolParam,
    forced_call_schema,
)

# The prompt's last tokens, decoded, show whether the chat template closed the reasoning.
PROMPT_TAIL_TOKENS = 32


class Codec(Protocol):
    """What planning needs of the tokenizer (``common.tokenizer.Tokenizer``)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True, slots=True)
class ChatOutputPlan:
    """What a chat request's answer holds, the same for each of its choices."""

    tool_choice: ToolChoice
    tool_parser: str | None  # auto: the server's --tool-call-parser
    reasoning_parser: str | None  # the server's --reasoning-parser
    thinking: bool  # the answer begins inside the reasoning (the prompt did not close it)
    include_reasoning: bool = True
    single_call: bool = False  # parallel_tool_calls: false

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the answer must be decoded with its special tokens, for the parser to see
        its markers (as vLLM decodes it for these parsers)."""
        if self.tool_parser is None:
            return False
        return tool_parser_class(self.tool_parser).keeps_special_tokens

    def new_tool_parser(self) -> ToolParser | None:
        mode = self.tool_choice.mode
        if mode == REQUIRED:
            return RequiredCallsParser()
        if mode == NAMED:
            assert self.tool_choice.function is not None
            return NamedCallParser(self.tool_choice.function)
        if mode == AUTO:
            assert self.tool_parser is not None
            return tool_parser_class(self.tool_parser)()
        return None

    def new_reasoning_parser(self) -> ReasoningParser | None:
        if self.reasoning_parser is None:
            return None
        return reasoning_parser_class(self.reasoning_parser)(self.thinking)


def plan_output(
    choice: ToolChoice,
    tools: list[ToolParam] | None,
    parallel_tool_calls: bool | None,
    include_reasoning: bool,
    parsing: OutputParsing,
    codec: Codec,
    prompt_token_ids: list[int],
    params: SamplingParams,
) -> tuple[ChatOutputPlan | None, SamplingParams]:
    """The request's plan (None: its text is its content, as without tools), and its sampling
    params with the constraint a forced tool call needs. Where the server reads reasoning and the
    prompt leaves the model thinking, a constraint (the forced call's, or one the request asked
    for) starts after the end-of-reasoning marker's tokens, so the reasoning stays free, as vLLM
    applies it."""
    reasoning = parsing.reasoning_parser
    reasoning_cls = None if reasoning is None else reasoning_parser_class(reasoning)
    thinking = reasoning_cls is not None and not reasoning_cls.closed_in(
        codec.decode(prompt_token_ids[-PROMPT_TAIL_TOKENS:], False)
    )
    spec = params.structured
    schema = None if tools is None else forced_call_schema(choice, tools, parallel_tool_calls)
    # A forced call's schema takes the place of a structured output the request also asked for
    # (the answer is the call, not content), except a structural tag, which already says where
    # each call goes: vLLM's rule.
    if schema is not None and (spec is None or spec.kind != STRUCTURAL_TAG):
        try:
            spec = StructuredSpec(JSON_SCHEMA, json.dumps(schema))
        except ValueError as exc:
            raise BadRequest(
                f"the tools' schema cannot constrain the answer: {exc}", "tools"
            ) from None
    if spec is not None and thinking and not spec.starts_after:
        assert reasoning_cls is not None
        spec = replace(spec, starts_after=codec.encode(reasoning_cls.end, add_special_tokens=False))
    if spec is not params.structured:
        params = replace(params, structured=spec)
    if choice.mode == NONE and reasoning is None:
        return None, params
    plan = ChatOutputPlan(
        tool_choice=choice,
        tool_parser=parsing.tool_call_parser if choice.mode == AUTO else None,
        reasoning_parser=reasoning,
        thinking=thinking,
        include_reasoning=include_reasoning,
        single_call=parallel_tool_calls is False,
    )
    return plan, params


@dataclass(slots=True)
class Message:
    """A whole answer's fields: ``content`` None where vLLM answers null."""

    reasoning: str | None
    content: str | None
    tool_calls: list[dict[str, Any]]


@dataclass(slots=True)
class _Reading:
    reasoning: str
    content: str
    calls: list[ParsedCall]


@dataclass(slots=True)
class _SentCall:
    name: str
    arguments: str


class ChatOutput:
    """One choice's text read by its plan: ``message`` for a whole answer, or ``delta`` for each
    piece of a stream (one or the other). One instance per choice, on the event loop."""

    def __init__(self, plan: ChatOutputPlan) -> None:
        self.plan = plan
        self._reasoning = plan.new_reasoning_parser()
        self._tools = plan.new_tool_parser()
        self._text = ""
        self._called = False  # the answer has calls (a stream: it announced one)
        # What a stream has sent.
        self._sent_reasoning = ""
        self._sent_content = ""
        self._sent_calls: list[_SentCall] = []

    def message(self, text: str) -> Message:
        """The whole answer ``text`` as its message's fields."""
        reading = self._read(text, final=True)
        self._called = bool(reading.calls)
        reasoning = reading.reasoning or None
        if not self.plan.include_reasoning:
            reasoning = None
        calls = [
            {
                "id": self._new_call_id(),
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in reading.calls
        ]
        content: str | None = reading.content
        if self.plan.tool_choice.forced:
            content = ""  # vLLM's, for a forced call
        elif calls:
            content = reading.content if reading.content.strip() else None  # vLLM's null
        elif self._reasoning is not None:
            content = reading.content or None  # nothing after the reasoning: vLLM's null
        return Message(reasoning, content, calls)

    def delta(self, new_text: str, final: bool) -> dict[str, Any]:
        """A stream's delta for ``new_text`` (``final``: the answer is complete): what the
        reading of the text so far adds to what was sent. Empty where nothing is new yet."""
        reading = self._read(self._text + new_text, final)
        delta: dict[str, Any] = {}
        if self.plan.include_reasoning and len(reading.reasoning) > len(self._sent_reasoning):
            delta["reasoning"] = reading.reasoning[len(self._sent_reasoning) :]
            self._sent_reasoning = reading.reasoning
        content = self._content_to_send(reading, final)
        if content:
            delta["content"] = content
        calls = self._call_deltas(reading.calls)
        if calls:
            delta["tool_calls"] = calls
        return delta

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """vLLM's: ``tool_calls`` where the answer called (a stream: announced a call) and ended
        on its own; a named function's answer ends with ``stop``, as OpenAI's does."""
        if self._called and engine_reason == "stop" and self.plan.tool_choice.mode != NAMED:
            return "tool_calls"
        return engine_reason

    def _read(self, text: str, final: bool) -> _Reading:
        self._text = text
        split = Split("", text) if self._reasoning is None else self._reasoning.split(text, final)
        answer = split.answer
        parsed = Parsed(answer) if self._tools is None else self._tools.parse(answer, final)
        calls = parsed.calls[:1] if self.plan.single_call else parsed.calls
        return _Reading(split.reasoning, parsed.content, calls)

    def _content_to_send(self, reading: _Reading, final: bool) -> str:
        content = reading.content
        if self._sent_calls and not reading.calls:
            return ""  # the answer turned malformed after a call went out: that call stays
        # Whitespace before calls is no content (vLLM's null): held until text, or the end
        # without calls, shows it is.
        waiting = not final or reading.calls or self._sent_calls
        if self._tools is not None and not content.strip() and waiting:
            return ""
        if len(content) <= len(self._sent_content) or not content.startswith(self._sent_content):
            return ""
        new = content[len(self._sent_content) :]
        self._sent_content = content
        return new

    def _call_deltas(self, calls: list[ParsedCall]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(calls):
            if index == len(self._sent_calls):
                self._sent_calls.append(_SentCall(call.name, call.arguments))
                self._called = True
                deltas.append(
                    {
                        "index": index,
                        "id": self._new_call_id(),
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                )
                continue
            sent = self._sent_calls[index]
            grows = len(call.arguments) > len(sent.arguments)
            if call.name == sent.name and grows and call.arguments.startswith(sent.arguments):
                more = call.arguments[len(sent.arguments) :]
                deltas.append({"index": index, "function": {"arguments": more}})
                sent.arguments = call.arguments
        return deltas

    def _new_call_id(self) -> str:
        assert self._tools is not None  # calls come from a parser
        return self._tools.new_call_id()
