"""Greedy tokens of the one-process engine equal transformers' in float32, for every family.

On the CPU this checks the CPU paths; the tests marked ``gpu`` check the engine on CUDA, with the
torch modules and with the compiled Triton kernels.
"""

from __future__ import annotations

import pytest
from engines import build_engine
from tiny_models import (
    FAMILIES,
    assert_greedy_equal_up_to_near_ties,
    build_tiny_model,
    hf_greedy,
    random_prompts,
)

from common.sampling_params import SamplingParams
from kernels.registry import ENV_VAR

NUM_PROMPTS = 8
NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
# Every prompt in one step unless a test chunks them.
ONE_STEP = 2048


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_case(request, tmp_path_factory):
    folder = build_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    prompts = random_prompts(NUM_PROMPTS, seed=len(request.param))
    return folder, prompts, hf_greedy(folder, prompts, NEW_TOKENS)


def test_eager_engine_equals_transformers_and_the_packed_engine(family_case):
    """--enforce-eager (plain torch modules) and the default CPU path (prepacked GEMMs, C
    kernels) give the same greedy tokens, and both give transformers' (fp32)."""
    folder, prompts, expected = family_case
    eager = build_engine(folder, max_num_batched_tokens=ONE_STEP, enforce_eager=True)
    assert eager.model.head is None
    assert eager.generate(prompts, GREEDY) == expected
    packed = build_engine(folder, max_num_batched_tokens=ONE_STEP)
    assert packed.model.head is not None
    assert packed.generate(prompts, GREEDY) == expected


def test_bf16_packed_engine_equals_eager(family_case):
    """In bf16 the two paths round at the same points and differ only in summation order: their
    tokens may part only where two logits nearly tie."""
    folder, prompts, _ = family_case
    knobs = {"dtype": "bfloat16", "max_num_batched_tokens": ONE_STEP}
    eager = build_engine(folder, **knobs, enforce_eager=True).generate(prompts, GREEDY)
    packed = build_engine(folder, **knobs).generate(prompts, GREEDY)
    assert_greedy_equal_up_to_near_ties(folder, prompts, packed, eager)


def test_prompts_alone(family_case):
    folder, prompts, expected = family_case
    engine = build_engine(folder, max_num_batched_tokens=ONE_STEP)
    got = [engine.generate([prompt], GREEDY)[0] for prompt in prompts]
    assert got == expected


@pytest.mark.parametrize("chunk", [ONE_STEP, 1, 7, 16, 64])
def test_batched_and_chunked(family_case, chunk):
    folder, prompts, expected = family_case
    engine = build_engine(folder, max_num_batched_tokens=chunk)
    assert engine.generate(prompts, GREEDY) == expected


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("chunk", [ONE_STEP, 7])
def test_cuda_engine_equals_transformers(family_case, monkeypatch, backend, chunk):
    """float32 on CUDA is IEEE float32 (torch leaves TF32 off for matrix products), so the engine
    gives transformers' tokens there too, whole prompts or 7-token chunks over cached prefixes."""
    folder, prompts, expected = family_case
    monkeypatch.setenv(ENV_VAR, backend)
    engine = build_engine(folder, device="cuda", max_num_batched_tokens=chunk)
    assert engine.backend.name == backend
    assert engine.generate(prompts, GREEDY) == expected
