"""GPTQ and AWQ checkpoints in their own formats: written here from known integer codes, scales
and zero points, packed as AutoGPTQ and AutoAWQ pack them, they read back as exactly
``scale * (code - zero)`` and serve the greedy tokens of that dense model in transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engines import build_engine
from safetensors.torch import load_file, save_file
from tiny_models import (
    assert_greedy_equal_up_to_near_ties,
    hf_greedy,
    random_prompts,
    save_tiny_model,
    tiny_llama_config,
)

from common.config import ModelConfig
from common.model.loader import load_model
from common.sampling_params import SamplingParams
from kernels.quantized import QuantizedLinear

GROUP = 32
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: the column each 4-bit field of a word holds
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def _words(fields: torch.Tensor, bits: int) -> torch.Tensor:
    """``fields [R, C]`` (C a multiple of 32 / bits) packed along each row into int32 words,
    field ``i`` of a word at bit ``i * bits`` (the word's top bit its sign, as stored)."""
    per_word = 32 // bits
    grouped = fields.to(torch.int64).view(fields.shape[0], -1, per_word)
    words = torch.zeros(grouped.shape[:2], dtype=torch.int64)
    for i in range(per_word):
        words |= grouped[..., i] << (bits * i)
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)


def _quantized(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric codes [N, K], zero points [N, G], scales [N, G] of ``weight`` [N, K]."""
    levels = (1 << bits) - 1
    grouped = weight.float().unflatten(1, (-1, GROUP))
    low, high = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
    scales = ((high - low) / levels).to(torch.float16).float()
    zeros = torch.round(-low / scales).clamp(0, levels)
    codes = torch.round(grouped / scales[..., None] + zeros[..., None]).clamp(0, levels)
    return codes.flatten(1).to(torch.int64), zeros.to(torch.int64), scales


def _write(base: Path, target: Path, method: str, bits: int) -> Path:
    """``base`` written as a ``method`` checkpoint, and beside it (``target/dense``) the dense
    model those codes stand for."""
    tensors = load_file(str(base / "model.safetensors"))
    packed, dense = {}, {}
    for name, tensor in tensors.items():
        layer = name.removesuffix(".weight")
        if not layer.endswith(LINEARS):
            packed[name] = dense[name] = tensor
            continue
        codes, zeros, scales = _quantized(tensor, bits)
        stored_zeros = zeros - 1 if method == "gptq" else zeros  # original GPTQ keeps z - 1
        spread = zeros.repeat_interleave(GROUP, 1)
        dense[name] = (scales.repeat_interleave(GROUP, 1) * (codes - spread)).float()
        if method == "gptq":
            # Inputs packed down the columns of [K, N]; zero points along the rows of [G, N].
            packed[f"{layer}.qweight"] = _words(codes.contiguous(), bits).t().contiguous()
            packed[f"{layer}.qzeros"] = _words((stored_zeros % (1 << bits)).t().contiguous(), bits)
            packed[f"{layer}.g_idx"] = torch.arange(codes.shape[1], dtype=torch.int32) // GROUP
        else:
            # Field i of a word holds output column AWQ_ORDER[i] of its eight.
            order = torch.arange(codes.shape[0]).view(-1, 8)[:, torch.tensor(AWQ_ORDER)].flatten()
            packed[f"{layer}.qweight"] = _words(codes.t()[:, order].contiguous(), bits)
            packed[f"{layer}.qzeros"] = _words(zeros.t()[:, order].contiguous(), bits)
        packed[f"{layer}.scales"] = scales.t().contiguous().to(torch.float16)
    raw = json.loads((base / "config.json").read_text())
    for folder, weights in ((target, packed), (target / "dense", dense)):
        folder.mkdir(parents=True)
        save_file(
            {k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors")
        )
        config = dict(raw)
        if folder == target:
            config["quantization_config"] = (
                {"quant_method": "gptq", "bits": bits, "group_size": GROUP, "desc_act": False,
                 "sym": False, "checkpoint_format": "gptq"}
                if method == "gptq"
                else {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                      "version": "gemm"}
            )  # fmt: skip
        (folder / "config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("base") / "tiny"
    return save_tiny_model(tiny_llama_config(tie_word_embeddings=False), folder)


CASES = [("gptq", 4), ("gptq", 8), ("awq", 4)]


@pytest.mark.parametrize(("method", "bits"), CASES, ids=[f"{m}-{b}bit" for m, b in CASES])
def test_packed_checkpoint_reads_back_exactly_and_serves(base_model, tmp_path, method, bits):
    folder = _write(base_model, tmp_path / method, method, bits)
    dense = load_file(str(folder / "dense" / "model.safetensors"))
    model = load_model(ModelConfig.from_pretrained(folder), torch.float32, torch.device("cpu"))
    o_proj = model.decoder_layers()[1].self_attn.o_proj
    assert isinstance(o_proj, QuantizedLinear)
    expected = dense["model.layers.1.self_attn.o_proj.weight"]
    assert torch.equal(o_proj.qweight.dequantize(), expected)
    gate_up = model.decoder_layers()[0].mlp.gate_up_proj.qweight.dequantize()
    gate = dense["model.layers.0.mlp.gate_proj.weight"]
    assert torch.equal(gate_up[: gate_up.shape[0] // 2], gate)
    prompts = random_prompts(4, seed=5)
    reference = hf_greedy(folder / "dense", prompts, GREEDY.max_tokens)
    got = build_engine(folder).generate(prompts, GREEDY)
    assert_greedy_equal_up_to_near_ties(folder / "dense", prompts, got, reference, 1e-3)


def test_groups_in_activation_order_are_refused(base_model, tmp_path):
    folder = _write(base_model, tmp_path / "gptq", "gptq", 4)
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.g_idx"
    tensors[name] = torch.flip(tensors[name], (0,)).contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"down_proj: g_idx: groups in activation order"):
        load_model(ModelConfig.from_pretrained(folder), torch.float32, torch.device("cpu"))
