"""OpenAI request bodies (the schema the app publishes) and their checked, typed form.

The pydantic models describe what a client may send; ``to_generation`` turns one into a
``GenerationRequest`` (tokenized prompts, validated ``SamplingParams``), raising ``BadRequest``
(400, naming the parameter) for anything out of range.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol, TypeGuard, TypeVar

from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field

from common.sampling_params import MAX_BAD_WORDS, MAX_LOGPROBS, SamplingParams
from common.structured import StructuredSpec
from router.beam_search import MAX_BEAM_WIDTH
from router.chat_output import ChatOutputPlan, plan_output
from router.config import OutputParsing
from router.errors import BadRequest
from router.structured_request import structured_spec
from router.tool_request import AssistantToolCall, ToolParam, tool_choice_of

MAX_N = 128
# A seed is a signed 64-bit integer, as in OpenAI's schema and vLLM (torch.long); the schema
# refuses others with pydantic's less_than_equal / greater_than_equal errors.
SEED_MIN = -(1 << 63)
SEED_MAX = (1 << 63) - 1
MAX_STOP_STRINGS = 16
# Characters per stop string: every one is followed character by character as text arrives.
MAX_STOP_CHARS = 4096
# A worker walks these lists for every sequence at every step, and each travels in the request's
# control frame (1 MiB at most): a handful is what clients use, vLLM sets no bound.
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
# Prompts of one completion request: each is tokenized, routed and answered as n sequences of
# its own, so a list of thousands of one-token prompts costs the router far more than its bytes.
MAX_PROMPTS = 1024
# vLLM raises a temperature between 0 and this to it (smaller ones risk inf and NaN there), and
# a request samples here as it would there.
MIN_TEMPERATURE = 0.01
MAX_TEMPERATURE = 2.0
# A session id only picks a worker; a longer one is hashed once here instead of at every
# routing of every choice (a 4 MB `user` field would be hashed n times).
MAX_SESSION_ID_CHARS = 256


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    # Usage (so far) on every chunk, not only in a final chunk of its own.
    continuous_usage_stats: bool = False


class _SamplingBody(BaseModel):
    # Extra fields are kept (``model_extra``) so that ``refuse_unsupported`` can look at them.
    model_config = ConfigDict(extra="allow")

    # Absent: the served model, as in vLLM (the route fills it in).
    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    # vLLM's: a matched stop string ends the text instead of being cut from it.
    include_stop_str_in_output: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    # vLLM's: sample only among these tokens; never complete one of these words.
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Each prompt token's logprob given the ones before it, with this many alternatives.
    prompt_logprobs: int | None = None
    # vLLM's: the order in which requests waiting for room are served, lower first (the
    # router's queue, router/admission.py).
    priority: int = Field(default=0, ge=-(1 << 31), le=(1 << 31) - 1)
    # vLLM's extensions: the prompt's and each choice's token ids in the response, and tokens
    # in logprobs written as "token_id:N" (a token's text may not name it uniquely).
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: keep only this many of the prompt's tokens (-1: as many as the context holds),
    # dropping the others from the left (the default) or the right.
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] = "left"
    # vLLM's beam search: n beams, each step keeping the n best by cumulative logprob, and the
    # finished ones ranked by cumulative logprob / length ** length_penalty.
    use_beam_search: bool = False
    length_penalty: float = 1.0


class CompletionBody(_SamplingBody):
    prompt: str | list[int] | list[str] | list[list[int]] | None = None
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    # Any role goes to the chat template, as in vLLM (templates define their own, and OpenAI
    # still takes the deprecated "function"); the template decides what it accepts.
    role: str = Field(min_length=1, max_length=64)
    content: str | list[dict] | None = None
    name: str | None = None
    # An assistant turn's tool calls, and a tool's result (role "tool") naming the call it answers.
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None
    # An assistant turn's reasoning, for templates that show it (vLLM's name, and its older one).
    reasoning: str | None = None
    reasoning_content: str | None = None


class _ChatTemplateFields(BaseModel):
    # Render the assistant turn's header (the usual case), or leave the last message open so
    # the model continues it (a prefilled answer); never both.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: more variables for the chat template (say Qwen3's enable_thinking), and documents
    # for a template that grounds its answer in them.
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    # Functions the model may call, rendered by the chat template (router/tool_request.py).
    tools: list[ToolParam] | None = None


class ChatBody(_SamplingBody, _ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # The answer starts with the last message's content when that message has the answer's role.
    echo: bool = False
    # "none", "auto", "required" or {"type": "function", "function": {"name": ...}}, checked in
    # vLLM's words (router/tool_request.py); absent with tools: "auto".
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    # vLLM's: false leaves the reasoning out of the answer (with --reasoning-parser).
    include_reasoning: bool = True


class TokenizeBody(_ChatTemplateFields):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


@dataclass(slots=True)
class Prompt:
    token_ids: list[int]
    text: str | None  # the prompt as text, for echo


@dataclass(slots=True)
class GenerationRequest:
    """One OpenAI request, checked: each prompt is answered by ``n`` choices."""

    chat: bool
    model: str | None  # as the request named it; None: the served model
    prompts: list[Prompt]
    params: SamplingParams
    n: int
    stop: list[str]
    include_stop_str: bool
    stream: bool
    include_usage: bool
    logprobs: int | None  # alternatives per token; None: no logprobs
    echo: bool
    session_id: str | None
    skip_special_tokens: bool = True
    continuous_usage: bool = False  # usage on every streamed chunk
    return_token_ids: bool = False
    tokens_as_ids: bool = False  # logprobs name tokens "token_id:N"
    role: str = "assistant"  # the chat answer's role
    echo_text: str = ""  # what a chat answer starts with (echo)
    use_beam_search: bool = False  # n is the beam width (router/beam_search.py)
    length_penalty: float = 1.0
    priority: int = 0  # lower first, where requests wait for room
    # A chat answer's reasoning and tool calls (router/chat_output.py); None: its text is its
    # content.
    output: ChatOutputPlan | None = None
    # Tokens decoded with no text: the end-of-sequence tokens where the answer keeps its special
    # tokens for a tool-call parser.
    hidden_token_ids: frozenset[int] = frozenset()
    # The field that asked for the structured output in params.structured, for the compile
    # check's 400 to name (router/structured_request.py); None: free text.
    structured_field: str | None = None
    # The LoRA adapter the request names as its model (None: the base model), and the
    # prefix-cache namespace its prompts hash under (common/lora_adapters.py).
    lora_name: str | None = None
    cache_namespace: str = ""

    def params_for_choice(self, index: int) -> SamplingParams:
        """Choice ``index`` of a prompt: a seeded request uses seed + index per choice."""
        if self.params.seed is None or index == 0:
            return self.params
        return replace(self.params, seed=_wrap_seed(self.params.seed + index))


class TextCodec(Protocol):
    """What parsing needs of the tokenizer: ``common.tokenizer.Tokenizer`` in the router, a
    small stand-in in the tests."""

    vocab_size: int
    # The tokens that end a sequence (beam search ends beams on them itself).
    eos_token_ids: tuple[int, ...] = ()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each token as the vocabulary spells it (byte-level marks included)."""
        ...


