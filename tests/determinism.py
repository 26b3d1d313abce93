"""The requests and the checks of the deterministic-inference tests: a request's answer as exact
values, served alone or together, and the matrix of conditions that must not change it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from engines import build_engine
from tiny_models import VOCAB_SIZE, random_prompts

from common.config import SpeculativeConfig
from common.engine.llm_engine import LLMEngine
from common.sampling_params import SamplingParams

MAX_TOKENS = 10


@dataclass(frozen=True)
class Answer:
    """Everything a request got back, as exact values."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...]


def sampling_params(count: int, max_tokens: int = MAX_TOKENS) -> list[SamplingParams]:
    """Greedy requests with logprobs, and every third one seeded sampling."""
    return [
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=3, temperature=0.0)
        if i % 3
        else SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, logprobs=3, temperature=0.9, seed=1000 + i
        )
        for i in range(count)
    ]


def serve(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: list[SamplingParams],
    together: bool,
    cached_tokens: list[int] | None = None,
) -> list[Answer]:
    """Every prompt's answer: all in one batch (``together``) or one request at a time. Each
    request's prompt tokens found in the prefix cache are appended to ``cached_tokens``."""
    samples: dict[str, list] = {}
    cached: dict[str, int] = {}

    def run(batch: list[int]) -> None:
        for i in batch:
            samples[engine.add_request(prompts[i], params[i], request_id=f"r{i}")] = []
        while engine.has_unfinished:
            for output in engine.step():
                samples[output.request_id].extend(output.new_samples)
                cached[output.request_id] = output.num_cached_tokens

    if together:
        run(list(range(len(prompts))))
    else:
        for i in range(len(prompts)):
            run([i])
    if cached_tokens is not None:
        cached_tokens.extend(cached[f"r{i}"] for i in range(len(prompts)))
    return [
        Answer(
            tuple(s.token_id for s in samples[f"r{i}"]),
            tuple(s.logprob for s in samples[f"r{i}"]),
            tuple(tuple(s.top_logprobs) for s in samples[f"r{i}"]),
        )
        for i in range(len(prompts))
    ]


def tiny_prompts() -> list[list[int]]:
    """Prompts of 17 to 70 tokens (longer than one short attention run, some longer than a
    chunk), four of them sharing a 48-token prefix (three full pages) for cache hits."""
    prompts = random_prompts(5, seed=7, min_len=17, max_len=70)
    shared = torch.randint(1, VOCAB_SIZE, (48,), generator=torch.Generator().manual_seed(3))
    return [
        *prompts,
        *(shared.tolist() + p[:n] for p, n in zip(prompts, (3, 9, 17, 30, 40), strict=True)),
    ]


def assert_answers_are_invariant(
    folder, prompts: list[list[int]] | None = None, max_tokens: int = MAX_TOKENS, **knobs
) -> None:
    """The matrix: the answers to ``prompts`` (``tiny_prompts()`` by default; greedy and
    seeded, with logprobs) served one at a time are the same bits served together with every
    prompt's full pages cached, together under a 7-token budget without the cache, under a
    40-token budget, and (greedy ones) with n-gram speculation. ``knobs`` go to every engine,
    deterministic mode on."""
    prompts = prompts or tiny_prompts()
    params = sampling_params(len(prompts), max_tokens)
    knobs = {**knobs, "deterministic": True}
    engine = build_engine(folder, **knobs)
    alone = serve(engine, prompts, params, together=False)
    # The same engine again: every prompt now hits the cache (its full pages), in one batch.
    cached: list[int] = []
    assert serve(engine, prompts, params, together=True, cached_tokens=cached) == alone
    assert all(n >= 16 for n in cached)
    for engine in (
        build_engine(folder, **knobs, max_num_batched_tokens=7, prefix_caching=False),
        build_engine(folder, **knobs, max_num_batched_tokens=40),
    ):
        assert serve(engine, prompts, params, together=True) == alone
    greedy = [i for i, p in enumerate(params) if p.is_greedy]
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    speculating = build_engine(folder, **knobs, speculative=ngram)
    got = serve(speculating, [prompts[i] for i in greedy], [params[i] for i in greedy], True)
    assert got == [alone[i] for i in greedy]


def alone_and_batched_in_small_steps(
    folder, prompts: list[list[int]] | None = None, max_tokens: int = MAX_TOKENS, **knobs
) -> tuple[list[Answer], list[Answer]]:
    """The control's two runs, deterministic mode off: ``prompts`` (``tiny_prompts()`` by
    default) one at a time, and together in steps of at most 24 tokens."""
    prompts = prompts or tiny_prompts()
    params = sampling_params(len(prompts), max_tokens)
    alone = serve(build_engine(folder, **knobs), prompts, params, together=False)
    engine = build_engine(folder, **knobs, max_num_batched_tokens=24)
    return alone, serve(engine, prompts, params, together=True)
