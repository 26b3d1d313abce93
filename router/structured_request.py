"""A request's structured output, in any of the forms OpenAI and vLLM take, as one
``StructuredSpec``; and the check that it compiles before anything is sent.

The forms (one per request, as in vLLM):

- ``response_format``: ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}}`` (OpenAI's, and what its SDK's ``parse()`` sends), or vLLM's
  ``{"type": "structural_tag", ...}``;
- vLLM's ``structured_outputs``: exactly one of ``json``, ``regex``, ``choice``, ``grammar``
  (EBNF or Lark), ``json_object``, ``structural_tag``, with ``disable_any_whitespace`` and
  ``disable_additional_properties``;
- vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.

Whitespace between a JSON answer's tokens is bounded unless the request sets
``disable_any_whitespace: false``: vLLM frees it by default, and a small model sampling at a
temperature then runs on in whitespace until max_tokens, its object never closed. The check
compiles the spec with llguidance over the model's tokenizer (torch-free, lazily: nothing
precomputed, so a check takes milliseconds), within a time limit, and answers a 400 naming the
field where it fails or takes too long. Structural tags only xgrammar compiles: they are checked
on the workers, which fail the request with the compiler's words.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from common.structured import (
    CHOICE,
    GRAMMAR,
    JSON_OBJECT,
    JSON_SCHEMA,
    REGEX,
    STRUCTURAL_TAG,
    StructuredSpec,
)
from router.errors import BadRequest

# The request fields that ask for a structured output, in vLLM's order of precedence.
FORMS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
_GUIDED_KINDS = {
    "guided_json": JSON_SCHEMA,
    "guided_regex": REGEX,
    "guided_choice": CHOICE,
    "guided_grammar": GRAMMAR,
}
# structured_outputs' constraint keys, by kind.
_OUTPUT_KINDS = {
    "json": JSON_SCHEMA,
    "regex": REGEX,
    "choice": CHOICE,
    "grammar": GRAMMAR,
    "json_object": JSON_OBJECT,
    "structural_tag": STRUCTURAL_TAG,
}
# structured_outputs' keys that shape the constraint, and those that change nothing here (which
# library compiles it is the server's choice, as it is vLLM's).
_OUTPUT_OPTIONS = {"disable_any_whitespace", "disable_additional_properties"}
_OUTPUT_NEUTRAL = {"backend", "disable_fallback"}
# A field that vLLM accepts with any value and pdserve does not implement is refused by name
# where it is set (``router/openai_api.py``'s UNSUPPORTED_FIELDS takes the rest).
UNSUPPORTED = ("guided_whitespace_pattern", "whitespace_pattern")


def structured_spec(extra: dict[str, Any]) -> tuple[StructuredSpec, str] | None:
    """The request's structured output, and the field that asked for it; None for free text.
    ``extra``: the request's fields beyond the ones its model declares."""
    asked = [name for name in FORMS if _asks(name, extra.get(name))]
    if not asked:
        return None
    if len(asked) > 1:
        raise BadRequest(
            f"a request may ask for one structured output, not {' and '.join(asked)}", asked[1]
        )
    field = asked[0]
    value = extra[field]
    try:
        if field == "response_format":
            spec = _from_response_format(value)
        elif field == "structured_outputs":
            spec = _from_structured_outputs(value)
        else:
            spec = StructuredSpec(_GUIDED_KINDS[field], _text(value, _GUIDED_KINDS[field]))
    except ValueError as exc:
        raise BadRequest(f"{field}: {exc}", field) from None
    return spec, field


def _asks(name: str, value: Any) -> bool:
    if value is None:
        return False
    if name == "response_format":
        return not (isinstance(value, dict) and value.get("type") == "text")
    return True


