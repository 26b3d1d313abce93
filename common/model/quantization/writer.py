"""``pdserve quantize``: a 16- or 32-bit model folder written as a compressed-tensors checkpoint.

The schemes are llm-compressor's presets that need no calibration set (round to nearest, the
scales from each weight's own range) and the one that needs a little (``FP8``'s static input
scales, from a forward pass over calibration text), written in compressed-tensors' own layout:
what vLLM, SGLang, ``transformers`` and pdserve load. The output projection stays 16-bit, as
llm-compressor leaves it by default.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from common.config import ModelConfig
from common.model.checkpoint_files import checkpoint_tensors
from common.model.quantization.compressed_tensors import WeightScheme
from kernels.quantized import FP8_E4M3_MAX
from kernels.sizes import ceil_div

# The layers a scheme quantizes: every decoder layer's linears, a mixture's experts (Mixtral's
# w1/w3/w2 among them) and shared expert included, by their last name.
_QUANTIZED_LAYERS = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3",
)  # fmt: skip
# What stays 16-bit, as llm-compressor leaves it: the head, and a mixture's routers and shared
# expert gate (a few columns each, whose rounding would move every token's choice of experts).
_IGNORED = ["lm_head", r"re:.*\.gate$", r"re:.*\.shared_expert_gate$"]
FP8_BLOCK = 128


@dataclass(frozen=True, slots=True)
class Scheme:
    """One preset: the config group it writes and how it rounds a weight."""

    weights: dict[str, Any]
    inputs: dict[str, Any] | None
    storage: str


def _int_weights(bits: int, strategy: str, group_size: int | None, symmetric: bool) -> dict:
    return {
        "num_bits": bits,
        "type": "int",
        "symmetric": symmetric,
        "strategy": strategy,
        "group_size": group_size,
        "dynamic": False,
    }


_FP8_CHANNEL = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
_FP8_TOKENS = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}

SCHEMES = {
    "FP8_DYNAMIC": Scheme(_FP8_CHANNEL, _FP8_TOKENS, "float-quantized"),
    "FP8": Scheme(
        {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"},
        {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
        "float-quantized",
    ),
    "FP8_BLOCK": Scheme(
        {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "strategy": "block",
            "block_structure": [FP8_BLOCK, FP8_BLOCK],
        },
        {
            "num_bits": 8,
            "type": "float",
            "strategy": "group",
            "group_size": FP8_BLOCK,
            "dynamic": True,
        },
        "float-quantized",
    ),
    "W8A8": Scheme(
        _int_weights(8, "channel", None, True),
        {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True},
        "int-quantized",
    ),
    "W8A16": Scheme(_int_weights(8, "channel", None, True), None, "pack-quantized"),
    "W4A16": Scheme(_int_weights(4, "group", 128, True), None, "pack-quantized"),
    "W4A16_ASYM": Scheme(_int_weights(4, "group", 128, False), None, "pack-quantized"),
}


def write_compressed_tensors(
    source: Path,
    target: Path,
    scheme_name: str,
    group_size: int | None = None,
    calibration: Callable[[], dict[str, float]] | None = None,
) -> Path:
    """``source``'s model quantized by preset ``scheme_name`` into folder ``target`` (its
    config with a ``quantization_config``, one safetensors file, the tokenizer files).

    ``group_size``: the groups of a grouped scheme (default the preset's 128; it must divide
    the input widths, e.g. 64 for SmolLM2's 576). ``calibration``: for ``FP8``'s static input
    scales, a call that returns each quantized layer's largest input magnitude."""
    written = quantization_config(scheme_name, group_size)
    scheme = SCHEMES[scheme_name]
    weights = written["config_groups"]["group_0"]["weights"]
    static_inputs = scheme.inputs is not None and not scheme.inputs.get("dynamic")
    if static_inputs and calibration is None:
        raise ValueError(f"{scheme_name} has static input scales: it needs calibration")
    input_amax = calibration() if calibration is not None and static_inputs else {}
    config = ModelConfig.from_pretrained(source)
    tensors: dict[str, torch.Tensor] = {}
    for name, value in checkpoint_tensors(config, None, lambda _: None):
        assert isinstance(value, torch.Tensor)
        layer = name.removesuffix(".weight")
        quantized = (
            layer.startswith("model.layers.") and layer.rpartition(".")[2] in _QUANTIZED_LAYERS
        )
        if not (name.endswith(".weight") and quantized):
            tensors[name] = value.contiguous()
            continue
        for suffix, tensor in _quantized(value, weights, scheme.storage).items():
            tensors[f"{layer}.{suffix}"] = tensor.contiguous()
        if static_inputs:
            amax = input_amax[layer]
            scale = torch.tensor([max(amax, 1e-12) / FP8_E4M3_MAX], dtype=torch.float32)
            tensors[f"{layer}.input_scale"] = scale.to(value.dtype)
    target.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((source / "config.json").read_text())
    raw["quantization_config"] = written
    (target / "config.json").write_text(json.dumps(raw, indent=2))
    for extra in source.iterdir():
        if extra.is_file() and (extra.name.startswith("tokenizer") or extra.suffix == ".jinja"):
            shutil.copy(extra, target / extra.name)
        if extra.name in ("generation_config.json", "special_tokens_map.json"):
            shutil.copy(extra, target / extra.name)
    return target


def quantization_config(scheme_name: str, group_size: int | None = None) -> dict[str, Any]:
    """The ``quantization_config`` a checkpoint of preset ``scheme_name`` carries."""
    if scheme_name not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme_name!r}; one of {', '.join(SCHEMES)}")
    scheme = SCHEMES[scheme_name]
    weights = dict(scheme.weights)
    if group_size is not None and weights.get("strategy") == "group":
        weights["group_size"] = group_size
    return {
        "quant_method": "compressed-tensors",
        "format": scheme.storage,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": scheme.inputs,
                "output_activations": None,
                "format": scheme.storage,
            }
        },
        "ignore": _IGNORED,
        "kv_cache_scheme": None,
    }


