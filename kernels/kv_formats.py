"""The 8-bit KV page formats, defined in plain torch: what every backend's KV store writes and
every attention kernel reads back, to the bit (the C and Triton stores are tested against these).

- ``fp8``: e4m3 values with one float32 scale per (token, KV head) vector, ``amax / 448``.
- ``int8``: int8 values with a one-byte scale code per vector; the code's scale is a float32
  power-of-two-ish step (``int8_scale``), the smallest at least ``amax / 127``; values round half
  up. The model turns int8 keys and values by a Hadamard matrix first (``kernels/kv_turn.py``).
"""

from __future__ import annotations

import torch

from kernels.interface import (
    FP8_DTYPE,
    FP8_MAX,
    FP8_MIN_SCALE,
    INT8_DTYPE,
    INT8_MAX,
    INT8_SCALE_BITS_BASE,
    INT8_SCALE_DTYPE,
)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x [..., head_dim]`` to e4m3 with one float32 scale per vector."""
    x32 = x.float()
    scale = (x32.abs().amax(dim=-1) / FP8_MAX).clamp_min(FP8_MIN_SCALE)
    quantized = (x32 / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized, scale


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.float() * scale.unsqueeze(-1)


def int8_scale_code(amax: torch.Tensor) -> torch.Tensor:
    """The code of the smallest one-byte scale ``s`` with ``127 * s >= amax`` (float32 ``amax``):
    positive floats order like their bits, so it is the ceiling of the bits over 2**20."""
    bits = (amax / INT8_MAX).view(torch.int32).long()
    code = torch.div(bits - INT8_SCALE_BITS_BASE + (1 << 20) - 1, 1 << 20, rounding_mode="floor")
    return code.clamp(0, 255).to(INT8_SCALE_DTYPE)


def int8_scale(code: torch.Tensor) -> torch.Tensor:
    """float32 scales of one-byte codes, exactly as every kernel decodes them."""
    return ((code.to(torch.int32) << 20) + INT8_SCALE_BITS_BASE).view(torch.float32)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x [..., head_dim]`` to int8 with one one-byte scale code per vector. Rounds half
    up (``floor(y + 0.5)``): exact in float32 for ``|y| <= 127`` and the same in every kernel."""
    x32 = x.float()
    code = int8_scale_code(x32.abs().amax(dim=-1))
    scaled = torch.floor(x32 / int8_scale(code).unsqueeze(-1) + 0.5)
    return scaled.clamp(-INT8_MAX, INT8_MAX).to(INT8_DTYPE), code


def dequantize_int8(x: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    return x.float() * int8_scale(code).unsqueeze(-1)
