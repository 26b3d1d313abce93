"""compressed-tensors checkpoints: what llm-compressor writes, and what vLLM and SGLang read.

A checkpoint's ``quantization_config`` names a storage ``format`` and groups of schemes, each
for the linear layers its ``targets`` match (less the ``ignore`` list): how the weights are
quantized (bits, int or float, symmetric, and over what the scales run: the tensor, each output
channel, groups of inputs, or 2-D blocks) and how the inputs are (W8A8: per token or per tensor,
at run time or with a scale calibrated once). Each layer's tensors (``weight``,
``weight_scale``, ``weight_zero_point``, ``weight_packed``, ``weight_shape``, ``input_scale``)
become one ``QuantizedWeight`` and, for W8A8, one ``ActivationQuantization``, with no loss.

Read here: ``float-quantized`` FP8 e4m3 (tensor, channel, group or block scales; static or
dynamic inputs), ``int-quantized`` / ``naive-quantized`` int8 (symmetric or with zero points;
W8A8 int8 inputs), ``pack-quantized`` 4- and 8-bit integers with groups (symmetric or with zero
points). Anything else a config asks for is refused at load, naming the field: a model served
with arithmetic it did not ask for answers wrongly and silently.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import torch

from kernels.quantized import (
    DYNAMIC_PER_TENSOR,
    DYNAMIC_PER_TOKEN,
    DYNAMIC_PER_TOKEN_GROUP,
    FP8_E4M3,
    INT8,
    STATIC,
    UINT4,
    ActivationQuantization,
    QuantizedWeight,
)
from kernels.sizes import ceil_div

logger = logging.getLogger(__name__)

METHOD = "compressed-tensors"
FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized")
WEIGHT_STRATEGIES = ("tensor", "channel", "group", "block")
# The suffixes of a quantized layer's tensors in the checkpoint (beside its bias).
TENSOR_SUFFIXES = (
    "weight",
    "weight_scale",
    "weight_zero_point",
    "weight_packed",
    "weight_shape",
    "weight_g_idx",
    "input_scale",
    "input_zero_point",
)
# The class name compressed-tensors targets every linear layer by, and the names of the
# linear layers of the models pdserve serves.
LINEAR_TARGET = "Linear"
# Every linear layer of the supported families, by its last name: the "Linear" target.
LINEAR_LAYERS = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "w1", "w2", "w3",  # Mixtral's experts
    "gate", "shared_expert_gate",  # a mixture's routers (most checkpoints ignore them)
)  # fmt: skip
HEAD = "lm_head"


@dataclass(frozen=True, slots=True)
class WeightScheme:
    num_bits: int
    is_float: bool
    symmetric: bool
    strategy: str
    group_size: int | None
    block: tuple[int, int] | None


@dataclass(frozen=True, slots=True)
class LayerScheme:
    """One config group: the weights' scheme, the inputs' (None: weight-only), and the
    storage format of its layers."""

    targets: tuple[str, ...]
    weights: WeightScheme
    inputs: ActivationQuantization | None  # static ones without their scale (per layer)
    input_static: bool
    format: str


@dataclass(frozen=True, slots=True)
class QuantizedLinearTensors:
    """A quantized linear layer as the loader receives it: its weight, and how its inputs are
    rounded (None for weight-only formats)."""

    weight: QuantizedWeight
    activations: ActivationQuantization | None


class CompressedTensorsConfig:
    """A checkpoint's ``quantization_config``, checked field by field at load."""

    def __init__(self, schemes: list[LayerScheme], ignore: list[str]) -> None:
        self.schemes = schemes
        self.ignore = ignore

    @classmethod
    def from_dict(cls, raw: Any) -> CompressedTensorsConfig:
        """Raises ``ValueError`` naming the field at fault where the config asks for anything
        pdserve does not compute."""
        where = "quantization_config"
        if not isinstance(raw, dict):
            raise ValueError(f"{where} must be an object")
        if raw.get("quant_method") != METHOD:
            raise ValueError(f"{where}.quant_method is {raw.get('quant_method')!r}, not {METHOD}")
        for unsupported in ("sparsity_config", "transform_config"):
            if raw.get(unsupported):
                raise ValueError(
                    f"{where}.{unsupported}: pdserve does not serve sparse or transformed "
                    "compressed-tensors checkpoints"
                )
        if raw.get("kv_cache_scheme"):
            logger.warning(
                "%s.kv_cache_scheme: the checkpoint's KV scales are not used; "
                "--kv-cache-dtype chooses the KV format and its scales are computed per token",
                where,
            )
        status = raw.get("quantization_status", "compressed")
        if status != "compressed":
            raise ValueError(
                f"{where}.quantization_status is {status!r}: pdserve reads compressed "
                "checkpoints (a 'frozen' one holds its weights unquantized and unrounded)"
            )
        default_format = raw.get("format")
        groups = raw.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise ValueError(f"{where}.config_groups must name at least one group")
        schemes = [
            _layer_scheme(group, f"{where}.config_groups.{name}", default_format)
            for name, group in groups.items()
        ]
        ignore = raw.get("ignore") or []
        if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
            raise ValueError(f"{where}.ignore must be a list of layer names or patterns")
        return cls(schemes, ignore)

    def scheme_for(self, layer: str) -> LayerScheme | None:
        """The scheme of linear layer ``layer`` (its checkpoint name, e.g.
        ``model.layers.0.self_attn.q_proj``), None where it is left in 16 bits."""
        if any(_matches(pattern, layer) for pattern in self.ignore):
            return None
        for scheme in self.schemes:
            if any(_matches(target, layer) for target in scheme.targets):
                return scheme
        return None

    def layer(self, layer: str, tensors: dict[str, torch.Tensor]) -> QuantizedLinearTensors:
        """Linear layer ``layer`` from its checkpoint tensors (keyed by ``TENSOR_SUFFIXES``)."""
        scheme = self.scheme_for(layer)
        assert scheme is not None, f"{layer} is not quantized"
        try:
            weight = _weight(scheme, tensors)
            activations = _activations(scheme, tensors)
        except (KeyError, RuntimeError) as exc:
            raise ValueError(f"quantized layer {layer}: missing or malformed {exc}") from exc
        except ValueError as exc:
            raise ValueError(f"quantized layer {layer}: {exc}") from exc
        return QuantizedLinearTensors(weight, activations)