def _off(value: Any) -> bool:
    return not value


def _no_ranking(value: Any) -> bool:
    return value is None or value == 1


def _no_tool_forced(value: Any) -> bool:
    return value in (None, "none", "auto")


def _on(value: Any) -> bool:
    return value is None or value is True


def _unit(value: Any) -> bool:
    return value is None or value == 1


# Fields of OpenAI's API, or vLLM's extensions to it, that change what the client gets and that
# pdserve does not implement, each with the test for the values that change nothing. Any other
# value is refused with a 400 naming the field: a client asking for JSON output must not get
# free text without a word. Fields that change nothing (``user``, ``metadata``, ``store``,
# ``service_tier``, ...) pass. Chat declares ``tools`` and ``tool_choice`` (router/tool_request.py);
# a completion has no tools.
UNSUPPORTED_FIELDS: dict[str, Callable[[Any], bool]] = {
    "best_of": _no_ranking,
    "suffix": _off,
    "tools": _off,
    "tool_choice": _no_tool_forced,
    "functions": _off,
    "function_call": _no_tool_forced,
    "guided_whitespace_pattern": _off,
    "prompt_embeds": _off,
    "prediction": _off,
    "audio": _off,
    "modalities": lambda value: value is None or value == ["text"],
    "chat_template": _off,
    "spaces_between_special_tokens": _on,
}


