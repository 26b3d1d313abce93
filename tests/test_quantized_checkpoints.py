"""compressed-tensors checkpoints: every scheme loads and gives the greedy tokens of the same
checkpoint in ``transformers`` (float32), which reads them through compressed-tensors itself;
a config pdserve does not compute is refused at load, naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engines import build_engine
from tiny_models import (
    assert_greedy_equal_up_to_near_ties,
    hf_greedy,
    random_prompts,
    save_tiny_model,
    tiny_llama_config,
)

from common.config import EngineConfig, ModelConfig
from common.engine.llm_engine import LLMEngine
from common.model.loader import load_model
from common.model.quantization.writer import SCHEMES, write_compressed_tensors
from common.sampling_params import SamplingParams
from kernels.cpu.quantized_linear import CpuQuantizedLinear
from kernels.quantized import QuantizedLinear

NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
# Widths that FP8's 128-blocks divide (compressed-tensors' own block rounding needs it, so
# transformers can read the checkpoint), as do groups of 64.
SHAPE = {"hidden_size": 256, "intermediate_size": 384, "num_attention_heads": 4}
GROUP_SIZE = 64
# How far apart two tokens' logits (transformers, float32) may be where greedy parts from the
# reference. Weight-only schemes multiply the same weights in another order: only last-bit
# ties part. Schemes that round inputs to 8 bits turn a last-bit difference of the input
# into a whole step of its code now and then, so their near ties are wider (as bf16's are).
WEIGHT_ONLY_TIE = 1e-3
ROUNDED_INPUTS_TIE = 0.15


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("base") / "tiny"
    return save_tiny_model(tiny_llama_config(**SHAPE, tie_word_embeddings=False), folder)


def _input_amax(folder: Path, prompts: list[list[int]]) -> dict[str, float]:
    """Each linear layer's largest input magnitude over ``prompts``: FP8's static scales."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    amax: dict[str, float] = {}

    def hook(name):
        def record(_module, inputs):
            amax[name] = max(amax.get(name, 0.0), float(inputs[0].abs().max()))

        return record

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            module.register_forward_pre_hook(hook(name))
    with torch.inference_mode():
        for prompt in prompts:
            model(torch.tensor([prompt]))
    return amax


def _quantized(base: Path, tmp_path_factory, scheme: str) -> Path:
    folder = tmp_path_factory.mktemp(scheme.lower()) / "model"
    prompts = random_prompts(4, seed=7)
    return write_compressed_tensors(
        base, folder, scheme, GROUP_SIZE, calibration=lambda: _input_amax(base, prompts)
    )