def _matches(pattern: str, layer: str) -> bool:
    if pattern == LINEAR_TARGET:
        return layer == HEAD or layer.rpartition(".")[2] in LINEAR_LAYERS
    if pattern.startswith("re:"):
        return re.match(pattern[3:], layer) is not None
    return pattern == layer


def _layer_scheme(group: Any, where: str, default_format: str | None) -> LayerScheme:
    if not isinstance(group, dict):
        raise ValueError(f"{where} must be an object")
    storage = group.get("format") or default_format
    if storage not in FORMATS:
        raise ValueError(
            f"{where}.format is {storage!r}; pdserve reads compressed-tensors formats "
            f"{', '.join(FORMATS)}"
        )
    targets = group.get("targets")
    if not isinstance(targets, list) or not targets:
        raise ValueError(f"{where}.targets must list the layers it quantizes")
    weights = _weight_scheme(group.get("weights"), f"{where}.weights", storage)
    inputs, static = _input_scheme(group.get("input_activations"), f"{where}.input_activations")
    if group.get("output_activations"):
        raise ValueError(f"{where}.output_activations: pdserve does not quantize outputs")
    return LayerScheme(tuple(targets), weights, inputs, static, storage)


def _weight_scheme(raw: Any, where: str, storage: str) -> WeightScheme:
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be an object")
    bits, kind = raw.get("num_bits", 8), raw.get("type", "int")
    strategy = raw.get("strategy") or "tensor"
    if strategy not in WEIGHT_STRATEGIES:
        raise ValueError(
            f"{where}.strategy is {strategy!r}; pdserve reads {', '.join(WEIGHT_STRATEGIES)}"
        )
    if raw.get("dynamic"):
        raise ValueError(f"{where}.dynamic: weights are quantized once, not at run time")
    if raw.get("actorder") == "group":
        raise ValueError(f"{where}.actorder 'group': groups in activation order are not read")
    wanted = {
        "float-quantized": {(8, "float")},
        "int-quantized": {(8, "int")},
        "naive-quantized": {(8, "int")},
        "pack-quantized": {(4, "int"), (8, "int")},
    }[storage]
    if (bits, kind) not in wanted:
        raise ValueError(
            f"{where}: {bits}-bit {kind} weights in {storage!r} storage are not read by pdserve"
        )
    symmetric = bool(raw.get("symmetric", True))
    if kind == "float" and not symmetric:
        raise ValueError(f"{where}.symmetric: FP8 weights have no zero point")
    group_size = raw.get("group_size")
    if strategy == "group" and not (isinstance(group_size, int) and group_size > 0):
        raise ValueError(f"{where}.group_size must be a positive integer for strategy 'group'")
    block = raw.get("block_structure")
    if strategy == "block":
        if not (
            isinstance(block, list)
            and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)
        ):
            raise ValueError(f"{where}.block_structure must be [rows, columns] for 'block'")
        block = (block[0], block[1])
    else:
        block = None
    return WeightScheme(bits, kind == "float", symmetric, strategy, group_size, block)