# The chat template renderer's own arguments (transformers' apply_chat_template), and the
# conversation's name inside the template: set by the request's fields and the server, never by
# chat_template_kwargs (``tokenize`` there would change what the renderer returns).
TEMPLATE_ARGUMENTS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs",
})  # fmt: skip


def refuse_unsupported(body: CompletionBody | ChatBody) -> None:
    """A 400 naming the first field whose value asks for something pdserve does not do."""
    for name, value in (body.model_extra or {}).items():
        accepts = UNSUPPORTED_FIELDS.get(name)
        if accepts is not None and not accepts(value):
            raise BadRequest(f"{name} is not supported by pdserve (got {value!r:.80})", name)
    best_of = (body.model_extra or {}).get("best_of")
    if best_of is not None and best_of < body.n:  # vLLM's words
        raise BadRequest(
            f"best_of must be greater than or equal to n, got n={body.n} and best_of={best_of}.",
            "best_of",
        )
    if body.stream_options is not None and not body.stream:
        raise BadRequest("stream_options is only allowed when stream is true", "stream_options")


def refuse_with_beam_search(body: CompletionBody | ChatBody) -> None:
    """A 400 for what beam search cannot honour: its beams are ranked by the model's raw
    logprobs, so anything that would change the scores is refused rather than ignored (vLLM
    ignores them); the sampling knobs (temperature, top_p, top_k, min_p, seed) choose nothing
    here and pass, as in vLLM."""
    if not 1 <= body.n <= MAX_BEAM_WIDTH:
        raise BadRequest(
            f"n is the beam width with use_beam_search and must be in [1, {MAX_BEAM_WIDTH}] "
            f"(each step asks for 2 * n logprobs, at most {MAX_LOGPROBS}), got {body.n}",
            "n",
        )
    if body.stream and isinstance(body, CompletionBody):  # vLLM's words
        raise BadRequest("Streaming is not currently supported with beam search", "stream")
    if isinstance(body, CompletionBody) and body.echo and body.logprobs is not None:
        raise BadRequest(
            "`echo` with `logprobs` is not supported with beam search because beam search "
            "does not compute prompt logprobs.",
            "echo",
        )
    if not math.isfinite(body.length_penalty):
        raise BadRequest(
            f"length_penalty must be finite, got {body.length_penalty}", "length_penalty"
        )
    neutral: dict[str, object] = {
        "prompt_logprobs": None,
        "presence_penalty": (None, 0),
        "frequency_penalty": (None, 0),
        "repetition_penalty": (None, 1),
        "logit_bias": (None, {}),
        "allowed_token_ids": None,
        "bad_words": (None, []),
        "min_tokens": 0,
    }
    for name, allowed in neutral.items():
        value = getattr(body, name)
        if value not in (allowed if isinstance(allowed, tuple) else (allowed,)):
            raise BadRequest(f"{name} is not supported with beam search (got {value!r:.80})", name)
    # A tool call needs every token constrained or the answer read as calls; beams are scored
    # and ended on raw tokens. (A structured output is refused by to_generation, which reads it.)
    if isinstance(body, ChatBody) and body.tools:
        raise BadRequest("tools are not supported with beam search", "tools")


