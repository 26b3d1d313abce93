"""The whole engine on the Triton backend gives the torch backend's greedy tokens.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py), in float32: the
interpreter's `tl.dot` is wrong on bf16 operands in Triton 3.9. On CUDA the same check runs on
the compiled kernels, bf16 included.
"""

from __future__ import annotations

import os

import pytest
from engines import build_engine
from tiny_models import assert_greedy_equal_up_to_near_ties, build_tiny_model, random_prompts

from common.sampling_params import SamplingParams
from kernels.registry import ENV_VAR


def greedy_on_both_backends(folder, monkeypatch, **knobs):
    """The prompts, then the greedy tokens of the torch backend's engine and of the Triton
    backend's, both built with ``knobs``."""
    prompts = random_prompts(3, seed=7, min_len=10, max_len=30)
    params = SamplingParams(max_tokens=10, temperature=0.0)
    tokens = []
    for backend in ("torch", "triton"):
        monkeypatch.setenv(ENV_VAR, backend)
        engine = build_engine(
            folder,
            num_pages=64,
            # Small chunks make steps that mix prefill chunks over cached prefixes with decodes.
            max_num_batched_tokens=24,
            max_model_len=256,
            **knobs,
        )
        assert engine.backend.name == backend
        tokens.append(engine.generate(prompts, params))
    return prompts, *tokens


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton reads CPU tensors only in its interpreter; on CUDA the compiled test runs",
)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "int8"])
def test_triton_backend_matches_torch_backend(tmp_path, monkeypatch, kv_cache_dtype):
    folder = build_tiny_model("qwen3-qknorm", tmp_path / "model")
    _, expected, got = greedy_on_both_backends(folder, monkeypatch, kv_cache_dtype=kv_cache_dtype)
    assert got == expected


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype, kv_cache_dtype",
    [
        ("float32", "auto"),
        ("float32", "fp8"),
        ("float32", "int8"),
        ("bfloat16", "auto"),
        ("bfloat16", "int8"),
    ],
)
def test_compiled_triton_backend_matches_torch_backend_on_cuda(
    tmp_path, monkeypatch, dtype, kv_cache_dtype
):
    """The kernels compiled for the GPU, not interpreted. In float32 both backends compute in
    IEEE float32 (no TF32) and give the same tokens; in bf16 they round at the same points but
    sum in different orders, so tokens may part only where two logits nearly tie."""
    folder = build_tiny_model("qwen3-qknorm", tmp_path / "model")
    prompts, expected, got = greedy_on_both_backends(
        folder, monkeypatch, device="cuda", dtype=dtype, kv_cache_dtype=kv_cache_dtype
    )
    if dtype == "float32":
        assert got == expected
    else:
        assert_greedy_equal_up_to_near_ties(folder, prompts, got, expected)
