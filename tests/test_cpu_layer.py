"""A bf16 decoder layer as one C call (``kernels/cpu/layer.py``) against the module path it
stands in for: the same token ids and logprobs, bit for bit, in decode steps and in the short
runs of speculative verification, over bf16, FP8 and int8 pages (int8 with its Hadamard turns);
and the cases it must leave to the module path."""

from __future__ import annotations

import pytest
import torch
from engines import build_engine
from tiny_models import build_tiny_model, random_prompts

from common.config import SpeculativeConfig
from common.engine.llm_engine import LLMEngine
from common.sampling_params import SamplingParams
from kernels.cpu import library as cpu_library
from kernels.cpu.layer import FusedDecoderLayer
from kernels.cpu.linear import TILES_ONLY

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path's kernels"),
    pytest.mark.skipif(not cpu_library.available(), reason="no C compiler for the CPU kernels"),
]


@pytest.fixture(autouse=True)
def tiles_at_every_row_count(monkeypatch):
    """The C layer runs the bf16 tiles. Which GEMM a bf16 model takes is a start-up probe's
    timing, and on models this small BLAS sometimes wins it: the tests here pin the tiles."""
    monkeypatch.setattr("kernels.layer_kernels.choose_gemm_plan", lambda linears: TILES_ONLY)


PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)


def serve(engine: LLMEngine, prompts: list[list[int]]) -> list[list[tuple[int, float]]]:
    ids = [engine.add_request(prompt, PARAMS) for prompt in prompts]
    out: dict[str, list[tuple[int, float]]] = {i: [] for i in ids}
    while engine.has_unfinished:
        for output in engine.step():
            out[output.request_id] += [(s.token_id, s.logprob) for s in output.new_samples]
    return [out[i] for i in ids]


FAMILIES = ["llama3-rope", "qwen2-bias", "mistral"]
# int8 pages turn heads by a Hadamard matrix, which needs a power-of-two head_dim (mistral's
# tiny model has 80).
LAYOUTS = [(family, kv) for kv in ("auto", "fp8") for family in FAMILIES] + [
    ("llama3-rope", "int8"),
    ("qwen2-bias", "int8"),
]


@pytest.mark.parametrize("speculating", [False, True], ids=["decode", "verification"])
@pytest.mark.parametrize("family, kv", LAYOUTS, ids=[f"{f}-kv={kv}" for f, kv in LAYOUTS])
def test_fused_layers_give_the_module_paths_bits(tmp_path, monkeypatch, family, speculating, kv):
    folder = build_tiny_model(family, tmp_path)
    # No prefix cache: the second pass must compute what the first did, not reuse its pages.
    speculative = (
        SpeculativeConfig(method="ngram", num_speculative_tokens=3) if speculating else None
    )
    engine = build_engine(
        folder, dtype="bfloat16", kv_cache_dtype=kv, prefix_caching=False, speculative=speculative
    )
    assert engine.model.fused_layers is not None
    prompts = [p + p for p in random_prompts(6, seed=4)]  # repeats give n-gram proposals
    calls = []
    real_call = FusedDecoderLayer.__call__
    monkeypatch.setattr(
        FusedDecoderLayer,
        "__call__",
        lambda self, *a: calls.append(a[0].shape[0]) or real_call(self, *a),
    )
    fused = serve(engine, prompts)
    assert calls and (max(calls) > len(prompts)) == speculating  # verification adds rows
    engine.model.fused_layers = None
    assert serve(engine, prompts) == fused


@pytest.mark.parametrize("speculating", [False, True], ids=["decode", "verification"])
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_fused_layers_attend_through_a_sliding_window(tmp_path, speculating, kv):
    """The module path's bits, the window passed to the C layer's attention: prompts and
    answers run past a window of 12, and the pages behind it go back to the pool."""
    folder = build_tiny_model("mistral", tmp_path, sliding_window=12)
    speculative = (
        SpeculativeConfig(method="ngram", num_speculative_tokens=3) if speculating else None
    )
    engine = build_engine(
        folder, dtype="bfloat16", kv_cache_dtype=kv, prefix_caching=False, speculative=speculative
    )
    assert engine.model.fused_layers is not None
    assert all(fused.weights.window == 12 for fused in engine.model.fused_layers)
    prompts = [p + p for p in random_prompts(6, seed=4)]
    fused = serve(engine, prompts)
    assert engine.scheduler.num_released_pages > 0
    engine.model.fused_layers = None
    assert serve(engine, prompts) == fused


@pytest.mark.parametrize(
    "family, dtype, kv",
    [
        ("qwen3-qknorm", "bfloat16", "auto"),  # query/key norms: not in the C layer
        ("llama3-rope", "float32", "auto"),  # float32 weights
        ("llama3-rope", "float32", "int8"),  # float32 weights, turned heads
    ],
)
def test_layers_the_c_layer_does_not_cover_keep_the_module_path(tmp_path, family, dtype, kv):
    folder = build_tiny_model(family, tmp_path)
    engine = build_engine(folder, dtype=dtype, kv_cache_dtype=kv)
    assert engine.model.fused_layers is None
    assert len(serve(engine, random_prompts(2, seed=5))[0]) == PARAMS.max_tokens
