"""A decoder layer over quantized weights as one C call (``kernels/cpu/layer.py``) against the
module path it stands in for: the same token ids and logprobs, bit for bit, for weight-only
4-bit (with and without offsets), FP8 with dynamic and static input scales, block FP8 (inputs
rounded per token group) and int8 W8A8 checkpoints, and a GGUF file, over bf16, FP8 and int8
pages, in decode steps and in speculative verification's short runs."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
import torch
from engines import build_engine
from gguf import GGMLQuantizationType
from tiny_gguf import VOCAB_SIZE, write_tiny_llama_gguf
from tiny_models import random_prompts, save_tiny_model, tiny_llama_config

from common.config import SpeculativeConfig
from common.engine.llm_engine import LLMEngine
from common.model.default_model import resolve_model_path
from common.model.quantization.writer import write_compressed_tensors
from common.sampling_params import SamplingParams
from kernels.cpu import library as cpu_library
from kernels.cpu.layer import FusedDecoderLayer
from kernels.cpu.linear import TILES_ONLY
from kernels.cpu.quantized_linear import CpuQuantizedLinear

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path's kernels"),
    pytest.mark.skipif(not cpu_library.available(), reason="no C compiler for the CPU kernels"),
]


@pytest.fixture(autouse=True)
def tiles_at_every_row_count(monkeypatch):
    """int8 pages' turns run as float32 tiles in the C layer; which GEMM a 16-bit linear takes
    is a start-up probe's timing, which BLAS sometimes wins on shapes this small."""
    monkeypatch.setattr("kernels.layer_kernels.choose_gemm_plan", lambda linears: TILES_ONLY)


# Widths that FP8's 128-blocks divide, as do groups of 64; heads of 64 (a power of two, which
# int8 pages' Hadamard turns need).
SHAPE = {"hidden_size": 256, "intermediate_size": 384, "num_attention_heads": 4}
GROUP_SIZE = 64
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("base") / "tiny"
    return save_tiny_model(tiny_llama_config(**SHAPE, tie_word_embeddings=False), folder)


def _checkpoint(scheme: str, base: Path, folder: Path) -> Path:
    if scheme == "GGUF_Q4_1":
        path = write_tiny_llama_gguf(folder / "q4_1.gguf", GGMLQuantizationType.Q4_1, seed=1)
        return resolve_model_path(path)
    # Static FP8 input scales: any amax serves a bit-for-bit comparison.
    return write_compressed_tensors(
        base, folder / "model", scheme, GROUP_SIZE, calibration=lambda: defaultdict(lambda: 4.0)
    )


def serve(engine: LLMEngine, prompts: list[list[int]]) -> list[list[tuple[int, float]]]:
    ids = [engine.add_request(prompt, PARAMS) for prompt in prompts]
    out: dict[str, list[tuple[int, float]]] = {i: [] for i in ids}
    while engine.has_unfinished:
        for output in engine.step():
            out[output.request_id] += [(s.token_id, s.logprob) for s in output.new_samples]
    return [out[i] for i in ids]


CASES = [
    ("W4A16", "auto", False),
    ("W4A16_ASYM", "fp8", False),
    ("FP8_DYNAMIC", "auto", False),
    ("FP8_DYNAMIC", "int8", True),
    ("FP8", "auto", False),
    ("FP8_BLOCK", "fp8", False),
    ("W8A8", "auto", True),
    ("W8A8", "int8", False),
    ("GGUF_Q4_1", "auto", False),
]


@pytest.mark.parametrize(
    "scheme, kv, speculating",
    CASES,
    ids=[f"{s}-kv={kv}-{'verification' if v else 'decode'}" for s, kv, v in CASES],
)
def test_fused_quantized_layers_give_the_module_paths_bits(
    base_model, tmp_path, monkeypatch, scheme, kv, speculating
):
    folder = _checkpoint(scheme, base_model, tmp_path)
    speculative = (
        SpeculativeConfig(method="ngram", num_speculative_tokens=3) if speculating else None
    )
    engine = build_engine(
        folder, dtype="bfloat16", kv_cache_dtype=kv, prefix_caching=False, speculative=speculative
    )
    layers = engine.model.decoder_layers()
    assert any(isinstance(m, CpuQuantizedLinear) for m in layers[0].modules())
    assert engine.model.fused_layers is not None
    # Repeats give n-gram proposals; ids within the GGUF's vocabulary, the smaller one.
    prompts = [[t % VOCAB_SIZE for t in p + p] for p in random_prompts(6, seed=4)]
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
    engine.close()


def test_float32_quantized_layers_keep_the_module_path(base_model, tmp_path):
    engine = build_engine(_checkpoint("W8A8", base_model, tmp_path), dtype="float32")
    assert engine.model.fused_layers is None
    assert len(serve(engine, random_prompts(2, seed=5))[0]) == PARAMS.max_tokens
    engine.close()
