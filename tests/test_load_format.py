"""``--load-format dummy``: a model of a config's shape with random weights, no files read; a
quantized config's layers quantized as its checkpoint's would be."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny_model, tiny_llama_config

from common.config import EngineConfig
from common.engine.args import engine_config_from_args
from common.engine.llm_engine import LLMEngine
from common.model.quantization.writer import SCHEMES, write_compressed_tensors
from common.sampling_params import SamplingParams
from decode_worker.worker import build_parser
from kernels.quantized import FP8_E4M3, INT8, UINT4, QuantizedLinear

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def config_only(tmp_path: Path) -> Path:
    config = tiny_llama_config(
        architectures=["LlamaForCausalLM"],  # what a saved model's config names
        vocab_size=300,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    config.save_pretrained(tmp_path)  # config.json alone
    return tmp_path


def test_a_dummy_model_needs_only_its_config_and_generates(config_only: Path) -> None:
    engine = LLMEngine(
        EngineConfig(
            model=str(config_only),
            dtype="float32",
            device="cpu",
            load_format="dummy",
            enforce_eager=True,  # the plain modules, whose weights the test reads
        )
    )
    model = engine.model
    assert all(torch.equal(p, torch.ones_like(p)) for n, p in model.named_parameters()
               if n.endswith("norm.weight"))  # fmt: skip
    weight = model.layers[0].mlp.down_proj.weight
    assert 0.015 < weight.std().item() < 0.025 and weight.isfinite().all()
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    outputs = engine.generate([[1, 2, 3, 4]], params)
    assert len(outputs[0]) == 5


def test_the_same_folder_without_dummy_says_its_weights_are_missing(config_only: Path) -> None:
    with pytest.raises(ValueError, match="safetensors"):
        LLMEngine(EngineConfig(model=str(config_only), dtype="float32", device="cpu"))


def test_load_format_is_a_worker_flag_and_refuses_unknown_formats() -> None:
    args = build_parser().parse_args(["--router", "tcp://127.0.0.1:1", "--load-format", "dummy"])
    assert engine_config_from_args(args).load_format == "dummy"
    with pytest.raises(ValueError, match="load-format"):
        EngineConfig(load_format="pt").validate()


@pytest.mark.slow
@pytest.mark.parametrize("mode", [[], ["--argmax-on-cpu", "--forward-ms", "0.5"]])
def test_the_host_overhead_benchmark_prints_a_line_per_batch_size(mode: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.step.host_overhead", "loop", "--batch-sizes", "1,3",
         "--steps", "5", "--prompt-len", "40", "--vocab", "500", *mode],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("batch ")]
    assert [line.split(":")[0] for line in lines] == ["batch 1", "batch 3"]
    assert all(float(line.split()[2]) > 0 for line in lines)


@pytest.mark.slow
def test_the_real_shape_benchmark_times_and_profiles_a_config_only_model(config_only: Path) -> None:
    """``benchmarks.step.real_shape``'s plumbing on the CPU: a decode step beside its floors, that
    step and a prefill step profiled (host ops here, kernels on a GPU), and a prefill chunk."""
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.step.real_shape", "--allow-cpu",
         "--model", str(config_only), "--batch-sizes", "2", "--context", "32", "--steps", "3",
         "--prefill-chunks", "16", "--kv-cache-gib", "1", "--profile", "2",
         "--profile-prefill", "24"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert any(line.startswith("decode batch 2: ") for line in lines)
    profile = next(i for i, line in enumerate(lines) if line.startswith("profile batch 2: "))
    assert "ops a step" in lines[profile]
    top = lines[profile + 1 : profile + 4]
    assert len(top) == 3 and all(" us " in line and "aten::" in line for line in top)
    assert any(line.startswith("prefill 16: ") for line in lines)
    profile = next(i for i, line in enumerate(lines) if line.startswith("profile prefill 24: "))
    assert "ops a step" in lines[profile] and "aten::" in lines[profile + 1]


# Loads a dummy model of ``sys.argv[1]``'s config in bf16 and serves a request on it, printing
# its parameters' dtypes and whether torch's compiler stack (torch._dynamo, and sympy under it)
# was imported on the way.
LOAD_AND_SERVE = """
import json, sys
from common.config import CacheConfig, EngineConfig
from common.engine.llm_engine import LLMEngine
from common.model.quantization.writer import SCHEMES, write_compressed_tensors
from common.sampling_params import SamplingParams

engine = LLMEngine(EngineConfig(model=sys.argv[1], dtype="bfloat16", device="cpu",
                                load_format="dummy", cache=CacheConfig(num_pages=64)))
engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
print(json.dumps({"dtypes": sorted({str(p.dtype) for p in engine.model.parameters()}),
                  "inv_freq": str(engine.model.rotary.inv_freq.dtype),
                  "compiler": sorted({"torch._dynamo", "sympy"} & set(sys.modules))}))