def to_generation(
    body: CompletionBody | ChatBody,
    codec: TextCodec,
    max_model_len: int,
    session_id: str | None,
    default_max_tokens: int | None = None,
    *,
    max_request_tokens: int | None = None,
    parsing: OutputParsing | None = None,
) -> GenerationRequest:
    """The checked request. A chat request without ``max_tokens`` may use the rest of the
    context, as in vLLM, or at most ``default_max_tokens`` when the server sets it. The tokens
    it may generate, n x prompts x max_tokens, are at most ``max_request_tokens`` (None: any).
    ``parsing``: how the server reads chat answers (tool calls, reasoning; None: it does not)."""
    chat = isinstance(body, ChatBody)
    refuse_unsupported(body)
    if not 1 <= body.n <= MAX_N:
        raise BadRequest(f"n must be in [1, {MAX_N}], got {body.n}", "n")
    temperature = _temperature(body.temperature)
    structured = structured_spec(body.model_extra or {})
    if body.use_beam_search:
        refuse_with_beam_search(body)
        if structured is not None:
            raise BadRequest(
                f"{structured[1]} cannot be used with beam search (use_beam_search)",
                structured[1],
            )
    elif body.length_penalty != 1:
        raise BadRequest(
            f"length_penalty applies to beam search only (use_beam_search), got "
            f"{body.length_penalty}",
            "length_penalty",
        )
    elif temperature == 0 and body.n > 1:
        # vLLM's words: greedy choices are one answer n times over, each generated anew.
        raise BadRequest(f"n must be 1 when using greedy sampling, got {body.n}.", "n")
    messages: list[dict] = []
    parsing = parsing or OutputParsing()
    if isinstance(body, ChatBody):
        tool_choice = tool_choice_of(body.tools, body.tool_choice, parsing.auto_tool_choice)
        messages = chat_messages(body)
        prompts = [Prompt(encode_conversation(body, codec, messages), None)]
        logprobs = _chat_logprobs(body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        max_tokens_param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        defaulted = max_tokens is None
    else:
        prompts = _completion_prompts(body.prompt, codec)
        logprobs = body.logprobs
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise BadRequest(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}", "logprobs")
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        max_tokens_param = "max_tokens"
        defaulted = body.max_tokens is None
    if body.truncate_prompt_tokens is not None:
        prompts = [
            _truncated(p, body.truncate_prompt_tokens, body.truncation_side, max_model_len)
            for p in prompts
        ]
    for prompt in prompts:
        if not prompt.token_ids:
            raise BadRequest("the prompt is empty", "messages" if chat else "prompt")
        bad = [t for t in prompt.token_ids if not 0 <= t < codec.vocab_size]
        if bad:
            # vLLM's wording, which clients and tests match on.
            raise BadRequest(
                f"Token id {bad[0]} is out of vocabulary (the vocabulary has "
                f"{codec.vocab_size} tokens; ids must be in [0, {codec.vocab_size}))",
                "prompt",
            )
    longest = max(len(p.token_ids) for p in prompts)
    if longest >= max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {longest} input tokens. Please reduce the length of the input.",
            "messages" if chat else "prompt",
        )
    if max_tokens is None:
        max_tokens = max_model_len - longest
        if default_max_tokens is not None:
            max_tokens = min(max_tokens, default_max_tokens)
    if max_tokens < 1:
        raise BadRequest(f"{max_tokens_param} must be >= 1, got {max_tokens}", max_tokens_param)
    if longest + max_tokens > max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {longest + max_tokens} tokens ({longest} in the input, {max_tokens} for "
            f"the completion). Please reduce the input or {max_tokens_param}.",
            max_tokens_param,
        )
    if max_request_tokens is not None:
        _check_request_tokens(
            body.n, len(prompts), max_tokens, max_tokens_param, defaulted, max_request_tokens
        )
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise BadRequest(f"at most {MAX_STOP_STRINGS} stop strings are allowed", "stop")
    if not all(stop):  # vLLM's words: an empty string would end every text where it begins
        raise BadRequest("stop cannot contain an empty string.", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise BadRequest(f"a stop string may have at most {MAX_STOP_CHARS} characters", "stop")
    # Each once, as vLLM keeps them: one id sent a million times is one stop token.
    stop_token_ids = list(dict.fromkeys(body.stop_token_ids or []))
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise BadRequest(
            f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} distinct token ids, got "
            f"{len(stop_token_ids)}",
            "stop_token_ids",
        )
    prompt_logprobs = _prompt_logprobs(body, logprobs)
    logit_bias = _logit_bias(body.logit_bias, codec.vocab_size)
    bad_words = _bad_words_token_ids(body.bad_words, codec)
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=_default(body.top_p, 1.0),
            top_k=None if body.top_k in (None, 0, -1) else body.top_k,
            min_p=_default(body.min_p, 0.0),
            seed=body.seed,
            presence_penalty=_default(body.presence_penalty, 0.0),
            frequency_penalty=_default(body.frequency_penalty, 0.0),
            repetition_penalty=_default(body.repetition_penalty, 1.0),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            stop_token_ids=stop_token_ids,
            min_tokens=body.min_tokens,
            ignore_eos=body.ignore_eos,
            logit_bias=logit_bias,
            # Sorted and each once: the same whitelist, in fewer bytes on every hop.
            allowed_token_ids=(
                None if body.allowed_token_ids is None else sorted(set(body.allowed_token_ids))
            ),
            bad_words_token_ids=bad_words,
            structured=None if structured is None else structured[0],
        )
        params.check_token_ids(codec.vocab_size)
    except ValueError as exc:
        raise BadRequest(str(exc), str(exc).split(" ", 1)[0]) from None
    output = None
    if isinstance(body, ChatBody):
        output, params = plan_output(
            tool_choice, body.tools, body.parallel_tool_calls, body.include_reasoning, parsing,
            codec, prompts[0].token_ids, params,
        )  # fmt: skip
    keeps_special_tokens = output is not None and output.keeps_special_tokens
    return GenerationRequest(
        chat=chat,
        model=body.model,
        prompts=prompts,
        params=params,
        n=body.n,
        stop=stop,
        include_stop_str=body.include_stop_str_in_output,
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        logprobs=logprobs,
        echo=(not chat) and body.echo,
        session_id=_session_key(session_id or body.user),
        # A tool-call parser whose markers are special tokens reads the answer with them, as
        # vLLM reads it; the end-of-sequence token then ends it without text.
        skip_special_tokens=body.skip_special_tokens and not keeps_special_tokens,
        hidden_token_ids=frozenset(codec.eos_token_ids) if keeps_special_tokens else frozenset(),
        output=output,
        # As in vLLM, usage on every chunk needs include_usage too.
        continuous_usage=bool(
            body.stream_options
            and body.stream_options.include_usage
            and body.stream_options.continuous_usage_stats
        ),
        return_token_ids=bool(body.return_token_ids),
        tokens_as_ids=bool(body.return_tokens_as_token_ids),
        use_beam_search=body.use_beam_search,
        length_penalty=body.length_penalty,
        priority=body.priority,
        structured_field=_structured_field(structured, params),
        **(_chat_answer(body, messages) if isinstance(body, ChatBody) else {}),
    )