def quantized_tensors(
    weight: torch.Tensor, scheme: WeightScheme, storage: str
) -> dict[str, torch.Tensor]:
    """``weight``'s checkpoint tensors under a parsed config group's weight ``scheme``, as
    ``_quantized`` writes them (for random weights in a checkpoint's form: ``drawn.py``)."""
    if scheme.block is not None and scheme.block != (FP8_BLOCK, FP8_BLOCK):
        raise ValueError(f"blocks of {list(scheme.block)} are not written here, only 128x128")
    args = {
        "num_bits": scheme.num_bits,
        "type": "float" if scheme.is_float else "int",
        "symmetric": scheme.symmetric,
        "strategy": scheme.strategy,
        "group_size": scheme.group_size,
    }
    return _quantized(weight, args, storage)


def _quantized(weight: torch.Tensor, args: dict, storage: str) -> dict[str, torch.Tensor]:
    """``weight``'s tensors in ``storage``, rounded to nearest with scales from its range."""
    dtype = weight.dtype
    w = weight.float()
    rows, columns = w.shape
    if args["type"] == "float":
        if args["strategy"] == "block":
            block = FP8_BLOCK
            pad_columns = ceil_div(columns, block) * block - columns
            pad_rows = ceil_div(rows, block) * block - rows
            padded = torch.nn.functional.pad(w, (0, pad_columns, 0, pad_rows))
            blocks = padded.unflatten(0, (-1, block)).unflatten(2, (-1, block))
            scale = blocks.abs().amax(dim=(1, 3)) / FP8_E4M3_MAX
            spread = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
            spread = spread[:rows, :columns]
        elif args["strategy"] == "tensor":
            scale = (w.abs().amax() / FP8_E4M3_MAX).reshape(1)
            spread = scale
        else:
            scale = w.abs().amax(dim=1, keepdim=True) / FP8_E4M3_MAX
            spread = scale
        scale = scale.to(dtype)
        spread = torch.as_tensor(spread).to(dtype).float().clamp(min=1e-12)
        codes = (w / spread).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        return {"weight": codes, "weight_scale": scale}
    bits, symmetric = args["num_bits"], args["symmetric"]
    group = args["group_size"] if args["strategy"] == "group" else columns
    if columns % group:
        raise ValueError(f"groups of {group} do not divide {columns} columns")
    grouped = w.unflatten(1, (-1, group))
    q_min, q_max = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if symmetric:
        scale = grouped.abs().amax(dim=-1) / ((q_max - q_min) / 2)
        zero = torch.zeros_like(scale)
    else:
        low = grouped.amin(dim=-1).clamp(max=0)
        high = grouped.amax(dim=-1).clamp(min=0)
        scale = (high - low) / (q_max - q_min)
        zero = (q_min - torch.round(low / scale.clamp(min=1e-12))).clamp(q_min, q_max)
    scale = scale.to(dtype).float().clamp(min=1e-12)
    codes = torch.round(grouped / scale[..., None] + zero[..., None]).clamp(q_min, q_max)
    codes = codes.flatten(1).to(torch.int8)
    out: dict[str, torch.Tensor] = {"weight_scale": scale.to(dtype)}
    if not symmetric:
        out["weight_zero_point"] = zero.to(torch.int8)
    if storage != "pack-quantized":
        out["weight"] = codes
        return out
    out["weight_packed"] = _packed_int32(codes, bits)
    out["weight_shape"] = torch.tensor([rows, columns], dtype=torch.int64)
    if not symmetric:
        out["weight_zero_point"] = _packed_int32(zero.to(torch.int8).t(), bits).t()
    return out


def _packed_int32(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed ``bits``-bit ``codes`` [rows, columns] packed along each row into int32 words as
    compressed-tensors packs them: shifted up by 2^(bits - 1) to unsigned, value i of a row at
    bit ``i * bits``, little-endian; the last word padded with zeros."""
    unsigned = (codes.to(torch.int16) + (1 << (bits - 1))).to(torch.uint8)
    rows, columns = unsigned.shape
    if bits == 4:
        unsigned = torch.nn.functional.pad(unsigned, (0, columns % 2))
        unsigned = unsigned[:, 0::2] | (unsigned[:, 1::2] << 4)
    elif bits != 8:
        raise ValueError(f"{bits}-bit codes are not packed here")
    words = ceil_div(columns * bits, 32)
    as_bytes = torch.nn.functional.pad(unsigned, (0, 4 * words - unsigned.shape[1]))
    return as_bytes.contiguous().view(torch.int32).reshape(rows, words).contiguous()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pdserve quantize",
        description="Write a model folder as a compressed-tensors checkpoint, rounding each "
        "decoder layer's linear weights to nearest (llm-compressor's presets).",
    )
    parser.add_argument("source", help="a Hugging Face model folder (16- or 32-bit)")
    parser.add_argument("target", help="the folder to write")
    parser.add_argument("--scheme", required=True, choices=[s for s in SCHEMES if s != "FP8"])
    parser.add_argument("--group-size", type=int, default=None)
    args = parser.parse_args(argv)
    folder = write_compressed_tensors(
        Path(args.source), Path(args.target), args.scheme, args.group_size
    )
    print(folder)
    return 0
