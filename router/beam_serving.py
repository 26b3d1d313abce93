"""A beam-search request in flight: ``BeamSearch`` (router/beam_search.py) driven over the
router's ordinary request path, answered in the same bodies and chunks as any ``Run``.

All prompts of the request step together: each step sends every live beam of every prompt as a
one-token request (a prompt's beams as one group, so they go to one worker pair and share its
prefix cache: each step recomputes little more than the new token), waits for all of them, and
advances each search. When every search is done, each choice (prompt ``p``, beam ``b``, best
first, at index ``p * n + b`` as in vLLM) comes out as one finished update, so ``Run``'s
``body`` and ``sse`` answer unchanged. Whatever way it ends, ``close`` aborts the step in flight.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from common.protocol import TokenSample
from router.beam_search import Beam, BeamSearch, BeamSearchParams
from router.dispatcher import Generation
from router.errors import APIError
from router.policy import NoWorkerError
from router.serving import INTERRUPT, Choice, Run, Update


class BeamSearchRun(Run):
    def __init__(self, *args, eos_token_ids: frozenset[int] = frozenset(), **kwargs):
        super().__init__(*args, **kwargs)
        request = self.request
        self.params = BeamSearchParams(
            width=request.n,
            max_tokens=request.params.max_tokens,
            length_penalty=request.length_penalty,
            eos_token_ids=eos_token_ids,
            ignore_eos=request.params.ignore_eos,
            stop_token_ids=frozenset(request.params.stop_token_ids),
            stop=tuple(request.stop),
            include_stop_str=request.include_stop_str,
            logprobs=request.logprobs,
        )
        self.searches = [
            BeamSearch(prompt.token_ids, self.params, self._decode) for prompt in request.prompts
        ]
        # (prompt index, its beams' one-token requests) of the step in flight
        self.in_flight: list[tuple[int, list[Generation]]] = []
        self.steps = 0

    def submit(self) -> None:
        """Dispatch the first step; raises ``NoWorkerError`` (nothing dispatched then)."""
        self._dispatch_step()

    def close(self, cause: str) -> None:
        for _, group in self.in_flight:
            for gen in group:
                self.dispatcher.finish_early(gen, cause)  # a no-op for finished ones
        self.in_flight = []

    async def updates(self) -> AsyncIterator[Update]:
        while True:
            if not await self._step_answered():
                return  # interrupted: the client is gone
            for p, group in self.in_flight:
                if self.steps == 1:  # the request's own prompt: its prefix-cache hit
                    self.choices[p * self.request.n].gen.num_cached_tokens = max(
                        gen.num_cached_tokens for gen in group
                    )
                self.searches[p].advance([_scored(gen)[0] for gen in group])
            self.in_flight = []
            if all(search.done for search in self.searches):
                break
            try:
                self._dispatch_step()
            except NoWorkerError as exc:
                raise APIError(
                    503, f"no worker can serve the request: {exc}", code="no_worker"
                ) from None
        n = self.request.n
        for p, search in enumerate(self.searches):
            for b, beam in enumerate(search.best()):
                yield self._finish(self.choices[p * n + b], beam)

    def _dispatch_step(self) -> None:
        step_params = self.params.step_params()
        index = 0
        for p, search in enumerate(self.searches):
            if search.done:
                continue
            group = []
            for b, tokens in enumerate(search.pending()):
                group.append(
                    Generation(
                        request_id=f"{self.id}-beam{self.steps}-{p}-{b}",
                        prompt_token_ids=tokens,
                        params=step_params,
                        sink=self.sink,
                        index=index,
                        session_id=self.request.session_id,
                        arrived_at=time.monotonic(),
                        lora_name=self.request.lora_name,
                        cache_namespace=self.request.cache_namespace,
                    )
                )
                index += 1
            self.in_flight.append((p, group))
            # The first step's first prompt is the request's admission; the rest is its work.
            first = self.steps == 0 and not self.in_flight[:-1]
            self.dispatcher.submit(
                group, self.request.priority, refusable=first, queueable=self.steps == 0
            )
        self.steps += 1

    async def _step_answered(self) -> bool:
        """Wait until every beam of the step in flight has its token; False if interrupted."""
        waiting = [gen for _, group in self.in_flight for gen in group]
        while waiting:
            if await self.sink.get() == INTERRUPT:
                return False
            for gen in waiting:
                if gen.error is not None:
                    raise APIError(gen.error_status, gen.error, code="worker_failed")
                if gen.done and not gen.token_ids:
                    raise APIError(500, "a beam step ended without a token", code="internal_error")
            waiting = [gen for gen in waiting if not gen.done]
        return True

    def _finish(self, choice: Choice, beam: Beam) -> Update:
        text = beam.text if beam.text is not None else self._decode(beam.tokens)
        choice.text = text
        choice.consumed = len(beam.tokens)
        choice.finish_reason = beam.finish_reason
        choice.stop_reason = beam.stop_reason
        return Update(choice, text, beam.tokens, beam.samples, True)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokens.text(token_ids, self.request.skip_special_tokens)


def _scored(gen: Generation) -> list[TokenSample]:
    """A beam step's samples: its parameters always ask for logprobs (``step_params``)."""
    assert gen.scored is not None
    return gen.scored
