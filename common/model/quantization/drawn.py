"""Random weights in a compressed-tensors checkpoint's form, for ``--load-format dummy``.

A real model's shape with random weights is how a GPU's figures are taken with nothing
downloaded (``benchmarks/step/real_shape.py``); for a quantized format the figure is only real if
the layers are quantized as the checkpoint's would be, so that the step reads its codes and
scales and runs its kernels. Each decoder layer's drawn 16-bit linears are rounded here as
``pdserve quantize`` rounds a checkpoint's (``writer.quantized_tensors``), part by part (q, k, v;
gate, up) as a checkpoint stores them, and read back through the config's own
``CompressedTensorsConfig.layer``: the loader installs what a checkpoint of random weights
would have given it. Static input scales, which a checkpoint measures on calibration text, are
set for inputs of the drawn model's spread.
"""

from __future__ import annotations

import torch

from common.model.llama import MLP, LlamaForCausalLM
from common.model.quantization.compressed_tensors import (
    CompressedTensorsConfig,
    QuantizedLinearTensors,
)
from common.model.quantization.writer import quantized_tensors
from kernels.quantized import FP8_E4M3, FP8_E4M3_MAX, INT8_SCALE_RANGE

# The largest input magnitude a static scale is set for: the drawn model's normed inputs are
# of unit spread, so this leaves their tail unclipped.
STATIC_INPUT_AMAX = 8.0


def quantized_drawn_layers(
    model: LlamaForCausalLM, config: CompressedTensorsConfig
) -> dict[str, dict[int, QuantizedLinearTensors]]:
    """The quantized layers ``config`` asks for, made from ``model``'s drawn weights: keyed by
    pdserve's parameter name, then by part (the loader's ``_install_quantized`` takes them).

    A mixture's experts keep their drawn 16-bit weights (their stacks are not rounded here)."""
    layers: dict[str, dict[int, QuantizedLinearTensors]] = {}
    for index, layer in enumerate(model.decoder_layers()):
        attention, mlp = layer.self_attn, layer.mlp
        q, kv = attention.q_size, attention.kv_size
        fused = [
            ("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj"), [q, kv, kv]),
            ("self_attn", "o_proj", ("o_proj",), None),
        ]
        if isinstance(mlp, MLP):
            fused += [
                ("mlp", "gate_up_proj", ("gate_proj", "up_proj"), [mlp.intermediate_size] * 2),
                ("mlp", "down_proj", ("down_proj",), None),
            ]
        for owner, name, parts, rows in fused:
            module = layer.get_submodule(f"{owner}.{name}")
            _add(layers, config, f"model.layers.{index}.{owner}", name, parts, rows, module)
    return layers


def _add(
    layers: dict[str, dict[int, QuantizedLinearTensors]],
    config: CompressedTensorsConfig,
    owner: str,
    fused: str,
    parts: tuple[str, ...],
    rows: list[int] | None,
    module: torch.nn.Module,
) -> None:
    """Round the parts (``rows`` each, in order; None: one part) of ``module``'s drawn weight
    that ``config`` quantizes."""
    names = [f"{owner}.{part}" for part in parts]
    schemes = [config.scheme_for(name) for name in names]
    if all(scheme is None for scheme in schemes):
        return
    if any(scheme is None for scheme in schemes):
        raise ValueError(f"{owner}: the layers fused into {fused} must be quantized alike")
    weight = module.get_parameter("weight").detach()
    rows = rows or [weight.shape[0]]
    target = f"{owner.removeprefix('model.')}.{fused}.weight"
    drawn = zip(names, schemes, weight.split(rows), strict=True)
    for shard, (name, scheme, part) in enumerate(drawn):
        assert scheme is not None
        tensors = quantized_tensors(part, scheme.weights, scheme.format)  # on the device
        if scheme.input_static:
            assert scheme.inputs is not None
            top = FP8_E4M3_MAX if scheme.inputs.kind == FP8_E4M3 else INT8_SCALE_RANGE
            scale = torch.tensor([STATIC_INPUT_AMAX / top], dtype=part.dtype, device=part.device)
            tensors["input_scale"] = scale
        quantized = config.layer(name, tensors)
        layers.setdefault(target, {})[shard] = quantized