def _dequantized_by_compressed_tensors(folder: Path, target: Path) -> Path:
    """``folder``'s checkpoint with every quantized layer dequantized by compressed-tensors'
    own functions: the reference where ``transformers`` cannot load the checkpoint itself
    (its loader expects asymmetric 4-bit zero points unpacked)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from safetensors.torch import load_file, save_file

    raw = json.loads((folder / "config.json").read_text())
    group = raw.pop("quantization_config")["config_groups"]["group_0"]
    args = QuantizationArgs(**group["weights"])
    tensors = load_file(str(folder / "model.safetensors"))
    dense: dict[str, torch.Tensor] = {}
    for name in list(tensors):
        if not name.endswith(".weight_packed"):
            if not name.endswith((".weight_scale", ".weight_zero_point", ".weight_shape")):
                dense[name] = tensors[name]
            continue
        layer = name.removesuffix(".weight_packed")
        shape = torch.Size(tensors[f"{layer}.weight_shape"].tolist())
        scale = tensors[f"{layer}.weight_scale"]
        codes = unpack_from_int32(tensors[name], args.num_bits, shape)
        zero = tensors.get(f"{layer}.weight_zero_point")
        if zero is not None:
            zero = unpack_from_int32(zero, args.num_bits, scale.shape, packed_dim=0)
        dense[f"{layer}.weight"] = dequantize(codes, scale, zero, args).contiguous()
    target.mkdir(parents=True)
    save_file(dense, str(target / "model.safetensors"), metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps(raw))
    return target


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_scheme_gives_the_greedy_tokens_of_transformers(base_model, tmp_path_factory, scheme):
    folder = _quantized(base_model, tmp_path_factory, scheme)
    prompts = random_prompts(6, seed=3)
    reference_folder = folder
    if scheme == "W4A16_ASYM":
        reference_folder = _dequantized_by_compressed_tensors(
            folder, tmp_path_factory.mktemp("dense") / "model"
        )
    expected = hf_greedy(reference_folder, prompts, NEW_TOKENS)
    engine = build_engine(folder, max_num_batched_tokens=2048)
    # Every decoder layer's linears run the C kernels over the codes.
    kernels = [m for m in engine.model.modules() if isinstance(m, CpuQuantizedLinear)]
    assert len(kernels) == 4 * len(engine.model.decoder_layers())
    got = engine.generate(prompts, GREEDY)
    tie = WEIGHT_ONLY_TIE if SCHEMES[scheme].inputs is None else ROUNDED_INPUTS_TIE
    assert_greedy_equal_up_to_near_ties(reference_folder, prompts, got, expected, tie)
    engine.close()


@pytest.mark.parametrize("scheme", ["W8A16", "W4A16"])
def test_a_quantized_tied_head_gives_the_greedy_tokens_of_transformers(tmp_path_factory, scheme):
    """``--quantize-head`` on a model whose head is its embedding: the checkpoint holds a
    quantized ``lm_head`` and the 16-bit embedding, untied; pdserve multiplies the head's codes
    and gives the greedy tokens of ``transformers`` over the checkpoint dequantized by
    compressed-tensors."""
    base = tmp_path_factory.mktemp("tied") / "tiny"
    save_tiny_model(tiny_llama_config(**SHAPE, tie_word_embeddings=True), base)
    folder = write_compressed_tensors(
        base, tmp_path_factory.mktemp("head") / "model", scheme, GROUP_SIZE, quantize_head=True
    )
    raw = json.loads((folder / "config.json").read_text())
    assert raw["tie_word_embeddings"] is False
    assert "lm_head" not in raw["quantization_config"]["ignore"]
    reference_folder = _dequantized_by_compressed_tensors(
        folder, tmp_path_factory.mktemp("dense") / "model"
    )
    prompts = random_prompts(6, seed=5)
    expected = hf_greedy(reference_folder, prompts, NEW_TOKENS)
    engine = build_engine(folder, max_num_batched_tokens=2048)
    assert isinstance(engine.model.head, CpuQuantizedLinear)
    assert isinstance(engine.model.embed_tokens, torch.nn.Embedding)
    got = engine.generate(prompts, GREEDY)
    assert_greedy_equal_up_to_near_ties(reference_folder, prompts, got, expected, WEIGHT_ONLY_TIE)
    engine.close()
    with pytest.raises(ValueError, match="static input scales"):
        write_compressed_tensors(base, folder.parent / "fp8", "FP8", quantize_head=True)


def test_quantized_layers_keep_codes_not_16_bit_weights(base_model, tmp_path_factory):
    folder = _quantized(base_model, tmp_path_factory, "W4A16")
    model = load_model(ModelConfig.from_pretrained(folder), torch.float32, torch.device("cpu"))
    layer = model.decoder_layers()[0]
    qkv = layer.self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear)
    assert qkv.qweight.kind == "uint4" and qkv.qweight.group_size == GROUP_SIZE
    hidden, head_dim = SHAPE["hidden_size"], SHAPE["hidden_size"] // 4
    assert qkv.qweight.shape == (hidden + 2 * 2 * head_dim, hidden)
    assert qkv.qweight.codes.shape == (hidden + 2 * 2 * head_dim, hidden // 2)
    assert isinstance(layer.mlp.gate_up_proj, QuantizedLinear)
    assert model.lm_head is not None  # "ignore": ["lm_head"] keeps it 16-bit


def _edited(folder: Path, tmp_path: Path, edit) -> Path:
    """A copy of ``folder`` (linked weights) whose quantization_config ``edit`` changed."""
    target = tmp_path / "edited"
    target.mkdir()
    for item in folder.iterdir():
        (target / item.name).symlink_to(item)
    (target / "config.json").unlink()
    raw = json.loads((folder / "config.json").read_text())
    edit(raw["quantization_config"])
    (target / "config.json").write_text(json.dumps(raw))
    return target


def _group(config: dict) -> dict:
    return config["config_groups"]["group_0"]


REFUSED = {
    "format": (lambda c: _group(c).update(format="marlin-24"), "format is 'marlin-24'"),
    "method": (lambda c: c.update(quant_method="bitsandbytes"), "quant_method 'bitsandbytes'"),
    "strategy": (
        lambda c: _group(c)["weights"].update(strategy="tensor_group"),
        "weights.strategy is 'tensor_group'",
    ),
    "fp4": (
        lambda c: _group(c)["weights"].update(num_bits=4, type="float"),
        "4-bit float weights",
    ),
    "actorder": (lambda c: _group(c)["weights"].update(actorder="group"), "actorder 'group'"),
    "group size": (lambda c: _group(c)["weights"].update(group_size=0), "group_size"),
    "sparsity": (lambda c: c.update(sparsity_config={"format": "sparse-24"}), "sparsity_config"),
    "asymmetric inputs": (
        lambda c: _group(c).update(
            input_activations={"num_bits": 8, "type": "int", "symmetric": False, "dynamic": True}
        ),
        "input_activations.symmetric",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_config_pdserve_does_not_compute_is_refused_naming_it(
    base_model, tmp_path_factory, tmp_path, case
):
    edit, named = REFUSED[case]
    folder = _edited(_quantized(base_model, tmp_path_factory, "W4A16"), tmp_path, edit)
    with pytest.raises(ValueError, match="quant") as error:
        load_model(ModelConfig.from_pretrained(folder), torch.float32, torch.device("cpu"))
    assert named in str(error.value)


def test_a_missing_scale_is_refused_naming_the_layer(base_model, tmp_path_factory, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _quantized(base_model, tmp_path_factory, "FP8_DYNAMIC")
    target = tmp_path / "broken"
    target.mkdir()
    for item in folder.iterdir():
        if item.name != "model.safetensors":
            (target / item.name).symlink_to(item)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight_scale"]
    save_file(tensors, str(target / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj.*weight_scale"):
        load_model(ModelConfig.from_pretrained(target), torch.float32, torch.device("cpu"))


def test_quantization_flag_must_match_the_checkpoint(base_model, tmp_path_factory):
    folder = _quantized(base_model, tmp_path_factory, "W8A16")
    with pytest.raises(ValueError, match=r"--quantization compressed-tensors: .* not quantized"):
        LLMEngine(EngineConfig(model=str(base_model), quantization="compressed-tensors"))
    engine = LLMEngine(
        EngineConfig(model=str(folder), dtype="float32", quantization="compressed-tensors")
    )
    assert engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0))
    engine.close()


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["W4A16", "FP8_DYNAMIC", "W8A8"])
def test_cuda_engine_gives_the_greedy_tokens_of_transformers(base_model, tmp_path_factory, scheme):
    """On CUDA the quantized layers take the Triton GEMM over their codes."""
    from kernels.triton.quantized_gemm import TritonQuantizedLinear

    folder = _quantized(base_model, tmp_path_factory, scheme)
    prompts = random_prompts(6, seed=3)
    expected = hf_greedy(folder, prompts, NEW_TOKENS)
    engine = build_engine(folder, device="cuda", max_num_batched_tokens=2048)
    assert any(isinstance(m, TritonQuantizedLinear) for m in engine.model.modules())
    got = engine.generate(prompts, GREEDY)
    tie = WEIGHT_ONLY_TIE if SCHEMES[scheme].inputs is None else ROUNDED_INPUTS_TIE
    assert_greedy_equal_up_to_near_ties(folder, prompts, got, expected, max(tie, 1e-2))
    engine.close()


@pytest.mark.parametrize("scheme", ["W4A16", "FP8_DYNAMIC"])
def test_deterministic_answers_of_a_quantized_model_do_not_depend_on_the_batch(
    base_model, tmp_path_factory, scheme
):
    """--enable-deterministic-inference: the quantized layers take the tile kernel at every row
    count, whose sums do not depend on the batch (W8A8 rounding is per token)."""
    from determinism import assert_answers_are_invariant

    folder = _quantized(base_model, tmp_path_factory, scheme)
    assert_answers_are_invariant(folder, dtype="bfloat16", kv_cache_dtype="auto")


def test_deterministic_mode_refuses_inputs_scaled_per_tensor_at_run_time(
    base_model, tmp_path_factory, tmp_path
):
    folder = _edited(
        _quantized(base_model, tmp_path_factory, "W8A8"),
        tmp_path,
        lambda c: _group(c)["input_activations"].update(strategy="tensor"),
    )
    with pytest.raises(ValueError, match="scales its inputs per tensor at run time"):
        build_engine(folder, deterministic=True)
    build_engine(folder).close()  # served where answers may depend on the batch


def test_pdserve_quantize_writes_a_checkpoint_pdserve_serves(base_model, tmp_path, capsys):
    from pdserve.cli import main as pdserve

    target = tmp_path / "w8a16"
    assert pdserve(["quantize", str(base_model), str(target), "--scheme", "W8A16"]) == 0
    assert capsys.readouterr().out.strip() == str(target)
    config = ModelConfig.from_pretrained(target)
    assert config.quantization_config["format"] == "pack-quantized"
    engine = build_engine(target)
    assert engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0))
    engine.close()
    with_head = tmp_path / "w8a16-head"
    argv = ["quantize", str(base_model), str(with_head), "--scheme", "W8A16", "--quantize-head"]
    assert pdserve(argv) == 0
    engine = build_engine(with_head)
    assert isinstance(engine.model.head, CpuQuantizedLinear)
    engine.close()
    with pytest.raises(ValueError, match="do not divide"):
        write_compressed_tensors(base_model, tmp_path / "bad", "W4A16", group_size=48)
