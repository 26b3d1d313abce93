"""Deterministic inference in one process: a request's tokens and logprobs are the same bits
alone or in a batch, under any chunk budget, with the prefix cache warm, cold or off, and with
speculation on or off; without the flag the same matrix shows a difference (so the flag is what
makes them equal).

The cluster-level half (P/D vs one process, ZeroMQ vs NIXL, several workers, 32 concurrent
requests) is in ``test_deterministic_cluster.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from engines import build_engine
from tiny_models import VOCAB_SIZE, build_tiny_model, random_prompts

from common.config import SpeculativeConfig
from common.engine.llm_engine import LLMEngine
from common.model.default_model import ensure_default_model
from common.sampling_params import SamplingParams
from kernels import cpu_library

pytestmark = pytest.mark.skipif(not cpu_library.available(), reason="needs the C kernels")

MAX_TOKENS = 10


@dataclass(frozen=True)
class Answer:
    """Everything a request got back, as exact values."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...]


def sampling_params(count: int) -> list[SamplingParams]:
    """Greedy requests with logprobs, and every third one seeded sampling."""
    return [
        SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3, temperature=0.0)
        if i % 3
        else SamplingParams(
            max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3, temperature=0.9, seed=1000 + i
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


@pytest.fixture(scope="module", params=["qwen2-bias", "qwen3-qknorm"])
def tiny_folder(request, tmp_path_factory):
    return build_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize(
    "dtype, kv",
    [("bfloat16", "auto"), ("float32", "auto"), ("bfloat16", "int8")],
    ids=["bfloat16", "float32", "bfloat16-kv=int8"],
)
def test_answers_do_not_depend_on_batch_chunks_cache_or_speculation(tiny_folder, dtype, kv):
    prompts = tiny_prompts()
    params = sampling_params(len(prompts))
    knobs = {"dtype": dtype, "kv_cache_dtype": kv, "deterministic": True}
    engine = build_engine(tiny_folder, **knobs)
    alone = serve(engine, prompts, params, together=False)
    # The same engine again: every prompt now hits the cache (its full pages), in one batch.
    cached: list[int] = []
    assert serve(engine, prompts, params, together=True, cached_tokens=cached) == alone
    assert all(n >= 16 for n in cached)
    for engine in (
        build_engine(tiny_folder, **knobs, max_num_batched_tokens=7, prefix_caching=False),
        build_engine(tiny_folder, **knobs, max_num_batched_tokens=40),
    ):
        assert serve(engine, prompts, params, together=True) == alone
    greedy = [i for i, p in enumerate(params) if p.is_greedy]
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    speculating = build_engine(tiny_folder, **knobs, speculative=ngram)
    got = serve(speculating, [prompts[i] for i in greedy], [params[i] for i in greedy], True)
    assert got == [alone[i] for i in greedy]


def test_without_the_flag_the_same_matrix_differs(tiny_folder) -> None:
    """The control: the default kernels block their sums by the shape of the step, so at least
    one logprob of the same requests changes between one at a time and batched in small
    chunks. (In bf16 a model this small rounds most such differences away; the SmolLM2 test
    below has the bf16 control.)"""
    prompts = tiny_prompts()
    params = sampling_params(len(prompts))
    alone = serve(build_engine(tiny_folder, deterministic=False), prompts, params, together=False)
    engine = build_engine(tiny_folder, deterministic=False, max_num_batched_tokens=24)
    assert serve(engine, prompts, params, together=True) != alone


@pytest.mark.slow
def test_smollm2_answers_do_not_depend_on_batch_chunks_or_cache() -> None:
    """The default model in bf16, its real shapes: 30 layers, 9 query and 3 KV heads."""
    folder = ensure_default_model(progress=False)
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(100, 40000, (n,), generator=generator).tolist() for n in (40, 75)]
    prompts.append([*prompts[1][:64], 17, 18])  # a four-page cache hit once prompt 1 ran
    params = sampling_params(len(prompts))
    engine = build_engine(folder, dtype="bfloat16", deterministic=True)
    cached: list[int] = []
    alone = serve(engine, prompts, params, together=False, cached_tokens=cached)
    assert cached[2] == 64
    assert serve(engine, prompts, params, together=True) == alone
    small_steps = {"max_num_batched_tokens": 24, "prefix_caching": False}
    chunked = build_engine(folder, dtype="bfloat16", deterministic=True, **small_steps)
    assert serve(chunked, prompts, params, together=True) == alone
    # The control, without the flag.
    default = build_engine(folder, dtype="bfloat16", deterministic=False)
    alone = serve(default, prompts, params, together=False)
    chunked = build_engine(folder, dtype="bfloat16", deterministic=False, **small_steps)
    assert serve(chunked, prompts, params, together=True) != alone