"""


def test_neither_loading_a_model_nor_serving_it_imports_torchs_compiler(config_only: Path) -> None:
    """torch._dynamo and sympy, which torch's Python reference ops import on their first call
    (arithmetic on the meta device the model is built on, Module.to_empty), take seconds of
    every worker's start-up; pdserve never needs them. The weights come out in the model's
    dtype, the RoPE frequencies in float32."""
    result = subprocess.run(
        [sys.executable, "-c", LOAD_AND_SERVE, str(config_only)],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    loaded = json.loads(result.stdout.splitlines()[-1])
    assert loaded == {"dtypes": ["torch.bfloat16"], "inv_freq": "torch.float32", "compiler": []}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("base") / "tiny"
    return save_tiny_model(tiny_llama_config(tie_word_embeddings=False), folder)


def _quantized_config_only(base: Path, target: Path, scheme: str) -> Path:
    """A compressed-tensors folder of ``scheme`` written from ``base`` with its weights then
    deleted: a config that asks for quantized layers, and nothing to read them from."""
    amax = {f"model.layers.{i}.{part}": 4.0 for i in range(64) for part in _LINEARS}
    write_compressed_tensors(base, target, scheme, group_size=16, calibration=lambda: amax)
    (target / "model.safetensors").unlink()
    return target


_LINEARS = [f"self_attn.{p}_proj" for p in ("q", "k", "v", "o")] + [
    f"mlp.{p}_proj" for p in ("gate", "up", "down")
]
_KINDS = {"FP8": FP8_E4M3, "W8A8": INT8, "W8A16": INT8, "W4A16": UINT4, "W4A16_ASYM": UINT4}


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_a_dummy_model_of_a_quantized_config_is_quantized_as_it_says(base, tmp_path, scheme):
    """Every decoder linear is drawn, then quantized as the scheme's checkpoint would be (the
    format's codes and scales, its input rounding), so a dummy step runs the format's kernels:
    the codes stand for weights of the drawn spread, and the model generates."""
    folder = _quantized_config_only(base, tmp_path / "quantized", scheme)
    engine = LLMEngine(
        EngineConfig(
            model=str(folder), dtype="float32", device="cpu", load_format="dummy",
            enforce_eager=True,
        )
    )  # fmt: skip
    expected = SCHEMES[scheme]
    linears = [
        module
        for layer in engine.model.decoder_layers()
        for module in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
    ]
    for module in linears:
        assert isinstance(module, QuantizedLinear), type(module)
        assert module.qweight.kind == _KINDS.get(scheme.split("_")[0], FP8_E4M3)
        assert (module.activations is None) == (expected.inputs is None)
        weight = module.qweight.dequantize()
        assert weight.isfinite().all() and 0.012 < weight.std().item() < 0.03
    assert not isinstance(engine.model.head, QuantizedLinear)  # the head stays 16-bit
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    assert len(engine.generate([[1, 2, 3, 4]], params)[0]) == 5


def test_the_real_shape_benchmark_counts_a_quantized_shapes_own_bytes(config_only, tmp_path):
    """``--quantization-scheme``: the shape's config given a preset's quantization_config, whose
    dummy model holds FP8 codes (a byte a weight) and a float32 scale per output row for each
    decoder linear, and the floor is taken over those bytes."""
    from benchmarks.step.real_shape import held_weight_bytes, quantized_shape

    def engine(folder: Path) -> LLMEngine:
        config = EngineConfig(model=str(folder), dtype="bfloat16", device="cpu",
                              load_format="dummy", enforce_eager=True)  # fmt: skip
        return LLMEngine(config)

    dense = engine(config_only)
    folder = quantized_shape(config_only, "FP8_DYNAMIC", tmp_path)
    assert json.loads((folder / "config.json").read_text())["quantization_config"]
    quantized = engine(folder)
    saved = 0
    for layer in dense.model.decoder_layers():
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                       layer.mlp.gate_up_proj, layer.mlp.down_proj):  # fmt: skip
            rows, columns = linear.weight.shape
            saved += rows * columns * 2 - (rows * columns + rows * 4)
    assert held_weight_bytes(quantized.model) == held_weight_bytes(dense.model) - saved
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.step.real_shape", "--allow-cpu",
         "--model", str(config_only), "--quantization-scheme", "FP8_DYNAMIC",
         "--batch-sizes", "2", "--context", "32", "--steps", "3", "--prefill-chunks", "16",
         "--kv-cache-gib", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert any(line.startswith("decode batch 2: ") for line in result.stdout.splitlines())
    assert f"model: {config_only.name}-FP8_DYNAMIC," in result.stdout
