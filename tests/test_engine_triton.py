"""The whole engine on the Triton backend gives the torch backend's greedy tokens.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py), in float32: the
interpreter's `tl.dot` is wrong on bf16 operands in Triton 3.9.
"""

from __future__ import annotations

import pytest
from tiny_models import build_tiny_model, random_prompts

from common.config import CacheConfig, EngineConfig, SchedulerConfig
from common.engine.llm_engine import LLMEngine
from common.sampling_params import SamplingParams
from kernels.registry import ENV_VAR


def make_engine(folder, kv_cache_dtype: str) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(folder),
            dtype="float32",
            device="cpu",
            cache=CacheConfig(block_size=16, num_blocks=64, kv_cache_dtype=kv_cache_dtype),
            # Small chunks make steps that mix prefill chunks over cached prefixes with decodes.
            scheduler=SchedulerConfig(max_num_batched_tokens=24, max_model_len=256),
        )
    )


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "int8"])
def test_triton_backend_matches_torch_backend(tmp_path, monkeypatch, kv_cache_dtype):
    folder = build_tiny_model("qwen3-qknorm", tmp_path / "model")
    prompts = random_prompts(3, seed=7, min_len=10, max_len=30)
    params = SamplingParams(max_tokens=10, temperature=0.0)
    monkeypatch.setenv(ENV_VAR, "torch")
    expected = make_engine(folder, kv_cache_dtype).generate(prompts, params)
    monkeypatch.setenv(ENV_VAR, "triton")
    engine = make_engine(folder, kv_cache_dtype)
    assert engine.backend.name == "triton"
    assert engine.generate(prompts, params) == expected
