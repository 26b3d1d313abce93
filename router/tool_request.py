"""A chat request's tools: their schema, ``tool_choice`` checked as vLLM checks it, tool calls and
results in the conversation, and the JSON schema that forces a call.

``tool_choice`` is ``none`` (tools in the prompt, no call read), ``auto`` (the model may call;
its answer is read by the server's ``--tool-call-parser``, which needs
``--enable-auto-tool-choice``), ``required`` or a named function. The last two are constrained
by a JSON schema (``forced_call_schema``), so they need no parser and serve any model.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from router.errors import BadRequest

logger = logging.getLogger(__name__)

NONE, AUTO, REQUIRED, NAMED = "none", "auto", "required", "named"
# vLLM's words for a named tool_choice it cannot read.
_NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    # A JSON schema of the arguments (an object); absent: any object.
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: FunctionDefinition

    def for_template(self) -> dict[str, Any]:
        """The tool as the chat template gets it (``apply_chat_template(tools=...)``), in the
        shape vLLM hands it over."""
        function = self.function.model_dump(exclude={"strict"})
        if self.function.strict is not None:
            function["strict"] = self.function.strict
        return {"type": self.type, "function": function}


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    # A JSON object as text, as OpenAI sends it back (some clients send the object itself).
    arguments: str | dict[str, Any] | None = None


class AssistantToolCall(BaseModel):
    """A tool call in an assistant message of the conversation."""

    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction

    def for_template(self) -> dict[str, Any]:
        """The call as chat templates read it: its arguments an object, not JSON text (the
        convention of transformers' templates, which vLLM follows). Arguments that are not a
        JSON object become an empty one, as vLLM makes them, so a conversation whose history
        holds a malformed call can go on."""
        arguments = self.function.arguments
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                arguments = None
        if not isinstance(arguments, dict):
            logger.warning("a tool call's arguments in the conversation are not a JSON object")
            arguments = {}
        function = {"name": self.function.name, "arguments": arguments}
        call: dict[str, Any] = {"type": "function", "function": function}
        if self.id is not None:
            call["id"] = self.id
        return call


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """What a request's ``tool_choice`` asks of the answer."""

    mode: str  # NONE, AUTO, REQUIRED or NAMED
    function: str | None = None  # NAMED: the function to call

    @property
    def forced(self) -> bool:
        return self.mode in (REQUIRED, NAMED)


def tool_choice_of(
    tools: list[ToolParam] | None, tool_choice: str | dict[str, Any] | None, auto_enabled: bool
) -> ToolChoice:
    """The request's tool choice, refused in vLLM's words where vLLM refuses it. Absent (or
    null) with tools, it is ``auto``, as in vLLM; ``auto`` needs the server's
    ``--enable-auto-tool-choice`` and ``--tool-call-parser``."""
    if tools is not None and not tools:
        raise BadRequest(
            "`tools` must not be an empty array. Either provide at least one tool or omit the "
            "field entirely.",
            "tools",
        )
    if tool_choice is None:
        tool_choice = AUTO if tools else NONE
    if tool_choice == NONE:
        return ToolChoice(NONE)
    if tools is None:
        raise BadRequest("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if isinstance(tool_choice, dict):
        return ToolChoice(NAMED, _named_function(tools, tool_choice))
    if tool_choice not in (AUTO, REQUIRED):
        raise BadRequest(
            f'Invalid value for `tool_choice`: {tool_choice!r:.80}! Only named tools, "none", '
            '"auto" or "required" are supported.',
            "tool_choice",
        )
    if tool_choice == AUTO and not auto_enabled:
        raise BadRequest(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
            "set",
            "tool_choice",
        )
    return ToolChoice(tool_choice)


def _named_function(tools: list[ToolParam], tool_choice: dict[str, Any]) -> str:
    if tool_choice.get("type", "function") != "function":
        raise BadRequest(
            f"Invalid value for `type` in `tool_choice`! {_NAMED_USAGE}", "tool_choice.type"
        )
    function = tool_choice.get("function")
    if not isinstance(function, dict):
        raise BadRequest(
            f"Invalid value for `function`: `{function!r:.80}` in `tool_choice`! {_NAMED_USAGE}",
            "tool_choice.function",
        )
    if "name" not in function:
        raise BadRequest(
            f"Expected field `name` in `function` in `tool_choice`! {_NAMED_USAGE}",
            "tool_choice.function.name",
        )
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise BadRequest(
            f"Invalid `name` in `function`: `{name!r:.80}` in `tool_choice`! {_NAMED_USAGE}",
            "tool_choice.function.name",
        )
    if all(tool.function.name != name for tool in tools):
        raise BadRequest(
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
            "tool_choice",
        )
    return name


def forced_call_schema(
    choice: ToolChoice, tools: list[ToolParam], parallel_tool_calls: bool | None
) -> dict[str, Any] | None:
    """The JSON schema a forced tool choice constrains the answer to, as vLLM builds it (its
    ``get_json_schema_from_tools``): for ``required``, a list of at least one
    ``{"name": <a tool's name>, "parameters": <its parameters' schema>}`` (at most one when
    ``parallel_tool_calls`` is false), the tools' ``$defs`` gathered at the top where the
    references point; for a named function, its parameters' schema. None for the others."""
    if choice.mode == NAMED:
        [tool] = [tool for tool in tools if tool.function.name == choice.function]
        return _parameters(tool)
    if choice.mode != REQUIRED:
        return None
    definitions: dict[str, Any] = {}
    alternatives = []
    for tool in tools:
        parameters = copy.deepcopy(_parameters(tool))
        for name, definition in _definitions(tool, parameters.pop("$defs", {})).items():
            if definitions.setdefault(name, definition) != definition:
                raise BadRequest(
                    f"Tool definition '{name}' has multiple schemas, which is not supported.",
                    "tools",
                )
        alternatives.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": alternatives},
    }
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return schema


def _parameters(tool: ToolParam) -> dict[str, Any]:
    # Absent or empty parameters still make the arguments a JSON object.
    return tool.function.parameters or {"type": "object", "properties": {}}


def _definitions(tool: ToolParam, definitions: object) -> dict[str, Any]:
    if not isinstance(definitions, dict):
        raise BadRequest(
            f"`$defs` in the parameters of tool '{tool.function.name}' must be an object, got "
            f"{type(definitions).__name__}.",
            "tools",
        )
    return definitions