def _input_scheme(raw: Any, where: str) -> tuple[ActivationQuantization | None, bool]:
    if raw is None:
        return None, False
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be an object or null")
    bits, kind = raw.get("num_bits", 8), raw.get("type", "int")
    if (bits, kind) not in ((8, "float"), (8, "int")):
        raise ValueError(f"{where}: {bits}-bit {kind} inputs are not computed by pdserve")
    if not raw.get("symmetric", True):
        raise ValueError(f"{where}.symmetric: inputs with a zero point are not computed")
    strategy = raw.get("strategy") or "tensor"
    dynamic = raw.get("dynamic", False)
    code = FP8_E4M3 if kind == "float" else INT8
    if dynamic is True:
        if strategy == "group":
            group_size = raw.get("group_size")
            if not (isinstance(group_size, int) and group_size > 0):
                raise ValueError(f"{where}.group_size must be a positive integer for 'group'")
            return ActivationQuantization(code, DYNAMIC_PER_TOKEN_GROUP, None, group_size), False
        if strategy not in ("token", "tensor"):
            raise ValueError(
                f"{where}.strategy {strategy!r}: inputs are scaled per token, group or tensor"
            )
        per = DYNAMIC_PER_TOKEN if strategy == "token" else DYNAMIC_PER_TENSOR
        return ActivationQuantization(code, per), False
    if dynamic is not False:
        raise ValueError(f"{where}.dynamic {dynamic!r} is not computed by pdserve")
    if strategy != "tensor":
        raise ValueError(f"{where}.strategy {strategy!r}: a static input scale is per tensor")
    # The scale is each layer's own: filled in by _activations.
    return ActivationQuantization(code, STATIC, 1.0), True


def _activations(
    scheme: LayerScheme, tensors: dict[str, torch.Tensor]
) -> ActivationQuantization | None:
    if scheme.inputs is None or not scheme.input_static:
        return scheme.inputs
    scale = tensors["input_scale"].float()
    if scale.numel() != 1 or not torch.isfinite(scale).all() or scale.item() <= 0:
        raise ValueError("input_scale must be one positive number")
    return ActivationQuantization(scheme.inputs.kind, STATIC, scale.item())