def _structured_field(
    asked: tuple[StructuredSpec, str] | None, params: SamplingParams
) -> str | None:
    """The field a constraint's compile check names: the one that asked for a structured output,
    or ``tools`` where the constraint forces a tool call (router/chat_output.py)."""
    if asked is not None:
        return asked[1]
    return None if params.structured is None else "tools"


def encode_conversation(
    body: ChatBody | TokenizeBody, codec: TextCodec, messages: list[dict]
) -> list[int]:
    """The conversation (``chat_messages(body)``) rendered by the chat template, tokenized."""
    if body.continue_final_message and body.add_generation_prompt:
        raise BadRequest(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            "continue_final_message",
        )
    kwargs = dict(body.chat_template_kwargs or {})
    reserved = sorted(kwargs.keys() & TEMPLATE_ARGUMENTS)
    if reserved:
        raise BadRequest(
            f"chat_template_kwargs may not set {', '.join(reserved)}: the request's own fields "
            "and the server give the template those",
            "chat_template_kwargs",
        )
    if body.documents is not None:
        kwargs["documents"] = body.documents
    if body.tools:
        kwargs["tools"] = [tool.for_template() for tool in body.tools]
    try:
        return codec.encode_chat(
            messages, body.add_generation_prompt, body.continue_final_message, kwargs
        )
    except (ValueError, TypeError, TemplateError) as exc:
        # A template that refuses a role or an order of turns says so by raising.
        raise BadRequest(
            f"the chat template cannot render these messages: {exc}", "messages"
        ) from None


