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
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import lru_cache

from common.protocol import TokenSample
from router.detokenizer import IncrementalDetokenizer
from router.dispatcher import Dispatcher, Generation
from router.errors import APIError
from router.metrics import RouterMetrics
from router.openai_api import GenerationRequest

# JSON has no -inf; vLLM reports impossible tokens with this instead.
_MIN_LOGPROB = -9999.0
_INTERRUPT = -1


class TokenText:
    """Token-level text for logprobs, memoised per token id."""

    def __init__(self, decode: Callable[[list[int], bool], str], eos_token_ids: frozenset[int]):
        self._decode = decode
        self.eos_token_ids = eos_token_ids
        self.token = lru_cache(maxsize=65536)(self._token)

    def _token(self, token_id: int) -> str:
        return self._decode([token_id], False)

    def text(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._decode(token_ids, skip_special_tokens)


@dataclass(slots=True)
class _Choice:
    gen: Generation
    detok: IncrementalDetokenizer
    prompt_index: int
    consumed: int = 0  # samples taken from gen.samples
    text: str = ""
    finish_reason: str | None = None
    sent_role: bool = False
    text_offset: int = 0
    logprobs: list[TokenSample] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class _Update:
    choice: _Choice
    text: str
    samples: list[TokenSample]
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
        self.choices: list[_Choice] = []
        skip = frozenset(request.params.stop_token_ids)
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
                )
                detok = IncrementalDetokenizer(
                    lambda ids: text.text(list(ids), request.skip_special_tokens),
                    request.stop,
                    skip,
                )
                self.choices.append(_Choice(gen, detok, p))

    def submit(self) -> None:
        """Dispatch every choice; raises ``NoWorkerError`` (nothing dispatched then)."""
        n = self.request.n
        for p in range(len(self.request.prompts)):
            self.dispatcher.submit([c.gen for c in self.choices[p * n : (p + 1) * n]])
        self.metrics.overhead_stage("dispatch").observe(time.monotonic() - self.arrived_at)

    def close(self, cause: str) -> None:
        for choice in self.choices:
            self.dispatcher.finish_early(choice.gen, cause)  # a no-op for finished sequences

    def interrupt(self) -> None:
        """End ``updates`` early (the client is gone)."""
        self.sink.put_nowait(_INTERRUPT)

    async def updates(self) -> AsyncIterator[_Update]:
        """Text and tokens as they arrive, per choice, until every choice is finished."""
        remaining = len(self.choices)
        while remaining:
            index = await self.sink.get()
            if index == _INTERRUPT:
                return
            choice = self.choices[index]
            if choice.done:
                continue
            gen = choice.gen
            if gen.error is not None:
                raise APIError(gen.error_status, gen.error, code="worker_failed")
            new = gen.samples[choice.consumed :]
            text = choice.detok.add([s.token_id for s in new])
            # Tokens after the one that completed a stop string are not part of the answer.
            new = new[: choice.detok.tokens_taken]
            choice.consumed += len(new)
            if choice.detok.stopped:
                choice.finish_reason = "stop"
                self.dispatcher.finish_early(gen, "stop_string")
            elif gen.finish_reason is not None:
                text += choice.detok.finish()
                choice.finish_reason = gen.finish_reason
            choice.text += text
            if choice.done:
                remaining -= 1
                if gen.finished_at is not None:
                    self.metrics.overhead_stage("respond").observe(
                        time.monotonic() - gen.finished_at
                    )
            if text or new or choice.done:
                yield _Update(choice, text, new, choice.done)

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
            update.choice.logprobs.extend(update.samples)
        choices = []
        for i, c in enumerate(self.choices):
            if self.request.chat:
                choices.append(
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": c.text},
                        "logprobs": self._chat_logprobs(c.logprobs),
                        "finish_reason": c.finish_reason,
                    }
                )
            else:
                prefix = self._echo(c) if self.request.echo else ""
                choices.append(
                    {
                        "index": i,
                        "text": prefix + c.text,
                        "logprobs": self._completion_logprobs(c, c.logprobs, len(prefix)),
                        "finish_reason": c.finish_reason,
                    }
                )
        return {
            "id": self.id,
            "object": "chat.completion" if self.request.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        }

    async def sse(self) -> AsyncIterator[bytes]:
        if self.request.chat:
            for c in self.choices:
                yield self._chunk(c, {"role": "assistant", "content": ""}, None, None)
        elif self.request.echo:
            for c in self.choices:
                echo = self._echo(c)
                c.text_offset = len(echo)
                yield self._chunk(c, echo, None, None)
        async for update in self.updates():
            c = update.choice
            if self.request.chat:
                logprobs = self._chat_logprobs(update.samples)
                delta = {"content": update.text} if update.text or not update.finished else {}
                yield self._chunk(c, delta, logprobs, c.finish_reason)
            else:
                logprobs = self._completion_logprobs(c, update.samples, c.text_offset)
                c.text_offset += len(update.text)
                yield self._chunk(c, update.text, logprobs, c.finish_reason)
        if self.request.include_usage:
            yield _sse(self._envelope([], usage=self.usage()))
        yield b"data: [DONE]\n\n"

    def _chunk(self, c: _Choice, payload: dict | str, logprobs: dict | None, finish: str | None):
        index = self.choices.index(c)
        key = "delta" if self.request.chat else "text"
        choice = {"index": index, key: payload, "logprobs": logprobs, "finish_reason": finish}
        usage = {} if not self.request.include_usage else {"usage": None}
        return _sse(self._envelope([choice], **usage))

    def _envelope(self, choices: list, **extra) -> dict:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.request.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def _echo(self, c: _Choice) -> str:
        prompt = self.request.prompts[c.prompt_index]
        return prompt.text if prompt.text is not None else self.tokens.text(prompt.token_ids)

    def _chat_logprobs(self, samples: list[TokenSample]) -> dict | None:
        if self.request.logprobs is None:
            return None
        content = []
        for s in samples:
            token = self.tokens.token(s.token_id)
            content.append(
                {
                    "token": token,
                    "logprob": _lp(s.logprob),
                    "bytes": list(token.encode()),
                    "top_logprobs": [
                        {"token": t, "logprob": _lp(lp), "bytes": list(t.encode())}
                        for t, lp in _top(self.tokens, s)
                    ],
                }
            )
        return {"content": content}

    def _completion_logprobs(self, c: _Choice, samples: list[TokenSample], offset: int):
        if self.request.logprobs is None:
            return None
        tokens, lps, tops, offsets = [], [], [], []
        for s in samples:
            token = self.tokens.token(s.token_id)
            tokens.append(token)
            lps.append(_lp(s.logprob))
            tops.append({t: _lp(lp) for t, lp in _top(self.tokens, s)})
            offsets.append(offset)
            offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }


def _top(tokens: TokenText, s: TokenSample) -> list[tuple[str, float | None]]:
    if not s.top_token_ids:
        return []
    lps = s.top_logprobs or [None] * len(s.top_token_ids)
    return [(tokens.token(t), lp) for t, lp in zip(s.top_token_ids, lps, strict=False)]


def _lp(value: float | None) -> float | None:
    if value is None:
        return None
    return value if math.isfinite(value) else _MIN_LOGPROB


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
