"""The whole engine on the Triton backend gives the torch backend's greedy tokens.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py), in float32: the
interpreter's `tl.dot` is wrong on bf16 operands in Triton 3.9.
"""

from __future__ import annotations

import pytest
from engines import build_engine
from tiny_models import build_tiny_model, random_prompts

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
            num_blocks=64,
            # Small chunks make steps that mix prefill chunks over cached prefixes with decodes.
            max_num_batched_tokens=24,
            max_model_len=256,
            **knobs,
        )
        assert engine.backend.name == backend
        tokens.append(engine.generate(prompts, params))
    return prompts, *tokens


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "int8"])
def test_triton_backend_matches_torch_backend(tmp_path, monkeypatch, kv_cache_dtype):
    folder = build_tiny_model("qwen3-qknorm", tmp_path / "model")
    _, expected, got = greedy_on_both_backends(folder, monkeypatch, kv_cache_dtype=kv_cache_dtype)
    assert got == expected
