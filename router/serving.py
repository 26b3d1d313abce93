"""One OpenAI request in flight: its sequences, their text, and the response bodies and chunks.

A ``Run`` creates a ``Generation`` per (prompt, choice), submits each prompt's choices together,
then turns token updates into text (incremental detokenizer with stop strings) and into
OpenAI's JSON: one body for a plain request, ``chat.completion.chunk`` / ``text_completion``
chunks for a streamed one. Whatever way it ends (done, client gone, error), ``close`` aborts
what is still running on the workers.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from common.protocol import TokenSample
from router.chat_output import ChatOutput
from router.detokenizer import IncrementalDetokenizer
from router.dispatcher import Dispatcher, Generation
from router.errors import APIError
from router.metrics import RouterMetrics
from router.openai_api import GenerationRequest

# JSON has no -inf; vLLM reports impossible tokens with this instead.
_MIN_LOGPROB = -9999.0
# On a run's sink instead of a choice's index: end its updates (the client is gone).
INTERRUPT = -1


class TokenText:
    """Token-level text for logprobs, memoised per token id."""

    def __init__(self, decode: Callable[[list[int], bool], str]):
        self._decode = decode
        self.token = lru_cache(maxsize=65536)(self._token)

    def _token(self, token_id: int) -> str:
        return self._decode([token_id], False)

    def text(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._decode(token_ids, skip_special_tokens)


@dataclass(slots=True)
class Choice:
    gen: Generation
    detok: IncrementalDetokenizer
    prompt_index: int
    consumed: int = 0  # tokens taken from gen.token_ids
    text: str = ""
    finish_reason: str | None = None
    # vLLM's stop_reason: the stop string or stop token id that ended the choice, else None.
    stop_reason: str | int | None = None
    sent_prompt_ids: bool = False
    echoed: bool = False  # (streamed) the echoed prompt's chunk has gone out
    text_offset: int = 0
    # Kept for a whole body: the tokens taken, and their samples where logprobs were asked for.
    token_ids: list[int] = field(default_factory=list)
    scored: list[TokenSample] = field(default_factory=list)
    # A chat answer's reasoning and tool calls, where the request has them.
    output: ChatOutput | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class Update:
    choice: Choice
    text: str
    token_ids: list[int]
    scored: list[TokenSample]  # the tokens' samples where logprobs were asked for, else empty
    finished: bool


class Run:
    def __init__(
        self,
        request: GenerationRequest,
        request_id: str,
        model_name: str,
        dispatcher: Dispatcher,
        text: TokenText,
        metrics: RouterMetrics,
        arrived_at: float,
    ):
        self.request = request
        self.id = request_id
        self.model = model_name
        self.dispatcher = dispatcher
        self.tokens = text
        self.metrics = metrics
        self.arrived_at = arrived_at
        self.created = int(time.time())
        self.sink: asyncio.Queue[int] = asyncio.Queue()
        self.choices: list[Choice] = []
        skip = frozenset(request.params.stop_token_ids) | request.hidden_token_ids
        for p, prompt in enumerate(request.prompts):
            for c in range(request.n):
                params = request.params_for_choice(c)
                gen = Generation(
                    request_id=f"{request_id}-{p}-{c}",
                    prompt_token_ids=prompt.token_ids,
                    params=params,
                    sink=self.sink,
                    index=len(self.choices),
                    session_id=request.session_id,
                    arrived_at=arrived_at,
                    lora_name=request.lora_name,
                    cache_namespace=request.cache_namespace,
                )
                detok = IncrementalDetokenizer(
                    lambda ids: text.text(list(ids), request.skip_special_tokens),
                    request.stop,
                    skip,
                    request.include_stop_str,
                )
                output = None if request.output is None else ChatOutput(request.output)
                self.choices.append(Choice(gen, detok, p, output=output))

    def submit(self) -> None:
        """Dispatch every choice (or queue it for a worker with room); raises ``NoWorkerError``
        or ``Overloaded`` (nothing dispatched then)."""
        n, priority = self.request.n, self.request.priority
        for p in range(len(self.request.prompts)):
            # The first prompt's admission is the request's: once it is in, so are the others.
            group = [c.gen for c in self.choices[p * n : (p + 1) * n]]
            self.dispatcher.submit(group, priority, refusable=p == 0)
        self.metrics.overhead_stage("dispatch").observe(time.monotonic() - self.arrived_at)

    def close(self, cause: str) -> None:
        for choice in self.choices:
            self.dispatcher.finish_early(choice.gen, cause)  # a no-op for finished sequences

    def interrupt(self) -> None:
        """End ``updates`` early (the client is gone)."""
        self.sink.put_nowait(INTERRUPT)

    async def updates(self) -> AsyncIterator[Update]:
        """Text and tokens as they arrive, per choice, until every choice is finished."""
        remaining = len(self.choices)
        while remaining:
            index = await self.sink.get()
            if index == INTERRUPT:
                return
            choice = self.choices[index]
            if choice.done:
                continue
            gen = choice.gen
            if gen.error is not None:
                raise APIError(gen.error_status, gen.error, code="worker_failed")
            new = gen.token_ids[choice.consumed :]
            text = choice.detok.add(new)
            # Tokens after the one that completed a stop string are not part of the answer.
            new = new[: choice.detok.tokens_taken]
            scored = gen.scored[choice.consumed : choice.consumed + len(new)] if gen.scored else []
            choice.consumed += len(new)
            if choice.detok.stopped:
                choice.finish_reason = "stop"
                choice.stop_reason = choice.detok.stop_reason
                self.dispatcher.finish_early(gen, "stop_string")
            elif gen.finish_reason is not None:
                text += choice.detok.finish()
                choice.finish_reason = gen.finish_reason
                choice.stop_reason = _stop_token(gen)
            choice.text += text
            if choice.done:
                remaining -= 1
                if gen.finished_at is not None:
                    self.metrics.overhead_stage("respond").observe(
                        time.monotonic() - gen.finished_at
                    )
            if text or new or choice.done:
                yield Update(choice, text, new, scored, choice.done)

    # -- bodies --------------------------------------------------------------------------------

    def usage(self) -> dict:
        prompt_tokens = sum(len(p.token_ids) for p in self.request.prompts)
        n = self.request.n
        cached = sum(
            max(c.gen.num_cached_tokens for c in self.choices[p * n : (p + 1) * n])
            for p in range(len(self.request.prompts))
        )
        completion = sum(c.consumed for c in self.choices)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def body(self) -> dict:
        async for update in self.updates():
            update.choice.token_ids.extend(update.token_ids)
            update.choice.scored.extend(update.scored)
        request = self.request
        choices: list[dict[str, Any]] = []
        for i, c in enumerate(self.choices):
            token_ids = c.token_ids if request.return_token_ids else None
            if request.chat:
                message = self._message(c)  # first: the finish reason depends on its calls
                finish = (
                    c.finish_reason if c.output is None else c.output.finish_reason(c.finish_reason)
                )
                choice: dict[str, Any] = {
                    "index": i,
                    "message": message,
                    "logprobs": self._chat_logprobs(c.scored),
                    "finish_reason": finish,
                    "stop_reason": c.stop_reason,
                }
                if token_ids is not None:
                    choice["token_ids"] = token_ids
            else:
                prefix = self._echo(c) if request.echo else ""
                if request.echo and request.logprobs is not None:
                    echoed, offset = self._echo_logprobs(c)
                    generated = self._completion_logprobs(c.scored, offset)
                    assert generated is not None  # the request has logprobs
                    logprobs: dict | None = {key: echoed[key] + generated[key] for key in echoed}
                else:
                    logprobs = self._completion_logprobs(c.scored, len(prefix))
                choice = {
                    "index": i,
                    "text": prefix + c.text,
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    "prompt_logprobs": self._prompt_logprobs(c),
                    # vLLM's completion choices always carry both keys.
                    "prompt_token_ids": self._prompt_ids(c) if token_ids is not None else None,
                    "token_ids": token_ids,
                }
            choices.append(choice)
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion" if request.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        }
        if request.chat:
            body["prompt_logprobs"] = self._prompt_logprobs(self.choices[0])
            if request.return_token_ids:
                body["prompt_token_ids"] = self.request.prompts[0].token_ids
        return body

    async def sse(self) -> AsyncIterator[bytes]:
        request = self.request
        for c in self.choices:
            # Opening chunks: the chat role (and echoed text).
            if request.chat:
                yield self._chunk(c, {"role": request.role, "content": ""}, None, None)
                if request.echo_text:
                    yield self._chunk(c, {"content": request.echo_text}, None, None)
        async for update in self.updates():
            c = update.choice
            if request.echo and not request.chat and not c.echoed:
                # The echoed prompt goes out with the first token, which brings the prompt's
                # logprobs (as in vLLM).
                c.echoed = True
                echo, logprobs = self._echo(c), None
                c.text_offset = len(echo)
                if request.logprobs is not None:
                    logprobs, c.text_offset = self._echo_logprobs(c)
                yield self._chunk(c, echo, logprobs, None)
            ids = update.token_ids
            if request.chat and c.output is not None:
                logprobs = self._chat_logprobs(update.scored)
                delta = c.output.delta(update.text, update.finished)
                if delta or update.finished or logprobs is not None or request.return_token_ids:
                    finish = c.output.finish_reason(c.finish_reason)
                    yield self._chunk(c, delta, logprobs, finish, ids)
            elif request.chat:
                logprobs = self._chat_logprobs(update.scored)
                delta = {"content": update.text} if update.text or not update.finished else {}
                yield self._chunk(c, delta, logprobs, c.finish_reason, ids)
            else:
                logprobs = self._completion_logprobs(update.scored, c.text_offset)
                c.text_offset += len(update.text)
                yield self._chunk(c, update.text, logprobs, c.finish_reason, ids)
        if request.include_usage:
            yield _sse(self._envelope([], usage=self.usage()))
        yield b"data: [DONE]\n\n"

    def _chunk(
        self,
        c: Choice,
        payload: dict | str,
        logprobs: dict | None,
        finish: str | None,
        token_ids: list[int] | None = None,
    ) -> bytes:
        request = self.request
        index = self.choices.index(c)
        key = "delta" if request.chat else "text"
        choice: dict[str, Any] = {
            "index": index,
            key: payload,
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": c.stop_reason if finish is not None else None,
        }
        extra: dict = {}
        if request.return_token_ids:
            # The prompt's ids ride on a choice's first chunk (on the envelope for chat), the
            # new tokens' ids on every chunk that has some.
            if not c.sent_prompt_ids:
                c.sent_prompt_ids = True
                if request.chat:
                    extra["prompt_token_ids"] = self._prompt_ids(c)
                else:
                    choice["prompt_token_ids"] = self._prompt_ids(c)
            if token_ids is not None:
                choice["token_ids"] = token_ids
        if request.continuous_usage:
            prompt_tokens = len(self._prompt_ids(c))
            extra["usage"] = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": c.consumed,
                "total_tokens": prompt_tokens + c.consumed,
            }
        elif request.include_usage:
            extra["usage"] = None
        return _sse(self._envelope([choice], **extra))

    def _envelope(self, choices: list, **extra) -> dict:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.request.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def _message(self, c: Choice) -> dict[str, Any]:
        """A whole chat answer's message: its text as content, or read by its output plan as
        reasoning, content and tool calls (vLLM's ``reasoning``, with --reasoning-parser)."""
        echo = self.request.echo_text
        if c.output is None:
            return {"role": self.request.role, "content": echo + c.text}
        parts = c.output.message(c.text)
        content = parts.content if not echo else echo + (parts.content or "")
        message: dict[str, Any] = {"role": self.request.role, "content": content}
        if c.output.plan.reasoning_parser is not None:
            message["reasoning"] = parts.reasoning
        if parts.tool_calls:
            message["tool_calls"] = parts.tool_calls
        return message

    def _prompt_ids(self, c: Choice) -> list[int]:
        return self.request.prompts[c.prompt_index].token_ids

    def _echo(self, c: Choice) -> str:
        if self.request.return_token_ids:
            return ""  # the prompt comes back as ids instead (vLLM's rule)
        prompt = self.request.prompts[c.prompt_index]
        if prompt.text is not None:
            return prompt.text
        # Special tokens included, as vLLM echoes them: the echoed prompt's logprobs name every
        # token and count its characters in text_offset, and the text must agree with them.
        return self.tokens.text(prompt.token_ids, False)

    def _token_name(self, token_id: int) -> str:
        if self.request.tokens_as_ids:
            return f"token_id:{token_id}"
        return self.tokens.token(token_id)

    def _chat_logprobs(self, samples: list[TokenSample]) -> dict | None:
        if self.request.logprobs is None:
            return None
        content = []
        for s in samples:
            token = self._token_name(s.token_id)
            content.append(
                {
                    "token": token,
                    "logprob": _lp(s.logprob),
                    "bytes": list(token.encode()),
                    "top_logprobs": [
                        {"token": t, "logprob": _lp(lp), "bytes": list(t.encode())}
                        for t, lp in self._alternatives(s)
                    ],
                }
            )
        return {"content": content}

    def _completion_logprobs(self, samples: list[TokenSample], offset: int) -> dict | None:
        if self.request.logprobs is None:
            return None
        tokens: list[str] = []
        lps: list[float | None] = []
        tops: list[dict[str, float | None] | None] = []
        offsets: list[int] = []
        for s in samples:
            token = self._token_name(s.token_id)
            tokens.append(token)
            lps.append(_lp(s.logprob))
            if s.logprob is None:  # an echoed prompt's first token: nothing comes before it
                tops.append(None)
            else:
                # The legacy API's top_logprobs holds the sampled token too (first), then the
                # alternatives: up to logprobs + 1 entries, so logprobs=0 gives the sampled one.
                top = {token: _lp(s.logprob)}
                for t, lp in self._alternatives(s):
                    top.setdefault(t, _lp(lp))
                tops.append(top)
            offsets.append(offset)
            offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _echo_logprobs(self, c: Choice) -> tuple[dict, int]:
        """The legacy logprobs of an echoed prompt, each token scored given those before it (the
        first one has nothing before it), and the text offset after it."""
        k = self.request.logprobs or 0
        scored = {
            i + 1: TokenSample(p.token_id, p.logprob, p.top_token_ids[:k], p.top_logprobs[:k])
            for i, p in enumerate(c.gen.prompt_logprobs or [])
        }
        samples = [scored.get(i, TokenSample(t)) for i, t in enumerate(self._prompt_ids(c))]
        page = self._completion_logprobs(samples, 0)
        assert page is not None  # the request has logprobs
        end = page["text_offset"][-1] + len(page["tokens"][-1])
        return page, end

    def _prompt_logprobs(self, c: Choice) -> list[dict | None] | None:
        """vLLM's ``prompt_logprobs``: per prompt token (none for the first), the token and its
        alternatives by id, each with its logprob, rank and text."""
        scored = c.gen.prompt_logprobs
        if self.request.params.prompt_logprobs is None or scored is None:
            return None
        out: list[dict | None] = [None]
        for p in scored:
            entry = {str(p.token_id): self._ranked(p.token_id, p.logprob, p.rank)}
            for rank, (alt, lp) in enumerate(zip(p.top_token_ids, p.top_logprobs, strict=True)):
                entry.setdefault(str(alt), self._ranked(alt, lp, rank + 1))
            out.append(entry)
        return out

    def _ranked(self, token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": _lp(logprob), "rank": rank, "decoded_token": self._token_name(token_id)}

    def _alternatives(self, s: TokenSample) -> list[tuple[str, float | None]]:
        if not s.top_token_ids:
            return []
        lps: Sequence[float | None] = s.top_logprobs or [None] * len(s.top_token_ids)
        return [(self._token_name(t), lp) for t, lp in zip(s.top_token_ids, lps, strict=False)]


def _stop_token(gen: Generation) -> int | None:
    """The stop token id a finished sequence ended on, if it ended on one of its own
    ``stop_token_ids`` (not on EOS or its length)."""
    if gen.finish_reason != "stop" or not gen.token_ids:
        return None
    last = gen.token_ids[-1]
    return last if last in gen.params.stop_token_ids else None


def _lp(value: float | None) -> float | None:
    if value is None:
        return None
    return value if math.isfinite(value) else _MIN_LOGPROB


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
