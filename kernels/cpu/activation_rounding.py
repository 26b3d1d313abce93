"""A W8A8 checkpoint's rounding of a linear layer's input in one C call
(``kernels/cpu/activation_rounding.c``): the same bits as ``ActivationQuantization.apply``,
without its half-dozen torch ops per layer."""

from __future__ import annotations

import ctypes

import torch

from kernels.cpu import library as cpu_library
from kernels.cpu.backend import KV_DTYPE_CODES
from kernels.quantized import (
    DYNAMIC_PER_TENSOR,
    DYNAMIC_PER_TOKEN,
    DYNAMIC_PER_TOKEN_GROUP,
    FP8_E4M3,
    INT8,
    STATIC,
    UINT4,
    ActivationQuantization,
)

# exports.h's rounding_strategy.
ROUND_NONE = 0
STRATEGY_CODES = {
    DYNAMIC_PER_TOKEN: 1,
    DYNAMIC_PER_TOKEN_GROUP: 2,
    DYNAMIC_PER_TENSOR: 3,
    STATIC: 4,
}
# exports.h's quantized_code: the kinds of code weights hold, and inputs round to (int8, FP8).
KIND_CODES = {INT8: 0, UINT4: 1, FP8_E4M3: 2}


class ActivationRounding(ctypes.Structure):
    """``activation_rounding`` of exports.h, field by field."""

    _fields_ = [
        ("strategy", ctypes.c_int32),
        ("kind", ctypes.c_int32),
        ("group_size", ctypes.c_int32),
        ("static_scale", ctypes.c_float),
    ]


def activation_rounding(activations: ActivationQuantization | None) -> ActivationRounding:
    """The C kernels' description of ``activations``; ``None`` leaves inputs as they are."""
    if activations is None:
        return ActivationRounding(strategy=ROUND_NONE)
    return ActivationRounding(
        strategy=STRATEGY_CODES[activations.strategy],
        kind=KIND_CODES[activations.kind],
        group_size=activations.group_size or 0,
        static_scale=activations.static_scale or 0.0,
    )


def round_activations(
    rounding: ActivationRounding,
    x: torch.Tensor,  # [rows, width] bf16 or float32, unit stride along a row
    out: torch.Tensor | None = None,  # like x (x itself rounds in place); None: a new tensor
) -> torch.Tensor:
    """``x`` rounded as ``rounding`` says, into ``out``."""
    if x.dtype not in (torch.bfloat16, torch.float32) or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"rows of bf16 or float32 with unit stride, got {x.dtype} {x.stride()}")
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if out.dtype != x.dtype or out.shape != x.shape or out.stride(1) != 1:
        raise ValueError(f"out must be {x.dtype} {tuple(x.shape)} with unit stride")
    status = cpu_library.load().pdserve_round_activations(
        ctypes.byref(rounding),
        x.data_ptr(),
        x.stride(0),
        out.data_ptr(),
        out.stride(0),
        KV_DTYPE_CODES[x.dtype],
        x.shape[0],
        x.shape[1],
    )
    if status != 0:
        raise ValueError(f"activation rounding refused its arguments (status {status})")
    return out