def _weight(scheme: LayerScheme, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
    """The layer's QuantizedWeight: codes as stored, scales spread to [rows, groups]."""
    if "weight_g_idx" in tensors:
        g_idx = tensors["weight_g_idx"]
        if not torch.equal(g_idx, torch.sort(g_idx).values):
            raise ValueError("weight_g_idx: groups in activation order are not read")
    ws = scheme.weights
    if scheme.format == "pack-quantized":
        shape = [int(v) for v in tensors["weight_shape"].tolist()]
        if len(shape) != 2:
            raise ValueError(f"weight_shape {shape} is not [rows, columns]")
        rows, columns = shape
        stored = _unpacked_bytes(tensors["weight_packed"], rows, columns, ws.num_bits)
    else:
        stored = tensors["weight"]
        rows, columns = stored.shape
    group = _group_size(ws, columns)
    scales = _scale_grid(tensors["weight_scale"], ws, rows, columns, group)
    zero_points = None
    if not ws.symmetric:
        zero_points = _zero_points(tensors["weight_zero_point"], ws, scheme, rows, columns, group)
    if ws.is_float:
        if stored.dtype != torch.float8_e4m3fn:
            raise ValueError(f"weight is {stored.dtype}, not float8_e4m3fn")
        return QuantizedWeight(FP8_E4M3, stored.view(torch.uint8), scales, None, group, columns)
    if scheme.format == "pack-quantized":
        # Stored unsigned, shifted up by 2^(bits - 1): w = s (u - 2^(bits-1) - z).
        if ws.num_bits == 4:
            shift = float(1 << (ws.num_bits - 1))
            unsigned_offsets = scales * (shift if zero_points is None else zero_points + shift)
            return QuantizedWeight(UINT4, stored, scales, unsigned_offsets, group, columns)
        codes = (stored.to(torch.int16) - 128).to(torch.int8)
        return QuantizedWeight(INT8, codes, scales, _offsets(scales, zero_points), group, columns)
    if stored.dtype != torch.int8:
        raise ValueError(f"weight is {stored.dtype}, not int8")
    return QuantizedWeight(INT8, stored, scales, _offsets(scales, zero_points), group, columns)


def _offsets(scales: torch.Tensor, zero_points: torch.Tensor | None) -> torch.Tensor | None:
    """s (q - z) = s q - s z: the offsets of signed codes with zero points."""
    return None if zero_points is None else scales * zero_points


def _group_size(ws: WeightScheme, columns: int) -> int:
    if ws.strategy == "group":
        assert ws.group_size is not None
        return ws.group_size
    if ws.strategy == "block":
        assert ws.block is not None
        return ws.block[1]
    return columns


def _scale_grid(
    scale: torch.Tensor, ws: WeightScheme, rows: int, columns: int, group: int
) -> torch.Tensor:
    """``scale`` as stored, spread to float32 ``[rows, ceil(columns / group)]``."""
    groups = ceil_div(columns, group)
    scale = scale.float()
    if ws.strategy == "tensor":
        if scale.numel() != 1:
            raise ValueError(f"weight_scale of a tensor strategy has {scale.numel()} values")
        return scale.reshape(1, 1).expand(rows, groups).contiguous()
    if ws.strategy == "block":
        assert ws.block is not None
        block_rows = ws.block[0]
        expected = (ceil_div(rows, block_rows), groups)
        if tuple(scale.shape) != expected:
            raise ValueError(f"weight_scale is {tuple(scale.shape)}, blocks want {expected}")
        return scale.repeat_interleave(block_rows, dim=0)[:rows].contiguous()
    scale = scale.reshape(rows, -1) if scale.numel() == rows * groups else scale
    if tuple(scale.shape) != (rows, groups):
        raise ValueError(f"weight_scale is {tuple(scale.shape)}, expected {(rows, groups)}")
    return scale.contiguous()


def _zero_points(
    raw: torch.Tensor, ws: WeightScheme, scheme: LayerScheme, rows: int, columns: int, group: int
) -> torch.Tensor:
    """float32 ``[rows, groups]`` zero points (signed, as compressed-tensors keeps them)."""
    groups = ceil_div(columns, group)
    if scheme.format == "pack-quantized" and raw.dtype == torch.int32:
        # Packed along the rows: 32 / bits of them to a word, offset to unsigned.
        unpacked = _unpacked_bytes(raw.t().contiguous(), groups, rows, ws.num_bits)
        if ws.num_bits == 4:
            low, high = unpacked & 0x0F, unpacked >> 4
            unpacked = torch.stack((low, high), dim=-1).flatten(1)[:, :rows]
        values = unpacked.t().float() - float(1 << (ws.num_bits - 1))
    else:
        values = raw.float()
    if ws.strategy == "tensor":
        values = values.reshape(1, 1).expand(rows, groups)
    values = values.reshape(rows, groups) if values.numel() == rows * groups else values
    if tuple(values.shape) != (rows, groups):
        raise ValueError(f"weight_zero_point is {tuple(values.shape)}, expected {(rows, groups)}")
    return values.contiguous()


def _unpacked_bytes(packed: torch.Tensor, rows: int, columns: int, bits: int) -> torch.Tensor:
    """The bytes of int32 words packing ``bits``-bit values along each row, little-endian: for
    4 bits, byte j holds column 2j in its low nibble and 2j + 1 in its high one (UINT4's own
    layout); for 8 bits, byte j is column j. ``[rows, ceil(columns * bits / 8)]`` uint8."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed weights are {packed.dtype}, not int32")
    words = ceil_div(columns * bits, 32)
    if packed.dim() != 2 or tuple(packed.shape) != (rows, words):
        raise ValueError(f"packed tensor is {tuple(packed.shape)}, expected {(rows, words)}")
    as_bytes = packed.contiguous().view(torch.uint8)
    if torch.tensor([1], dtype=torch.int32).view(torch.uint8)[0] != 1:
        as_bytes = as_bytes.view(rows, words, 4).flip(-1).reshape(rows, -1)
    return as_bytes[:, : ceil_div(columns * bits, 8)].contiguous()