def _from_response_format(value: Any) -> StructuredSpec:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ValueError("must be an object with a type")
    kind = value["type"]
    if kind == "json_object":
        return StructuredSpec(JSON_OBJECT)
    if kind == "json_schema":
        schema = value.get("json_schema")
        if not isinstance(schema, dict) or not isinstance(schema.get("schema"), dict):
            raise ValueError("json_schema.schema must be a JSON schema object")
        return StructuredSpec(JSON_SCHEMA, json.dumps(schema["schema"]))
    if kind == "structural_tag":
        return StructuredSpec(STRUCTURAL_TAG, json.dumps(value))
    raise ValueError(f"type must be text, json_object, json_schema or structural_tag, not {kind!r}")


def _from_structured_outputs(value: Any) -> StructuredSpec:
    if not isinstance(value, dict):
        raise ValueError("must be an object")
    unknown = set(value) - set(_OUTPUT_KINDS) - _OUTPUT_OPTIONS - _OUTPUT_NEUTRAL
    if unknown:
        raise ValueError(f"{', '.join(sorted(unknown))} is not supported by pdserve")
    asked = [key for key in _OUTPUT_KINDS if value.get(key) not in (None, False)]
    if len(asked) != 1:
        raise ValueError(
            f"must set exactly one of {', '.join(_OUTPUT_KINDS)}, not {asked or 'none'}"
        )
    key = asked[0]
    kind = _OUTPUT_KINDS[key]
    text = "" if kind == JSON_OBJECT else _text(value[key], kind)
    if kind == JSON_SCHEMA and value.get("disable_additional_properties"):
        text = json.dumps(_closed(json.loads(text)))
    any_whitespace = value.get("disable_any_whitespace") is False
    return StructuredSpec(
        kind, text, any_whitespace=any_whitespace and kind in (JSON_SCHEMA, JSON_OBJECT)
    )


def _text(value: Any, kind: str) -> str:
    """The spec's text from a field's value: a schema as an object or its JSON, a choice as a
    list, the others as strings."""
    if kind == JSON_SCHEMA:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"the schema is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("the schema must be a JSON object")
        return json.dumps(value)
    if kind == CHOICE:
        if not isinstance(value, list):
            raise ValueError("the choice must be a list of strings")
        return json.dumps(value)
    if kind == STRUCTURAL_TAG and isinstance(value, dict):
        return json.dumps(value)
    if not isinstance(value, str):
        raise ValueError(f"the {kind} must be a string")
    return value


def _closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that does not set it
    (vLLM's ``disable_additional_properties``)."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed(item) for key, item in schema.items()}
    if closed.get("type") == "object" and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


class GrammarCheck:
    """Compiles a spec with llguidance over the served model's tokenizer, off the event loop,
    within ``timeout_s``: a 400 naming ``field`` where that fails or takes too long."""

    def __init__(
        self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int], timeout_s: float
    ):
        self._hf_tokenizer = hf_tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self.timeout_s = timeout_s
        self._tokenizer: Any = None  # llguidance's view, made on the first check (~0.4 s)

    async def check(self, spec: StructuredSpec, field: str) -> None:
        if spec.kind == STRUCTURAL_TAG:
            return  # only xgrammar compiles one: the workers check it
        try:
            problem = await asyncio.wait_for(
                asyncio.to_thread(self._problem, spec), timeout=self.timeout_s
            )
        except TimeoutError:
            problem = (
                f"it takes more than {self.timeout_s:g} s to compile (--grammar-compile-timeout)"
            )
        if problem is not None:
            raise BadRequest(f"{field}: the {spec.kind} cannot be compiled: {problem}", field)

    def _problem(self, spec: StructuredSpec) -> str | None:
        # Imported here: the router loads llguidance on its first structured request only.
        from common.structured_grammar import grammar_problem, tokenizer_for

        if self._tokenizer is None:
            self._tokenizer = tokenizer_for(
                self._hf_tokenizer, self._vocab_size, self._stop_token_ids
            )
        return grammar_problem(spec, self._tokenizer)