def _chat_answer(body: ChatBody, messages: list[dict]) -> dict[str, str]:
    """The answer's role (the last message's when no generation prompt opens a new turn) and,
    for echo, the text it starts with: the last message's, when that has the same role."""
    role = "assistant" if body.add_generation_prompt else messages[-1]["role"]
    echo = messages[-1]["content"] if body.echo and messages[-1]["role"] == role else ""
    return {"role": role, "echo_text": echo}


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    """Token id -> bias added to its logit, clamped to [-100, 100] as in OpenAI's API."""
    if not bias:
        return {}
    if len(bias) > MAX_LOGIT_BIAS:
        raise BadRequest(
            f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(bias)}; to let only "
            "a few tokens be chosen, name them in allowed_token_ids",
            "logit_bias",
        )
    not_ids = [key for key in bias if not _is_int(key)]
    if not_ids:  # every one named, as vLLM does
        shown = ", ".join(f"{key!r:.40}" for key in not_ids[:16])
        raise BadRequest(f"logit_bias keys must be token ids, got {shown}", "logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token_id = int(key)
        if not 0 <= token_id < vocab_size:
            raise BadRequest(
                f"token_id(s) [{token_id}] in logit_bias contain out-of-vocab token ids "
                f"(vocabulary size {vocab_size})",
                "logit_bias",
            )
        if not math.isfinite(value):
            raise BadRequest(f"logit_bias values must be finite, got {value}", "logit_bias")
        out[token_id] = min(100.0, max(-100.0, float(value)))
    return out


def _bad_words_token_ids(words: list[str] | None, codec: TextCodec) -> list[list[int]]:
    """Each bad word as the token sequences that spell it (vLLM's rule): as it stands where a
    text begins, and after a space where that spells it in as many tokens but another first one
    (a word mid-sentence), so that it is banned in both places."""
    sequences: list[list[int]] = []
    for word in words or []:
        bare = codec.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            raise BadRequest(f"bad_words must hold words with text, got {word!r:.40}", "bad_words")
        sequences.append(bare)
        spaced = codec.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    if len(sequences) > MAX_BAD_WORDS:
        raise BadRequest(
            f"bad_words spell {len(sequences)} token sequences; at most {MAX_BAD_WORDS} are "
            "allowed",
            "bad_words",
        )
    outside = [t for sequence in sequences for t in sequence if not 0 <= t < codec.vocab_size]
    if outside:
        raise BadRequest(
            f"bad_words spell token ids {outside[:8]} outside the model's vocabulary of "
            f"{codec.vocab_size} tokens",
            "bad_words",
        )
    return sequences


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def _truncated(prompt: Prompt, keep: int, side: str, max_model_len: int) -> Prompt:
    """``prompt`` with only ``keep`` of its tokens (-1: what the context holds, less one for
    an output token), the rest dropped from ``side``; its text goes (echo then shows the ids
    that were kept, decoded)."""
    if keep == -1:
        keep = max_model_len - 1
    if len(prompt.token_ids) <= keep:
        return prompt
    kept = prompt.token_ids[-keep:] if side == "left" else prompt.token_ids[:keep]
    return Prompt(kept if keep else [], None)


def chat_messages(body: ChatBody | TokenizeBody) -> list[dict]:
    """The conversation as the chat template gets it: text parts joined, an assistant turn's
    tool calls and reasoning, a tool result's call id."""
    messages = []
    for m in body.messages or []:
        content = m.content
        if isinstance(content, list):
            # Only text parts are served; images and audio are not part of a text model's input.
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise BadRequest("only text content parts are supported", "messages")
                texts.append(part["text"])
            content = "\n".join(texts)
        message: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [call.for_template() for call in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
        if reasoning is not None:
            # Both names, as vLLM hands them over: templates read one or the other.
            message["reasoning"] = message["reasoning_content"] = reasoning
        messages.append(message)
    return messages


def _prompt_logprobs(body: CompletionBody | ChatBody, logprobs: int | None) -> int | None:
    """Alternatives per prompt token, or None. A completion that echoes its prompt with logprobs
    scores the prompt too (its logprobs then cover the prompt's tokens), as in vLLM."""
    asked = body.prompt_logprobs
    if asked is not None:
        if not 0 <= asked <= MAX_LOGPROBS:
            raise BadRequest(
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {asked}", "prompt_logprobs"
            )
        if body.stream and asked > 0:
            raise BadRequest(
                "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs"
            )
        return asked
    if isinstance(body, CompletionBody) and body.echo:
        return logprobs
    return None


def _chat_logprobs(body: ChatBody) -> int | None:
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise BadRequest("top_logprobs requires logprobs to be true", "top_logprobs")
        if not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise BadRequest(
                f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {body.top_logprobs}",
                "top_logprobs",
            )
    if not body.logprobs:
        return None
    return body.top_logprobs or 0


def _completion_prompts(
    prompt: str | list[int] | list[str] | list[list[int]] | None, codec: TextCodec
) -> list[Prompt]:
    if prompt is None:  # vLLM's wording (pdserve takes no prompt_embeds: they are refused)
        raise BadRequest("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    if isinstance(prompt, str):
        return [Prompt(codec.encode(prompt), prompt)]
    if not prompt:
        raise BadRequest("the prompt is empty", "prompt")
    if _all_of(prompt, int):
        return [Prompt(list(prompt), None)]
    if len(prompt) > MAX_PROMPTS:
        raise BadRequest(
            f"a request may hold at most {MAX_PROMPTS} prompts, got {len(prompt)}; send the others "
            "in further requests",
            "prompt",
        )
    if _all_of(prompt, str):
        return [Prompt(codec.encode(p), p) for p in prompt]
    if _all_of(prompt, list):
        return [Prompt(list(p), None) for p in prompt]
    raise BadRequest("prompt must be a string, a list of strings or token id lists", "prompt")


_T = TypeVar("_T")


def _all_of(values: list[Any], kind: type[_T]) -> TypeGuard[list[_T]]:
    return all(isinstance(v, kind) for v in values)


def _temperature(value: float | None) -> float:
    """The sampling temperature: 1 when absent, at most 2 as in OpenAI's API and vLLM, and one
    between 0 and ``MIN_TEMPERATURE`` raised to it, as vLLM does (0 is greedy). A negative or
    non-finite one is left for ``SamplingParams`` to refuse."""
    if value is None:
        return 1.0
    if value > MAX_TEMPERATURE:  # vLLM's words
        raise BadRequest(f"temperature must be in [0, 2], got {value}.", "temperature")
    return MIN_TEMPERATURE if 0 < value < MIN_TEMPERATURE else value


def _check_request_tokens(
    n: int, prompts: int, max_tokens: int, param: str, defaulted: bool, limit: int
) -> None:
    """A 400 when the request may generate more than ``limit`` tokens in all: each of its
    prompts is answered by n choices (n beams with beam search) of up to max_tokens each."""
    total = n * prompts * max_tokens
    if total > limit:
        each = f"{param}={max_tokens}{' by default' if defaulted else ''}"
        raise BadRequest(
            f"this request may generate up to {total} tokens (n={n} x {prompts} prompt(s) x "
            f"{each}), over the router's limit of {limit} per request (--max-request-tokens); "
            f"lower n, the number of prompts or {param}",
            param,
        )


def _session_key(session_id: str | None) -> str | None:
    """What routing keeps a conversation together by: the session id, a digest of a long one
    (the same id gives the same digest), or None for an empty one, which names no session."""
    if not session_id:
        return None
    if len(session_id) <= MAX_SESSION_ID_CHARS:
        return session_id
    digest = hashlib.blake2b(session_id.encode(), digest_size=16)
    return f"blake2b:{digest.hexdigest()}"


def _default(value: float | None, default: float) -> float:
    return default if value is None else value


def _wrap_seed(seed: int) -> int:
    """``seed`` back in the signed 64-bit range (seed + choice index can pass its top)."""
    return seed if seed <= SEED_MAX else seed - (1 << 64)
